"""The overlap model: each collective's bytes and bucket, NCCL-tests' bus-bandwidth time of it, and
the exposed communication of graphfuse's, DDP + ZeRO's and FSDP2's schedules at N GPUs
(tools/overlap_report.py prints it; its docstring states the model and its assumptions)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import cast

import torch

from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program
from graphfuse.passes import issues_collective
from graphfuse.passes.verify import fake_values

BUSBW_GBPS = {"all_reduce": 470.0, "all_gather": 450.0, "reduce_scatter": 450.0}
LATENCY_US = 10.0
OPS = {"reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce"}


def collective_seconds(op: str, nbytes: int, n: int, busbw: dict[str, float], latency_s: float) -> float:
    """NCCL-tests' bus-bandwidth model of one collective of `nbytes` (the full buffer) at `n` GPUs."""
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return latency_s + factor * nbytes / (busbw[op] * 1e9)


def simulate(compute_s: float, collectives: list[dict]) -> tuple[float, float]:
    """(step seconds, exposed seconds) for collectives {"issue", "wait", "seconds"} placed at
    compute times (seconds into a step without communication), run one at a time in issue order."""
    events = sorted(
        [(c["issue"], 0, i) for i, c in enumerate(collectives)] + [(c["wait"], 1, i) for i, c in enumerate(collectives)]
    )
    stalled, comm_free, ends = 0.0, 0.0, {}
    for t, is_wait, i in events:
        now = t + stalled
        if not is_wait:
            ends[i] = max(now, comm_free) + collectives[i]["seconds"]
            comm_free = ends[i]
        elif ends[i] > now:
            stalled += ends[i] - now
    return compute_s + stalled, stalled


@dataclass(frozen=True)
class Collective:
    """One collective of a program, by the FX node that issues it."""

    name: str  # the FX node that issues it
    op: str  # all_gather, reduce_scatter, all_reduce
    bucket: str | None
    nbytes: int  # the whole buffer: reduce-scatter input, all-gather output, all-reduce input


_COLLECTIVES: dict[int, dict[str, Collective]] = {}  # by id(program): fake propagation takes seconds at GPT-2 size


def collectives_of(program: Program | SavedProgram) -> dict[str, Collective]:
    """Every collective of the program by FX node name, with its bucket and bytes. Buckets: a
    deferred all-gather reads its bucket's placeholder; the other passes create one
    reduce-scatter and one all-gather per bucket in layout order. (A walk over fx's node order
    finds them: no dependency analysis is needed, so no graph library.)"""
    if isinstance(program, SavedProgram):
        return program.collectives
    if id(program) not in _COLLECTIVES:
        _COLLECTIVES[id(program)] = _collectives_of(program)
    return _COLLECTIVES[id(program)]


def _collectives_of(program: Program) -> dict[str, Collective]:
    values = fake_values(program)
    buckets = program.bucket_layout.buckets
    seen: dict[str, int] = {}
    out = {}
    for n in program.graph.nodes:
        if not issues_collective(n):
            continue
        op = OPS[n.target._overloadpacket.__name__]
        src = n.args[0].args[0] if n.args[0].op == "call_function" and n.args[0].args else None
        if (
            op != "all_reduce"
            and src is not None
            and getattr(src, "op", None) == "placeholder"
            and src.meta["gf_input"].role == sig.BUCKET
        ):
            bucket = src.meta["gf_input"].name
        elif op == "all_reduce":
            bucket = None
        else:
            bucket = buckets[seen.get(op, 0)].name
            seen[op] = seen.get(op, 0) + 1
        val = cast(torch.Tensor, values[n])  # what a collective returns: a tensor
        out[n.name] = Collective(
            n.name, op, bucket, val.numel() * val.element_size() * (program.world_size if op == "reduce_scatter" else 1)
        )
    return out


def phases(program: Program) -> dict[str, str]:
    """FX node name -> the phase capture gave it (forward, backward, optimizer; "" for inputs)."""
    return {n.name: n.meta.get("phase", "") for n in program.graph.nodes}


