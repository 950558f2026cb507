"""Overlap report: where a graphfuse step issues and waits for each collective, the compute time
between the two, and the communication exposed at N GPUs as modelled from a bus-bandwidth table;
the same model applied to a DDP + ZeroRedundancyOptimizer schedule and an FSDP2-like schedule.

    python tools/overlap_report.py --device cpu --preset tiny            # a small GPT, both gather modes
    python tools/overlap_report.py --device cuda --preset gpt2 --executor inductor --json out.json
    python tools/overlap_report.py --program prog_dir --device cpu        # a saved program
    python tools/overlap_report.py --replay out.json --busbw all_gather=360  # predict again from a report

How it measures. The step runs on the local device under a fake process group of the traced
world size (torch's "fake" backend: collectives return at once), so the time measured is pure
compute. With `--executor inductor` the schedule is read from inductor's generated wrapper code
(the order of kernels, collective calls and wait_tensor calls; each call is matched to its FX
node through the "Topologically Sorted Source Nodes" comment) and a timing mark (device
synchronise + clock) is inserted before each issue and after each wait; with `--executor eager`
the FX graph's order is the schedule and an fx.Interpreter takes the same marks. The step is
also timed without marks, and the marks' mean cost is taken off each time for every mark before
it (`without_mark_cost`): synchronising stalls the device, which mattered at 190 marks. Plain FX
traversal is all the dependency analysis needs (which node is a collective, its bucket, its
wait), so no graph library is used.

How it models. A collective of S bytes (the whole bucket: reduce-scatter input, all-gather
output) at N GPUs takes latency + S·(N−1)/N / busbw (all-gather, reduce-scatter) or
latency + 2·S·(N−1)/N / busbw (all-reduce): NCCL-tests' definition of bus bandwidth. Collectives
run one at a time in issue order on one communication stream; a wait stalls compute until its
collective ends. Exposed communication = the sum of stalls; predicted step = compute + exposed.
The update's compute (after the last reduce-scatter issue) is scaled by traced_world/N, as it
runs on a 1/N shard; the spans that follow an all-gather's issue or wait (issuing it, copying
the gathered buckets into the parameters: N-independent) are not.

Bus bandwidth defaults (GB/s, `--busbw`), for one 8-GPU NVLink/NVSwitch host (H100/H200 SXM;
both have NVLink 4 at 450 GB/s per direction per GPU):
- all_reduce 470: the middle of the 460-480 GB/s busbw that "NCCL-tests in practice"
  (docs.alayanew.com tech blog, 2026-05-06) gives for all_reduce_perf on 8xH100 SXM5 at large sizes.
- all_gather and reduce_scatter 450: no published all_gather_perf/reduce_scatter_perf figure was
  at hand; 450 GB/s is NVLink 4's per-direction limit, an upper bound, so their modelled times are
  lower bounds (pass measured figures with --busbw).
The same figures are used at N = 2 and 4 (on an NVSwitch host busbw varies little with N for
large messages: an assumption). Latency: 10 us per collective (an assumption, --latency-us).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

BUSBW_GBPS = {"all_reduce": 470.0, "all_gather": 450.0, "reduce_scatter": 450.0}
LATENCY_US = 10.0
OPS = {"reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce"}
PRESETS = {
    "tiny": dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64),
    "gpt2": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


# ---- the model (pure arithmetic) ------------------------------------------------------
def collective_seconds(op: str, nbytes: int, n: int, busbw: dict[str, float], latency_s: float) -> float:
    """NCCL-tests' bus-bandwidth model of one collective of `nbytes` (the full buffer) at `n` GPUs."""
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return latency_s + factor * nbytes / (busbw[op] * 1e9)


def simulate(compute_s: float, collectives: list[dict]) -> tuple[float, float]:
    """(step seconds, exposed seconds) for collectives {"issue", "wait", "seconds"} placed at
    compute times (seconds into a step without communication), run one at a time in issue order."""
    events = sorted([(c["issue"], 0, i) for i, c in enumerate(collectives)] + [(c["wait"], 1, i) for i, c in enumerate(collectives)])
    stalled, comm_free, ends = 0.0, 0.0, {}
    for t, is_wait, i in events:
        now = t + stalled
        if not is_wait:
            ends[i] = max(now, comm_free) + collectives[i]["seconds"]
            comm_free = ends[i]
        elif ends[i] > now:
            stalled += ends[i] - now
    return compute_s + stalled, stalled


