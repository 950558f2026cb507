"""Measuring a program's schedule: timing marks before each collective's issue and after its wait,
taken as the step runs under an fx.Interpreter (eager) or in inductor's instrumented wrapper code."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

from graphfuse.analysis.overlap import Measured, collectives_of, phases
from graphfuse.compiler.in_place import compile_in_place
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program
from graphfuse.passes import issues_collective
from graphfuse.runtime.execute import rebind_group


class Marks:
    """Clock marks (after a device synchronise) taken as the step runs: (kind, node name, seconds)."""

    t: list[tuple[str, str, float]]
    positions: dict[tuple[str, str], int]  # (kind, node name) -> kernels or FX ops before it

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


def eager_runner(program: Program, marks: Marks) -> Callable[[list], object]:
    """A step runner that takes `marks` as an fx.Interpreter runs the FX graph in its order."""
    # No graph library: fx's node order is already a topological order, and it is the schedule.
    phase = phases(program)
    wait = torch.ops._c10d_functional.wait_tensor.default
    marks.length = sum(
        1 for n in program.graph.nodes if n.op == "call_function" and not issues_collective(n) and n.target is not wait
    )

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


ISSUE = re.compile(
    r"^(\s+)(buf\w+) = "
    r"torch\.ops\._c10d_functional\.(reduce_scatter_tensor|all_gather_into_tensor|all_reduce)\.default\("
)
WAIT = re.compile(r"^(\s+)torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\w+)\)")
# A kernel launch in the wrapper: C++ (CPU), Triton (CUDA), an extern kernel (mm) or an aten fallback.
KERNEL = re.compile(
    r"^\s+(?:\w+ = )?(?:extern_kernels\.\w+|cpp_fused_\w+|triton_\w+\.run|torch\.ops\.aten\.\w+\.\w+)\("
)
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


def inductor_runner(program: Program, args: list, marks: Marks) -> tuple[Callable[[list], object], str]:
    """Compile as graphfuse.frontends.dist_model does (in place), then run the instrumented wrapper code."""
    # here: loading inductor takes seconds, the eager executor needs none of it
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    with inductor_config.patch(fx_graph_cache=False):  # a cache hit would generate no code to read
        _, codes = run_and_get_code(lambda: compile_in_place(program, args))
    source = instrument(codes[-1], set(collectives_of(program)), phases(program))
    ns = {"__name__": "graphfuse_overlap_report", "_gf_mark": marks}
    exec(compile(source, "<graphfuse overlap_report>", "exec"), ns)
    # what the instrumented wrapper code defines: its kernel count and its entry point
    marks.length = cast(int, ns["_GF_KERNELS"])
    call = cast(Callable[[list], object], ns["call"])
    return (lambda a: call(list(a))), source


def timeline(
    run: Callable[[list], object], args: list, marks: Marks, reps: int
) -> tuple[list[tuple[str, str, float]], dict]:
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
    return moved, {
        "marked_ms": 1e3 * marked_s,
        "plain_ms": 1e3 * plain_s,
        "mark_cost_us": 1e6 * per_mark,
        "marks": inner,
    }


def fake_group(world: int) -> str:
    """The name of a fake process group of `world` ranks (this process is rank 0)."""
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    world_group = dist.group.WORLD
    assert world_group is not None  # the default group is initialised (above, or by the caller)
    return world_group.group_name


def on_fake_group(program: Program) -> Program:
    """A saved program with its collectives on a fake group of its world size, to be timed alone."""
    return rebind_group(program, fake_group(program.world_size))


def inputs_for(program: Program, device: str) -> list[torch.Tensor]:
    """Inputs of the program's shapes and dtypes: small random weights, zero optimizer states and
    token ids, and the host scalars of AdamW's first step at lr 1e-3."""
    scalars = {
        f"group{g}.{k}": v
        for g, spec in enumerate(program.optim.groups)
        for k, v in spec.host_scalars(1e-3, 0.1, 1).items()
    }
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


def measure(program: Program, device: str, executor: str, reps: int) -> tuple[Measured, str]:
    """The program's schedule timed on `device` (`executor` "eager" or "inductor", median of
    `reps` runs), and the code it was read from (inductor's wrapper code with the marks, or FX's)."""
    marks = Marks(torch.device(device))
    inputs = inputs_for(program, device)
    if executor == "inductor":
        run, code = inductor_runner(program, inputs, marks)
    else:
        run, code = eager_runner(program, marks), program.graph_module.code
    events, cost = timeline(run, inputs, marks, reps)
    return Measured(program, events, dict(marks.positions), marks.length, cost), code
