"""What `graphfuse inspect` and `graphfuse report` say about a program, as one JSON-ready dict:
buckets with every parameter's place and owners, collectives in order, memory per rank, passes.
Offsets and slices come from the BucketLayout; nothing is recomputed here."""

from __future__ import annotations

from collections import Counter

import torch.fx

from graphfuse.capture.tracing import reads_whole, whole_cost
from graphfuse.ir import signature as sig
from graphfuse.ir.layout import BucketLayout, itemsize
from graphfuse.ir.program import Program
from graphfuse.passes import issues_collective

WAIT = "_c10d_functional.wait_tensor"


def bucket_facts(layout: BucketLayout) -> list[dict]:
    """Each bucket with each parameter's offset, elements, padding, owner ranks and slice ranges."""
    out = []
    for b in layout.buckets:
        slices = {r: {s.fqn: s for s in b.slices(r)} for r in range(layout.world_size)}
        params = []
        for slot in b.slots:
            per_rank = [
                {
                    "rank": r,
                    "shard": list(s.shard_range),
                    "param": list(s.param_range),
                    "bucket": list(b.bucket_range(r, s)),
                }
                for r in range(layout.world_size)
                if (s := slices[r].get(slot.fqn)) is not None
            ]
            params.append(
                {
                    "fqn": slot.fqn,
                    "shape": list(slot.shape),
                    "offset": slot.offset,
                    "elements": slot.numel,
                    "padding": slot.padding,
                    "owners": [x["rank"] for x in per_rank],
                    "slices": per_rank,
                }
            )
        out.append(
            {
                "name": b.name,
                "dtype": b.dtype,
                "device": b.device,
                "group": b.group,
                "elements": b.size,
                "bytes": b.nbytes,
                "shard_elements": b.shard_size,
                "padding": sum(s.padding for s in b.slots),
                "params": params,
            }
        )
    return out


def ownership_facts(program: Program) -> list[dict]:
    """Per bucket whose update reads its parameters whole (Muon's, Adafactor's), per rank: the
    parameters it owns, their update cost (graphfuse.capture.tracing.whole_cost: the update's
    counted FLOPs plus its elements) and its shard's padding."""
    out = []
    for b in program.bucket_layout.buckets:
        if not reads_whole(program.optim.groups[b.group]):
            continue
        for r in range(b.world_size):
            owned = [s.fqn for s in b.slices(r)]
            out.append(
                {
                    "bucket": b.name,
                    "rank": r,
                    "params": owned,
                    "cost": sum(whole_cost(program.optim.groups[b.group], b.slot(f).shape) for f in owned),
                    "padding": b.shard_size - sum(b.slot(f).numel for f in owned),
                }
            )
    return out