def per_bucket(m: Measured, ns: list[int], busbw: dict[str, float], latency_s: float) -> list[dict]:
    """One entry per bucket: each of its collectives' issue and wait times and positions in the
    schedule, the compute between them, its bytes and its modelled time at each N."""
    program, events = m.program, m.events
    info = collectives_of(program)
    issued = {n: t for k, n, t in events if k == "issue"}
    waited = {n: t for k, n, t in events if k == "wait"}
    out = []
    for bucket in program.bucket_layout.buckets:
        cs = [c for c in info.values() if c.bucket == bucket.name]
        out.append(
            {
                "bucket": bucket.name,
                "bytes": bucket.nbytes,
                "collectives": [
                    {
                        "op": c.op,
                        "node": c.name,
                        "bytes": c.nbytes,
                        "issue_ms": 1e3 * issued[c.name],
                        "wait_ms": 1e3 * waited[c.name],
                        "compute_between_ms": 1e3 * (waited[c.name] - issued[c.name]),
                        "issue_position": m.positions.get(("issue", c.name)),
                        "wait_position": m.positions.get(("wait", c.name)),
                        "modelled_ms": {
                            str(n): 1e3 * collective_seconds(c.op, c.nbytes, n, busbw, latency_s) for n in ns
                        },
                    }
                    for c in sorted(cs, key=lambda c: issued[c.name])
                ],
            }
        )
    return out


def scale_update(events: list, ops: dict[str, str], traced: int, n: int) -> list:
    """`events` with the update's compute scaled by traced/N, as it runs on a 1/N shard. The
    update is what runs after the last reduce-scatter issue, except what follows an all-gather's
    issue or wait: issuing it (host work, N-independent) and copying the gathered buckets into
    the parameters (whole buckets at any N). Those spans keep their length and only move."""
    start = max((t for k, name, t in events if k == "issue" and ops[name] == "reduce_scatter"), default=0.0)
    scale, shift, out = traced / n, 0.0, []
    for i, (k, name, t) in enumerate(events):
        if i and t > start:
            pk, pname, pt = events[i - 1]
            if ops.get(pname) != "all_gather":
                shift += (t - max(pt, start)) * (scale - 1)
        out.append((k, name, t + shift))
    return out


@dataclass
class Measured:
    """A program's schedule as timed (graphfuse.analysis.timeline.measure) or read back from a report."""

    program: Program | SavedProgram
    events: list  # (kind, FX node name, seconds since the step's start), from `timeline`
    positions: dict  # (kind, FX node name) -> kernels (inductor) or FX ops (eager) before it
    length: int  # kernels or FX ops in the step
    marks: dict | None = None  # the timing marks' cost taken off `events` (see `without_mark_cost`)

    def at(self, n: int) -> list:
        """The timeline with the update's compute scaled from the traced world size to `n`."""
        ops = {name: c.op for name, c in collectives_of(self.program).items()}
        return scale_update(self.events, ops, self.program.world_size, n)


@dataclass
class SavedProgram:
    """What the predictions read of a program (its traced world size, its buckets' names and
    bytes in gradient order), rebuilt from a saved report for --replay."""

    world_size: int
    layout: SimpleNamespace
    collectives: dict  # FX node name -> Collective, as collectives_of gives them

    @property
    def bucket_layout(self) -> SimpleNamespace:
        """`layout`, read as a Program's (its buckets' names and bytes)."""
        return self.layout


def measured_from_report(saved: dict) -> dict[str, Measured]:
    """The measured modes of a report written with --json, for predictions under another model
    (--replay): the schedule as measured, the collectives and buckets as the report lists them."""
    out = {}
    for mode, r in saved["modes"].items():
        buckets = SimpleNamespace(buckets=[SimpleNamespace(name=b["bucket"], nbytes=b["bytes"]) for b in r["buckets"]])
        collectives = {
            c["node"]: Collective(c["node"], c["op"], b["bucket"], c["bytes"])
            for b in r["buckets"]
            for c in b["collectives"]
        }
        program = SavedProgram(saved["traced_world"], buckets, collectives)
        positions = {
            (k, c["node"]): c[f"{k}_position"]
            for b in r["buckets"]
            for c in b["collectives"]
            for k in ("issue", "wait")
        }
        events = [(e["kind"], e["node"], e["ms"] / 1e3) for e in r["schedule"]]
        out[mode] = Measured(program, events, positions, r["schedule_length"], r.get("timing_marks"))
    return out


def graphfuse_collectives(m: Measured, n: int, busbw: dict[str, float], latency_s: float) -> list[dict]:
    """The program's own collectives at `n` GPUs, placed on its timeline scaled to `n`."""
    info, events = collectives_of(m.program), m.at(n)
    waits = {name: t for k, name, t in events if k == "wait"}
    return [
        {
            "issue": t,
            "wait": waits[name],
            "seconds": collective_seconds(info[name].op, info[name].nbytes, n, busbw, latency_s),
        }
        for k, name, t in events
        if k == "issue"
    ]