# ---- the program and its collectives ------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    name: str  # the FX node that issues it
    op: str  # all_gather, reduce_scatter, all_reduce
    bucket: str | None
    nbytes: int  # the whole buffer: reduce-scatter input, all-gather output, all-reduce input


_COLLECTIVES: dict[int, dict[str, Collective]] = {}  # by id(program): fake propagation takes seconds at GPT-2 size


def collectives_of(program) -> dict[str, Collective]:
    """Every collective of the program by FX node name, with its bucket and bytes. Buckets: a
    deferred all-gather reads its bucket's placeholder; the other passes create one
    reduce-scatter and one all-gather per bucket in layout order."""
    if isinstance(program, SavedProgram):
        return program.collectives
    if id(program) not in _COLLECTIVES:
        _COLLECTIVES[id(program)] = _collectives_of(program)
    return _COLLECTIVES[id(program)]


def _collectives_of(program) -> dict[str, Collective]:
    from graphfuse.passes import issues_collective
    from graphfuse.passes.verify import fake_values

    from graphfuse.ir import signature as sig

    values = fake_values(program)
    buckets = program.layout.buckets
    seen: dict[str, int] = {}
    out = {}
    for n in program.graph.nodes:
        if not issues_collective(n):
            continue
        op = OPS[n.target._overloadpacket.__name__]
        src = n.args[0].args[0] if n.args[0].op == "call_function" and n.args[0].args else None
        if op != "all_reduce" and getattr(src, "op", None) == "placeholder" and src.meta["gf_input"].role == sig.BUCKET:
            bucket = src.meta["gf_input"].name
        elif op == "all_reduce":
            bucket = None
        else:
            bucket = buckets[seen.get(op, 0)].name
            seen[op] = seen.get(op, 0) + 1
        val = values[n]
        out[n.name] = Collective(n.name, op, bucket, val.numel() * val.element_size() * (program.world_size if op == "reduce_scatter" else 1))
    return out


def phases(program) -> dict[str, str]:
    return {n.name: n.meta.get("phase", "") for n in program.graph.nodes}


