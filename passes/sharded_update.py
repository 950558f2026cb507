"""Sharded update: replace the per-parameter optimizer update with ONE fused elementwise
update per bucket shard, over flat state shards (and fp32 master shards where the strategy
asks). Each parameter's part of a shard is its `slice@<fqn>` view (see BucketLayout.slices).
A group whose update reads each parameter whole (Muon, Adafactor) runs it once per parameter the
rank owns; a state not shaped like its parameter (Adafactor's factors) has a shard laid out
apart (Program.state_layout).
Reads the `grad_shards` hand-off; hands on `param_shards` (the updated shard in the bucket's
dtype) for the all-gather."""

from __future__ import annotations

import torch

from graphfuse import optim as gopt
from graphfuse.capture.tracing import dtype_name, reads_whole, update_function
from graphfuse.errors import GraphfuseError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, TensorMeta
from graphfuse.ir.state_plan import MASTER

from ._contract import always, expect
from .graph import (
    add_input,
    aten,
    call,
    eliminate_dead_code,
    inline,
    input_nodes,
    outputs,
    placeholders,
    remove_input,
    set_outputs,
    sync_inputs,
)

NAME = "sharded_update"
NEEDS = ("grad_shards",)
PROVIDES = ("param_shards",)


applies = always  # every program


def requires(program: Program) -> None:
    expect(program, NAME, not program.signature.names(sig.SHARD), "no state shard inputs yet")


def shard_dtype(program: Program, bucket) -> str:
    m = program.strategy.master_dtype
    return bucket.dtype if m is None else dtype_name(m)


def uses_master(program: Program, bucket) -> bool:
    return shard_dtype(program, bucket) != bucket.dtype


def whole_update_function(spec: gopt.GroupSpec, bucket, rank: int, batched: bool = False, states=None):
    """The update of rank `rank`'s shard of a bucket laid out whole (graphfuse.ir.ownership):
    `gopt.update` of each parameter the rank owns, on its whole-matrix views of the shard, with
    the padding passed through; `fn(param, grad, *states, *scalars) -> [new param, *new states]`.
    `states` (name -> the layout of its shard, Program.state_layout; by default every state of
    the group, shaped like the bucket) says where each member's state lies: a state not shaped
    like its parameter (Adafactor's row and column factors) has a layout of its own.
    `batched`: parameters of one `gopt.stack_key` are updated together, stacked, a tall one
    transposed where it joins its transposes (Muon's Newton-Schulz as batched products, for
    CUDA; not bitwise with one at a time)."""
    slices = bucket.slices(rank)
    for s in slices:
        slot = bucket.slot(s.fqn)
        if s.param_start != 0 or s.numel != slot.numel:
            raise GraphfuseError(
                f"{bucket.name}: rank {rank}'s shard holds elements [{s.param_start}, {s.param_start + s.numel}) of "
                f"{s.fqn} (of {slot.numel}), but its {spec.kind} update reads the parameter whole; plan the layout "
                "with graphfuse.ir.layout.plan_buckets(whole=...)"
            )
    layouts = dict.fromkeys(spec.state_names, bucket) if states is None else states
    names = tuple(layouts)
    together: dict = {}
    flipped = set()  # the fqns that join their stack transposed
    for s in slices:
        key = gopt.stack_key(spec, bucket.slot(s.fqn).shape) if batched else None
        if key is not None and key[1]:
            flipped.add(s.fqn)
        together.setdefault(s.fqn if key is None else key[0], []).append(s)

    def fn(p, g, *rest):
        flats = dict(zip(names, rest[: len(names)]))
        scalars = dict(zip(spec.scalar_names, rest[len(names) :]))
        done: dict[str, dict[str, torch.Tensor]] = {}  # fqn -> {"param" or state: new flat values}
        for members in together.values():

            def views(t, layout, members=members):
                vs = []
                for s in members:
                    slot = layout.slot(s.fqn)
                    lo = slot.offset - layout.shard_range(rank)[0]
                    v = t[lo : lo + slot.numel].view(slot.shape)
                    vs.append(v.mT if s.fqn in flipped else v)
                return vs[0] if len(vs) == 1 else torch.stack(vs)

            mine = [n for n in names if members[0].fqn in layouts[n].fqns]
            new_p, new = gopt.update(
                spec, views(p, bucket), views(g, bucket), {n: views(flats[n], layouts[n]) for n in mine}, scalars
            )
            for i, s in enumerate(members):
                outs = {"param": new_p, **{n: new[n] for n in mine}}
                mine_out = {k: o if len(members) == 1 else o[i] for k, o in outs.items()}
                done[s.fqn] = {k: (o.mT if s.fqn in flipped else o).reshape(-1) for k, o in mine_out.items()}
        out = [_assemble(p, bucket, rank, done, "param")]
        return out + [_assemble(flats[n], layouts[n], rank, done, n) for n in names]

    return fn