def peer_collectives(
    plain: Measured, deferred: Measured | None, n: int, busbw: dict[str, float], latency_s: float
) -> dict[str, tuple[float, list[dict]]]:
    """DDP + ZeroRedundancyOptimizer and FSDP2-like schedules of the same buckets, placed on the
    end-of-step program's timeline: a bucket's gradients are ready where graphfuse issues its
    reduce-scatter, the backward ends at the last of those; a bucket is first used in the forward
    where the deferred program waits for its all-gather (at 0 without a deferred program).
    DDP all-reduces each bucket when ready and waits at the end of the backward; ZeRO's update
    runs on a 1/N shard and ends with the parameters' exchange (as an all-gather), exposed.
    FSDP2 (one unit per bucket): all-gather each unit in the forward (prefetched when the unit
    before it starts) and again in the backward (prefetched one unit ahead), reduce-scatter each
    unit's gradients when ready; no exchange after the update."""
    info, events = collectives_of(plain.program), plain.at(n)
    buckets = plain.program.bucket_layout.buckets  # gradient order
    ready = {info[name].bucket: t for k, name, t in events if k == "issue" and info[name].op == "reduce_scatter"}
    end_backward, total = max(ready.values()), events[-1][2]
    start_backward = next((t for k, _, t in events if k == "backward"), 0.0)
    fwd_use = {b.name: 0.0 for b in buckets}
    if deferred is not None:
        dinfo = collectives_of(deferred.program)
        fwd_use.update(
            {dinfo[name].bucket: t for k, name, t in deferred.at(n) if k == "wait" and dinfo[name].op == "all_gather"}
        )

    def t(op: str, nbytes: int) -> float:
        return collective_seconds(op, nbytes, n, busbw, latency_s)

    ddp = [{"issue": ready[b.name], "wait": end_backward, "seconds": t("all_reduce", b.nbytes)} for b in buckets]
    ddp.append({"issue": total, "wait": total, "seconds": t("all_gather", sum(b.nbytes for b in buckets))})
    fsdp = []
    forward = sorted(buckets, key=lambda b: fwd_use[b.name])
    for i, b in enumerate(forward):
        fsdp.append(
            {
                "issue": fwd_use[forward[i - 1].name] if i else 0.0,
                "wait": fwd_use[b.name],
                "seconds": t("all_gather", b.nbytes),
            }
        )
    starts = [start_backward] + [ready[b.name] for b in buckets]  # bucket i's backward starts at starts[i]
    for i, b in enumerate(buckets):
        fsdp.append({"issue": starts[max(i - 1, 0)], "wait": starts[i], "seconds": t("all_gather", b.nbytes)})
        fsdp.append({"issue": ready[b.name], "wait": end_backward, "seconds": t("reduce_scatter", b.nbytes)})
    return {"ddp_zero": (total, ddp), "fsdp2": (total, fsdp)}


def predictions(
    plain: Measured, deferred: Measured | None, ns: list[int], busbw: dict[str, float], latency_s: float
) -> dict:
    """Predicted step and exposed communication (ms) at each N, per schedule."""
    out: dict[str, dict] = {}
    for n in ns:
        rows = {"graphfuse": (plain.at(n)[-1][2], graphfuse_collectives(plain, n, busbw, latency_s))}
        if deferred is not None:
            rows["graphfuse_deferred"] = (deferred.at(n)[-1][2], graphfuse_collectives(deferred, n, busbw, latency_s))
        rows.update(peer_collectives(plain, deferred, n, busbw, latency_s))
        for name, (compute, colls) in rows.items():
            step, exposed = simulate(compute, colls)
            comm = sum(c["seconds"] for c in colls)
            out.setdefault(name, {})[str(n)] = {
                "compute_ms": 1e3 * compute,
                "comm_ms": 1e3 * comm,
                "exposed_ms": 1e3 * exposed,
                "step_ms": 1e3 * step,
            }
    return out


def report(measured: dict[str, Measured], ns: list[int], busbw: dict, latency_s: float) -> dict:
    """The JSON report of measured modes: per mode its compute, buckets and schedule; per
    schedule (graphfuse, graphfuse_deferred, ddp_zero, fsdp2) its predictions at each N."""
    modes = {
        mode: {
            "compute_ms": 1e3 * m.events[-1][2],
            "schedule_length": m.length,
            "timing_marks": m.marks,
            "buckets": per_bucket(m, ns, busbw, latency_s),
            "schedule": [{"kind": k, "node": name, "ms": 1e3 * t} for k, name, t in m.events],
        }
        for mode, m in measured.items()
    }
    plain = measured.get("end_of_step_gather") or next(iter(measured.values()))
    deferred = measured.get("deferred_gather")
    return {"modes": modes, "predicted": predictions(plain, deferred, ns, busbw, latency_s)}