# ---- timelines --------------------------------------------------------------------------
class Marks:
    """Clock marks (after a device synchronise) taken as the step runs: (kind, node name, seconds)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.t, self.positions, self.length, self.on = device, [], {}, 0, True

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, kind: str, name: str = "", position: int = -1) -> None:
        if not self.on:  # a run timed without marks (see `timeline`)
            return
        self.sync()
        self.t.append((kind, name, time.perf_counter()))
        if position >= 0:  # where in the schedule (kernels or FX ops before it), for the report
            self.positions[(kind, name)] = position


def eager_runner(program, marks: Marks):
    from graphfuse.passes import issues_collective

    phase = phases(program)
    wait = torch.ops._c10d_functional.wait_tensor.default
    marks.length = sum(1 for n in program.graph.nodes if n.op == "call_function" and not issues_collective(n) and n.target is not wait)

    class Marking(torch.fx.Interpreter):
        def run_node(self, n):
            if issues_collective(n):
                marks("issue", n.name, self.done)
            elif phase.get(n.name) == "backward" and not any(k == "backward" for k, _, _ in marks.t):
                marks("backward")
            out = super().run_node(n)
            if n.target is wait:
                marks("wait", n.args[0].name, self.done)
            elif n.op == "call_function" and not issues_collective(n):
                self.done += 1  # FX ops run so far (collectives and waits not counted)
            return out

    def run(args):
        interpreter = Marking(program.graph_module)
        interpreter.done = 0
        return interpreter.run(*args)

    return run


ISSUE = re.compile(r"^(\s+)(buf\w+) = torch\.ops\._c10d_functional\.(reduce_scatter_tensor|all_gather_into_tensor|all_reduce)\.default\(")
WAIT = re.compile(r"^(\s+)torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\w+)\)")
# A kernel launch in the wrapper: C++ (CPU), Triton (CUDA), an extern kernel (mm) or an aten fallback.
KERNEL = re.compile(r"^\s+(?:\w+ = )?(?:extern_kernels\.\w+|cpp_fused_\w+|triton_\w+\.run|torch\.ops\.aten\.\w+\.\w+)\(")
SOURCES = re.compile(r"^\s+# Topologically Sorted Source Nodes: \[([^\]]*)\]")


def instrument(source: str, names: set[str], phase: dict[str, str]) -> str:
    """Inductor's wrapper code with a mark before each collective's issue (`names`: the FX nodes
    that issue collectives), after each wait, and before the first kernel of the backward
    (`phase`: FX node name -> phase)."""
    lines, out, sources, buf_of, in_call, backward_seen, kernels = source.splitlines(), [], [], {}, False, False, 0
    for line in lines:
        if re.match(r"^\s+def call\(self, args\):", line) or re.match(r"^def call\(args\):", line):
            in_call = True
            out.append(line)
            continue
        m = SOURCES.match(line)
        if in_call and m:
            sources = [s.strip() for s in m.group(1).split(",")]
            if not backward_seen and any(phase.get(s) == "backward" for s in sources):
                backward_seen = True
                out.append(f"{line[: len(line) - len(line.lstrip())]}_gf_mark('backward')")
        issue, wait = ISSUE.match(line), WAIT.match(line)
        kernels += bool(in_call and KERNEL.match(line))
        if in_call and issue:
            node = next(s for s in sources if s in names)
            buf_of[issue.group(2)] = node
            out.append(f"{issue.group(1)}_gf_mark('issue', {node!r}, {kernels})")
        out.append(line)
        if in_call and wait and wait.group(2) in buf_of:
            out.append(f"{wait.group(1)}_gf_mark('wait', {buf_of[wait.group(2)]!r}, {kernels})")
    out.append(f"_GF_KERNELS = {kernels}")
    return "\n".join(out)


def inductor_runner(program, args: list, marks: Marks):
    """Compile as graphfuse.frontends.dist_model does (in place), then run the instrumented wrapper code."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from graphfuse.compiler.in_place import compile_in_place

    with inductor_config.patch(fx_graph_cache=False):  # a cache hit would generate no code to read
        _, codes = run_and_get_code(lambda: compile_in_place(program, args))
    source = instrument(codes[-1], set(collectives_of(program)), phases(program))
    ns = {"__name__": "graphfuse_overlap_report", "_gf_mark": marks}
    exec(compile(source, "<graphfuse overlap_report>", "exec"), ns)
    marks.length = ns["_GF_KERNELS"]
    return (lambda a: ns["call"](list(a))), source


def timeline(run, args: list, marks: Marks, reps: int) -> tuple[list[tuple[str, str, float]], dict]:
    """Each mark's time since the step's start (median over `reps` runs), corrected for the
    marks' own cost, and that cost. A mark synchronises the device, so the GPU idles while the
    host launches the next kernels: with many collectives the marks lengthen the step (by
    about 20 ms in 190 marks for a 1B model's 93 buckets on an H200). The step is also timed
    without marks; the difference, spread evenly over the marks, is taken off each event for
    every mark before it."""
    runs, plain = [], []
    for _ in range(reps + 1):  # one warm-up of each
        marks.t, marks.on = [], True
        marks("start")
        run(args)
        marks("end")
        t0 = marks.t[0][2]
        runs.append([(k, n, t - t0) for k, n, t in marks.t])
        marks.on = False
        marks.sync()
        t = time.perf_counter()
        run(args)
        marks.sync()
        plain.append(time.perf_counter() - t)
    marks.on = True
    runs, plain = runs[1:], plain[1:]
    events = [(k, n, statistics.median(r[i][2] for r in runs)) for i, (k, n, _) in enumerate(runs[0])]
    return without_mark_cost(events, statistics.median(plain))


def without_mark_cost(events: list[tuple[str, str, float]], plain_s: float) -> tuple[list, dict]:
    """`events` (from "start" at 0 to "end") with each event moved earlier by the marks' mean
    cost times the marks before it, so that "end" falls at `plain_s`, the step timed without
    marks. No correction when the marks cost nothing measurable (the plain step took as long)."""
    marked_s, inner = events[-1][2], len(events) - 2  # "start" and "end" are taken in both runs
    per_mark = max(0.0, (marked_s - plain_s) / inner) if inner > 0 else 0.0
    moved, last = [], 0.0
    for i, (k, n, t) in enumerate(events):
        last = max(last, t - min(i, inner) * per_mark)  # never before the event that precedes it
        moved.append((k, n, last))
    return moved, {"marked_ms": 1e3 * marked_s, "plain_ms": 1e3 * plain_s, "mark_cost_us": 1e6 * per_mark, "marks": inner}