def _assemble(flat: torch.Tensor, layout, rank: int, done: dict, what: str) -> torch.Tensor:
    """Rank `rank`'s new shard of `layout`: each member's new values (`done[fqn][what]`) where
    it lies, padding and other ranks' runs passed through from the old shard `flat`."""
    pieces, at = [], 0
    for a, b, fqn in [*((s.shard_start, s.shard_end, s.fqn) for s in layout.slices(rank)), (None, None, None)]:
        a = layout.shard_size if a is None else a
        if at < a:
            pieces.append(flat[at:a])
        if fqn is not None:
            pieces.append(done[fqn][what])
            at = b
    return torch.cat(pieces)


def run(program: Program) -> Program:
    graph, layout = program.graph, program.bucket_layout
    rank = program.rank
    # The traced update's outputs (per-parameter states, whole new buckets) go; once the fused update reads the
    # gradient shards,
    # dead-code elimination removes the ops only the old outputs needed.
    new_outputs = [(s, n) for s, n in outputs(program) if s.role not in (sig.NEW_BUCKET, sig.NEW_STATE)]
    out_node = graph.output_node()
    inputs = input_nodes(program)
    param_shards = []
    grad_shards = program.handoffs.grad_shards
    assert grad_shards is not None  # NEEDS grad_shards: run_pass checked that an earlier pass set them
    for bucket, grad in zip(layout.buckets, grad_shards):
        spec = program.optim.groups[bucket.group]
        dtype = shard_dtype(program, bucket)
        meta = TensorMeta((bucket.shard_size,), dtype, bucket.device)
        states = {s: program.state_layout(bucket, s) for s in program.bucket_states(bucket)}
        state_metas = [TensorMeta((layout.shard_size,), dtype, bucket.device) for layout in states.values()]
        state_nodes = [
            add_input(program, sig.InputSpec(sig.SHARD, f"{bucket.name}.{s}"), m) for s, m in zip(states, state_metas)
        ]
        master = uses_master(program, bucket)
        if master:
            master_node = add_input(program, sig.InputSpec(sig.SHARD, f"{bucket.name}.{MASTER}"), meta)
        scalar_nodes = [inputs[sig.InputSpec(sig.SCALAR, f"group{bucket.group}.{s}")] for s in spec.scalar_names]
        scalar_metas = [program.inputs_meta[f"group{bucket.group}.{s}"] for s in spec.scalar_names]
        bucket_node = inputs[sig.InputSpec(sig.BUCKET, bucket.name)]
        lo, hi = bucket.shard_range(rank)
        with graph.inserting_before(out_node):
            param = (
                master_node if master else call(graph, aten.slice.Tensor, bucket_node, 0, lo, hi, phase=sig.OPTIMIZER)
            )
            batched = bucket.device == "cuda"  # matrices of one gopt.stack_key together
            if reads_whole(spec):
                fn = whole_update_function(spec, bucket, rank, batched, states)
            else:  # every state shaped like its parameter: one update of the flat shard
                fn = update_function(spec, tuple(states))
            new = inline(
                graph,
                fn,
                [param, grad, *state_nodes, *scalar_nodes],
                [meta, meta, *state_metas, *scalar_metas],
                sig.OPTIMIZER,
            )
            new_param, new_states = new[0], new[1:]
            if master:
                new_outputs.append(
                    (sig.OutputSpec(sig.NEW_SHARD, f"{bucket.name}.{MASTER}", f"{bucket.name}.{MASTER}"), new_param)
                )
                new_param = call(
                    graph, aten._to_copy.default, new_param, dtype=getattr(torch, bucket.dtype), phase=sig.OPTIMIZER
                )
        for s, n in zip(states, new_states):
            new_outputs.append((sig.OutputSpec(sig.NEW_SHARD, f"{bucket.name}.{s}", f"{bucket.name}.{s}"), n))
        param_shards.append(new_param)
    program = set_outputs(program, new_outputs).handing_off(param_shards=tuple(param_shards))
    eliminate_dead_code(program)
    for n in [n for n in placeholders(graph) if n.meta["gf_input"].role == sig.STATE]:
        remove_input(program, n)
    return sync_inputs(program)


def ensures(program: Program) -> None:
    expect(program, NAME, not program.signature.names(sig.STATE), "no per-parameter optimizer state input left")
    expect(
        program,
        NAME,
        not program.signature.output_names(sig.NEW_BUCKET),
        "no whole-bucket output left (the all-gather makes them)",
    )
    expected = sorted(f"{b.name}.{s}" for b in program.bucket_layout.buckets for s in program.bucket_states(b))
    states = sorted(n for n in program.signature.names(sig.SHARD) if not n.endswith(f".{MASTER}"))
    expect(program, NAME, states == expected, f"one state shard input per bucket and state, {expected}")
    shards = sorted(program.signature.names(sig.SHARD))
    expect(
        program,
        NAME,
        sorted(program.signature.output_names(sig.NEW_SHARD)) == shards,
        "a new-shard output for every shard input",
    )