def _numel(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else None


def _payload(node: torch.fx.Node) -> tuple[int | None, int]:
    """(elements of the whole bucket-sized tensor the collective moves, its item size)."""
    val = node.meta.get("val")
    size = itemsize(str(val.dtype).removeprefix("torch.")) if isinstance(val, torch.Tensor) else 0
    op = str(getattr(node.target, "_overloadpacket", node.target))  # an OpOverload's packet names the op
    if "all_gather" in op:
        return _numel(node), size
    first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    return (_numel(first) if first is not None else None), size


def collective_facts(program: Program) -> list[dict]:
    """The collectives in issue order: op, bucket, bytes, and the node index (and fraction of the
    step's nodes) where each is issued and where it is waited for."""
    nodes = list(program.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    total = len(nodes)
    buckets = list(program.layout.buckets) if program.layout else []
    taken: dict[str, set[str]] = {}  # op -> buckets already matched (same-size buckets go in layout order)
    out = []
    for n in nodes:
        if not issues_collective(n):
            continue
        op = str(n.target._overloadpacket).removeprefix("_c10d_functional.")
        elements, size = _payload(n)
        bucket = next(
            (b.name for b in buckets if b.size == elements and b.name not in taken.setdefault(op, set())), None
        )
        if bucket is not None:
            taken[op].add(bucket)
        waits = [u for u in n.users if str(u.target).startswith(WAIT)]
        waited = order[waits[0]] if waits else None
        out.append(
            {
                "op": op,
                "node": n.name,
                "bucket": bucket,
                "elements": elements,
                "bytes": elements * size if elements is not None else None,
                "issued": order[n],
                "waited": waited,
                "issued_at": round(order[n] / total, 4),
                "waited_at": None if waited is None else round(waited / total, 4),
            }
        )
    return out


def _nbytes(meta) -> int:
    n = 1
    for d in meta.shape:
        n *= d
    return n * itemsize(meta.dtype)


def memory_facts(program: Program) -> list[dict]:
    """Bytes each rank holds of parameters, gradients and optimizer state, against unsharded
    (every rank holding everything). Every rank's shards are the same size (the layout pads)."""
    layout, inputs = program.bucket_layout, program.signature.inputs
    params = sum(b.nbytes for b in layout.buckets)
    unpadded = sum(s.numel * itemsize(b.dtype) for b in layout.buckets for s in b.slots)
    shards = [s for s in inputs if s.role == sig.SHARD]  # "bucket<b>.<state>", in the state's own dtype
    state = sum(_nbytes(program.inputs_meta[s.name]) for s in shards)
    buckets = {b.name: b for b in layout.buckets}

    def elements(shard: str) -> int:  # of every member's state, in its own shape (Adafactor's factors)
        bucket, what = shard.split(".", 1)
        return sum(s.numel for s in program.state_layout(buckets[bucket], what).slots)

    unsharded_state = sum(elements(s.name) * itemsize(program.inputs_meta[s.name].dtype) for s in shards)
    grads_kept = sum(b.shard_size * itemsize(b.dtype) for b in layout.buckets)
    row = {
        "params": params,
        "params_unsharded": unpadded,
        "grads": params,
        "grads_after_reduce_scatter": grads_kept,
        "grads_unsharded": unpadded,
        "optimizer_state": state,
        "optimizer_state_unsharded": unsharded_state,
    }
    return [{"rank": r, **row} for r in range(layout.world_size)]


def node_phases(program: Program) -> list[str]:
    """The phase of every node in order (placeholders "input", the output "output")."""
    out = []
    for n in program.graph.nodes:
        out.append({"placeholder": "input", "output": "output"}.get(n.op) or n.meta.get("phase", "other"))
    return out


def pass_facts(program: Program, stats: list[dict] | None) -> list[dict]:
    """The passes that ran, with their statistics where a trace record kept them (program files
    keep only the names)."""
    if stats and [s["name"] for s in stats] == list(program.pass_names):
        return stats
    return [{"name": name} for name in program.pass_names]


def program_facts(program: Program, path: str, trace_rank: dict | None = None) -> dict:
    """Everything inspect prints about `program`, JSON-ready."""
    after = Counter(p for p in node_phases(program) if p not in ("input", "output"))
    s, layout = program.strategy, program.bucket_layout
    return {
        "kind": "program",
        "path": path,
        "rank": program.rank,
        "world_size": program.world_size,
        "group_name": program.group_name,
        "optimizer": program.optim.cls_name,
        "strategy": s.to_json(),
        "nodes": {
            "before_passes": trace_rank.get("captured_nodes") if trace_rank else None,
            "after_passes": dict(after),
            "total": sum(1 for _ in program.graph.nodes),
        },
        "layout": {
            "fingerprint": layout.fingerprint,
            "world_size": layout.world_size,
            "align_bytes": layout.align_bytes,
            "bucket_bytes": layout.bucket_bytes,
        },
        "buckets": bucket_facts(layout),
        "ownership": ownership_facts(program),
        "collectives": collective_facts(program),
        "memory": memory_facts(program),
        "passes": pass_facts(program, trace_rank.get("passes") if trace_rank else None),
    }


def owners_text(p: dict) -> str:
    return ",".join(str(r) for r in p["owners"]) or "-"


def slices_text(p: dict) -> str:
    """`r0 [a, b) r1 [c, d)`: each owner's elements of the parameter (flat, in the parameter)."""
    return " ".join(f"r{x['rank']} [{x['param'][0]}, {x['param'][1]})" for x in p["slices"])