# ---- the report -------------------------------------------------------------------------
def per_bucket(m: Measured, ns: list[int], busbw, latency_s) -> list[dict]:
    """One entry per bucket: each of its collectives' issue and wait times and positions in the
    schedule, the compute between them, its bytes and its modelled time at each N."""
    program, events = m.program, m.events
    info = collectives_of(program)
    issued = {n: t for k, n, t in events if k == "issue"}
    waited = {n: t for k, n, t in events if k == "wait"}
    out = []
    for bucket in program.layout.buckets:
        cs = [c for c in info.values() if c.bucket == bucket.name]
        out.append({
            "bucket": bucket.name,
            "bytes": bucket.nbytes,
            "collectives": [{
                "op": c.op, "node": c.name, "bytes": c.nbytes,
                "issue_ms": 1e3 * issued[c.name], "wait_ms": 1e3 * waited[c.name],
                "compute_between_ms": 1e3 * (waited[c.name] - issued[c.name]),
                "issue_position": m.positions.get(("issue", c.name)), "wait_position": m.positions.get(("wait", c.name)),
                "modelled_ms": {str(n): 1e3 * collective_seconds(c.op, c.nbytes, n, busbw, latency_s) for n in ns},
            } for c in sorted(cs, key=lambda c: issued[c.name])],
        })
    return out


def scale_update(events, ops: dict[str, str], traced: int, n: int) -> list:
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
    program: object  # gf.Program
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


def measured_from_report(saved: dict) -> dict[str, Measured]:
    """The measured modes of a report written with --json, for predictions under another model
    (--replay): the schedule as measured, the collectives and buckets as the report lists them."""
    out = {}
    for mode, r in saved["modes"].items():
        buckets = SimpleNamespace(buckets=[SimpleNamespace(name=b["bucket"], nbytes=b["bytes"]) for b in r["buckets"]])
        collectives = {c["node"]: Collective(c["node"], c["op"], b["bucket"], c["bytes"]) for b in r["buckets"] for c in b["collectives"]}
        program = SavedProgram(saved["traced_world"], buckets, collectives)
        positions = {(k, c["node"]): c[f"{k}_position"] for b in r["buckets"] for c in b["collectives"] for k in ("issue", "wait")}
        events = [(e["kind"], e["node"], e["ms"] / 1e3) for e in r["schedule"]]
        out[mode] = Measured(program, events, positions, r["schedule_length"], r.get("timing_marks"))
    return out


def graphfuse_collectives(m: Measured, n: int, busbw, latency_s) -> list[dict]:
    info, events = collectives_of(m.program), m.at(n)
    waits = {name: t for k, name, t in events if k == "wait"}
    return [{"issue": t, "wait": waits[name], "seconds": collective_seconds(info[name].op, info[name].nbytes, n, busbw, latency_s)}
            for k, name, t in events if k == "issue"]


def peer_collectives(plain: Measured, deferred: Measured | None, n: int, busbw, latency_s) -> dict[str, list[dict]]:
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
    buckets = plain.program.layout.buckets  # gradient order
    ready = {info[name].bucket: t for k, name, t in events if k == "issue" and info[name].op == "reduce_scatter"}
    end_backward, total = max(ready.values()), events[-1][2]
    start_backward = next((t for k, _, t in events if k == "backward"), 0.0)
    fwd_use = {b.name: 0.0 for b in buckets}
    if deferred is not None:
        dinfo = collectives_of(deferred.program)
        fwd_use.update({dinfo[name].bucket: t for k, name, t in deferred.at(n) if k == "wait" and dinfo[name].op == "all_gather"})

    def t(op: str, nbytes: int) -> float:
        return collective_seconds(op, nbytes, n, busbw, latency_s)

    ddp = [{"issue": ready[b.name], "wait": end_backward, "seconds": t("all_reduce", b.nbytes)} for b in buckets]
    ddp.append({"issue": total, "wait": total, "seconds": t("all_gather", sum(b.nbytes for b in buckets))})
    fsdp = []
    forward = sorted(buckets, key=lambda b: fwd_use[b.name])
    for i, b in enumerate(forward):
        fsdp.append({"issue": fwd_use[forward[i - 1].name] if i else 0.0, "wait": fwd_use[b.name], "seconds": t("all_gather", b.nbytes)})
    starts = [start_backward] + [ready[b.name] for b in buckets]  # bucket i's backward starts at starts[i]
    for i, b in enumerate(buckets):
        fsdp.append({"issue": starts[max(i - 1, 0)], "wait": starts[i], "seconds": t("all_gather", b.nbytes)})
        fsdp.append({"issue": ready[b.name], "wait": end_backward, "seconds": t("reduce_scatter", b.nbytes)})
    return {"ddp_zero": (total, ddp), "fsdp2": (total, fsdp)}


def predictions(plain: Measured, deferred: Measured | None, ns: list[int], busbw, latency_s) -> dict:
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
            out.setdefault(name, {})[str(n)] = {"compute_ms": 1e3 * compute, "comm_ms": 1e3 * comm, "exposed_ms": 1e3 * exposed, "step_ms": 1e3 * step}
    return out


# ---- building and running ----------------------------------------------------------------
def fake_group(world: int) -> str:
    """The name of a fake process group of `world` ranks (this process is rank 0)."""
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return dist.group.WORLD.group_name


def trace_gpt(args, group: str) -> dict[str, object]:
    """A GPT's step captured once and rewritten with and without the deferred all-gather."""
    import copy

    from graphfuse.passes import run_pipeline

    import graphfuse as gf
    from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

    cfg = GPTConfig(**{**PRESETS[args.preset], **{k: v for k, v in vars(args).items() if k in GPTConfig.__dataclass_fields__ and v is not None}})
    torch.manual_seed(0)
    model = GPT(cfg).to(args.device, torch.bfloat16 if args.master else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    batch = tuple(x.to(args.device) for x in synthetic_tokens(cfg, args.batch, 1, seed=0)[0])
    programs = {}
    for mode, deferred in (("end_of_step_gather", False), ("deferred_gather", True)):
        strategy = gf.Strategy(bucket_size_mb=args.bucket_mb, master_dtype=torch.float32 if args.master else None,
                               max_inflight_collectives=None, stage_collectives_on_host=False, overlap_param_gather=deferred)
        program = gf.capture(model, opt, gpt_loss, batch, strategy).with_(world_size=args.world, rank=0, group_name=group)
        programs[mode] = run_pipeline(program.with_(graph_module=torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph))))
    return programs


def inputs_for(program, device: str) -> list[torch.Tensor]:
    """Inputs of the program's shapes and dtypes: small random weights, zero optimizer states and
    token ids, and the host scalars of AdamW's first step at lr 1e-3."""
    from graphfuse.ir import signature as sig

    scalars = {f"group{g}.{k}": v for g, spec in enumerate(program.optim.groups) for k, v in spec.host_scalars(1e-3, 0.1, 1).items()}
    out = []
    for spec in program.signature.inputs:
        m = program.inputs_meta[spec.name]
        dtype = getattr(torch, m.dtype)
        if spec.role == sig.SCALAR:
            out.append(torch.tensor(float(scalars[spec.name]), dtype=dtype))
        elif dtype.is_floating_point and spec.role != sig.SHARD:
            out.append((torch.randn(m.shape, device=device) * 0.02).to(dtype))
        else:
            out.append(torch.zeros(m.shape, dtype=dtype, device=device))
    return out


def measure(program, args) -> tuple[Measured, str]:
    marks = Marks(torch.device(args.device))
    inputs = inputs_for(program, args.device)
    if args.executor == "inductor":
        run, code = inductor_runner(program, inputs, marks)
    else:
        run, code = eager_runner(program, marks), program.graph_module.code
    events, cost = timeline(run, inputs, marks, args.reps)
    return Measured(program, events, dict(marks.positions), marks.length, cost), code


def report(measured: dict[str, Measured], ns: list[int], busbw: dict, latency_s: float) -> dict:
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


def print_report(out: dict) -> None:
    for mode, r in out["modes"].items():
        print(f"\n{mode}: compute {r['compute_ms']:.2f} ms per step (no communication)")
        print(f"  {'bucket':8} {'op':15} {'MB':>8} {'issue ms':>9} {'wait ms':>9} {'between':>9} {'issue@':>7} {'wait@':>7}  modelled ms at N=" + ",".join(out["ns"]))
        for b in r["buckets"]:
            for c in b["collectives"]:
                model = " ".join(f"{c['modelled_ms'][n]:.2f}" for n in out["ns"])
                where = f"{c['issue_position']:>7} {c['wait_position']:>7}"
                print(f"  {b['bucket']:8} {c['op']:15} {c['bytes'] / 2**20:8.1f} {c['issue_ms']:9.2f} {c['wait_ms']:9.2f} {c['compute_between_ms']:9.2f} {where}  {model}")
        print(f"  (issue@/wait@: {'kernels' if out['executor'] == 'inductor' else 'FX ops'} before it, of {r['schedule_length']})")
        if r.get("timing_marks"):
            m = r["timing_marks"]
            print(f"  (timing marks: {m['marks']} marks took {m['mark_cost_us']:.0f} us each, taken off the times above; "
                  f"the step ran {m['marked_ms']:.2f} ms with them, {m['plain_ms']:.2f} ms without)")
    print(f"\npredicted step ms / exposed communication ms (busbw GB/s {out['busbw_GBps']}, latency {out['latency_us']} us)")
    print(f"  {'schedule':20} " + " ".join(f"{'N=' + n:>16}" for n in out["ns"]))
    for name, by_n in out["predicted"].items():
        print(f"  {name:20} " + " ".join(f"{by_n[n]['step_ms']:8.2f}/{by_n[n]['exposed_ms']:7.2f}" for n in out["ns"]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", help="a saved program (gf.save_program) instead of tracing a GPT")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for flag in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size"):
        ap.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--master", action="store_true", help="bf16 parameters with fp32 master shards")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--executor", choices=["eager", "inductor"], default="eager")
    ap.add_argument("--world", type=int, default=8, help="world size the step is traced and timed at")
    ap.add_argument("--ns", default="2,4,8", help="world sizes to model")
    ap.add_argument("--busbw", default="", help="e.g. all_gather=360,reduce_scatter=360,all_reduce=470 (GB/s)")
    ap.add_argument("--latency-us", type=float, default=LATENCY_US)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--replay", help="a report written with --json: predict again from its measured schedules "
                    "(other --busbw, --latency-us or --ns, or a changed model) without tracing or running anything")
    ap.add_argument("--code-dir", help="write the code the schedule was read from here, one file per mode")
    args = ap.parse_args(argv)
    busbw = {**BUSBW_GBPS, **{k: float(v) for k, v in (kv.split("=") for kv in args.busbw.split(",") if kv)}}
    ns = [int(n) for n in args.ns.split(",")]
    if args.replay:
        with open(args.replay) as f:
            saved = json.load(f)
        return finish({k: saved[k] for k in ("device", "executor", "traced_world")}, measured_from_report(saved), args, ns, busbw)
    torch.set_flush_denormal(True)  # random weights must not run into slow denormal arithmetic
    if args.program:
        import graphfuse as gf
        from graphfuse.runtime.execute import rebind_group

        program = gf.load_program(args.program)
        program = rebind_group(program, fake_group(program.world_size))
        programs = {"deferred_gather" if program.strategy.overlap_param_gather is True else "end_of_step_gather": program}
    else:
        programs = trace_gpt(args, fake_group(args.world))
    measured = {}
    for mode, program in programs.items():
        measured[mode], code = measure(program, args)
        if args.code_dir:  # the schedule as read: inductor's wrapper code with the marks, or the FX code
            os.makedirs(args.code_dir, exist_ok=True)
            with open(os.path.join(args.code_dir, f"{mode}.py"), "w") as f:
                f.write(code)
    header = {"device": args.device, "executor": args.executor, "traced_world": next(iter(programs.values())).world_size}
    return finish(header, measured, args, ns, busbw)


def finish(header: dict, measured: dict[str, Measured], args, ns: list[int], busbw: dict) -> dict:
    """The report of `measured` under the model's settings: printed, written to --json, returned."""
    out = {**header, "config": vars(args), "ns": [str(n) for n in ns], "busbw_GBps": busbw, "latency_us": args.latency_us,
           **report(measured, ns, busbw, args.latency_us * 1e-6)}
    print_report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
