"""Inductor for graphfuse programs: `compile_fx` with the settings that keep its kernels
correct on the graphs graphfuse builds (see docs/design.md "Numerics" for each one)."""

from __future__ import annotations

import contextlib
import copyreg
from collections.abc import Callable, Iterator

import torch

from graphfuse.errors import ProgramFormatError, UnsupportedError

# Inductor settings graphfuse overrides, and why. Each entry is a measured miscompile, not a
# preference; remove it once the oldest supported torch no longer needs it.
WORKAROUNDS: dict[str, object] = {
    # torch 2.11-2.13, CUDA: a "mix-order reduction" (LayerNorm backward's row sums fused with
    # its column sums, chosen when rows x columns >= 5 Mi elements) ends with
    # `buf = workspace[...].sum(dim=0)`, which rebinds the buffer's name instead of writing
    # into it. When that buffer is a slice of a larger one (a gradient written straight into
    # the packed gradient bucket by `cat`), the slice is never written: the update reads
    # uninitialised memory (wrong LayerNorm updates; NaN under deterministic fill).
    # Reproduced without graphfuse by tools/repro_inductor_mix_order.py.
    "triton.mix_order_reduction": False,
}


# Inductor settings that shorten the compile of a whole-step program and leave its generated
# code as it was (checked: the same output code with and without, for GPT-2 small on one H200
# and for a 12-layer GPT on the CPU; docs/data/benchmarks-history.md, "Fusion search"). Not used
# for the torch.compile backend's graphs, where that was not checked.
COMPILE_SPEED: dict[str, object] = {
    # Inductor looks for fusions among the nodes that read one buffer, up to this many pairs per
    # node (default 64). Every parameter read is a view of its bucket, so one buffer has hundreds
    # of readers: with 64, its scheduler ran 6x torch.compile's fusion checks (14,744 against
    # 2,460 on the CPU) and spent 4.3 s in Scheduler.__init__ on the GPU; with 8, 3.4 s.
    "max_fusion_buffer_group_pairwise_attempts": 8,
}


# Inductor settings that shorten the first step of a whole-step program: they change the launch
# configurations its kernels are built with, never what a kernel computes. Measured for the step
# time on one H200 (docs/benchmarks.md, "Where the first step went"; tools/bench_first_step.py).
FIRST_STEP: dict[str, object] = {
    # A pointwise kernel gets 2 launch configurations (a tiled one 6), each one built by Triton
    # and timed at the kernel's first launch. A parameter's offset in its bucket is a constant
    # in every kernel that reads it, so the kernels of identical layers differ and graphfuse's
    # step has many times torch.compile's distinct kernels: GPT-2 small in bf16 autocast timed
    # 123 kernels (248 configurations) at its first step, 2.9 s, where torch.compile timed 19
    # (0.5 s). With one configuration each the step took 18.08 ms against 18.12 ms tuned.
    # Inductor's `max_autotune` and `max_autotune_pointwise` still tune them.
    "triton.autotune_pointwise": False,
}


# torch's compile phases (`dynamo_timed`) that do not contain one another: where the time of a
# compile goes, as graphfuse's log and tools/bench_startup.py give it.
PHASES = (
    "bytecode_tracing",
    "aot_collect_metadata",
    "aot_trace_joint_graph",
    "_recursive_joint_graph_passes",
    "min_cut_rematerialization_partition",
    "_recursive_post_grad_passes",
    "GraphLowering.run",
    "Scheduler.__init__",
    "Scheduler.codegen",
    "async_compile.wait",
    "AOTAutogradCache.inductor_load",
)


def use_inductor_defaults(*tables: str) -> None:
    """Drop graphfuse's tables of inductor settings named ("COMPILE_SPEED", "FIRST_STEP") in this
    process, so that inductor's own defaults apply: how tools/check_compile_speed.py and
    tools/bench_first_step.py measure what each table is worth. WORKAROUNDS cannot be dropped."""
    for name in tables:
        if name not in ("COMPILE_SPEED", "FIRST_STEP"):
            raise UnsupportedError(
                f"use_inductor_defaults({name!r}): no such table of settings; "
                "pass 'COMPILE_SPEED' or 'FIRST_STEP' (WORKAROUNDS fix miscompiles and stay)"
            )
        globals()[name] = {}  # compile_graph and compile_settings read the module's name at each call


def phase_seconds() -> dict[str, float]:
    """Seconds this process has spent in each of torch's compile phases (`dynamo_timed`: tracing,
    lowering, scheduling, code generation, waiting for kernel builds), summed over every graph
    it compiled; empty where this torch does not keep them."""
    try:
        # on first use: torch._dynamo comes with inductor, which `import graphfuse` never needs
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: sum(values) for name, values in compilation_time_metrics.items()}


def phases_since(before: dict[str, float]) -> dict[str, float]:
    """The seconds in each of PHASES since `before` (a `phase_seconds()`), the phases that took
    at least 10 ms: where one compile's time went."""
    now = phase_seconds()
    spent = {name: now.get(name, 0.0) - before.get(name, 0.0) for name in PHASES}
    return {name: round(s, 2) for name, s in spent.items() if s >= 0.01}


def phases_text(spent: dict[str, float]) -> str:
    """`phases_since`'s seconds for the log: "GraphLowering.run 1.20, Scheduler.codegen 2.31"."""
    return ", ".join(f"{name} {s:.2f}" for name, s in spent.items()) or "no torch phase timed"


def active_workarounds() -> dict[str, object]:
    """The entries of WORKAROUNDS that this torch's inductor config knows."""
    return _known(WORKAROUNDS)


def _known(settings: dict[str, object]) -> dict[str, object]:
    """The entries of `settings` that this torch's inductor config knows."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    import torch._inductor.config as config

    active = {}
    for key, value in settings.items():
        owner: object = config  # a config module, then its sub-config objects (None where absent)
        *path, leaf = key.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, leaf):
            active[key] = value
    return active


def warm_workers() -> None:
    """Start inductor's pool of kernel-compile workers now, in the background, as
    torch.compile's inductor backend does when dynamo first calls it. graphfuse calls
    compile_fx directly, so without this the pool was cold at the first step and Triton kernels
    were compiled (or loaded from the cache) one by one in this process. No-op where the pool
    is not used (no Triton, compile_threads=1, TORCH_WARM_POOL=0)."""
    try:
        # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without it: the pool starts at the first compile, as before
        return
    maybe_warm_pool()  # also wakes the workers; it decides when not to (no Triton, TORCH_WARM_POOL=0)


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
    """`compile_fx(gm, example_inputs)` under graphfuse's inductor WORKAROUNDS (and, for a
    program graphfuse built, its COMPILE_SPEED and FIRST_STEP settings), in a tracing
    context whose fake mode has a ShapeEnv: without one inductor bypasses its FX graph cache
    ("No shape env"), so every start, also from a program file, compiled from scratch."""
    # on first use: torch._inductor takes over a second to import, and `import graphfuse` never needs it
    import torch._inductor.config as config
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if TracingContext.try_get() is not None:  # called by dynamo (the "graphfuse" backend): it has one
        with config.patch(active_workarounds()), same_keys_in_every_process():
            return _runnable(compile_fx(gm, example_inputs))
    settings = {**_known(COMPILE_SPEED), **_known(FIRST_STEP), **active_workarounds()}
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    # Fake inputs made here with static shapes, as dynamo hands a backend its inputs; real ones
    # would be fakified by AOTAutograd with symbolic shapes under the ShapeEnv.
    fakes = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with config.patch(settings), tracing(TracingContext(fake_mode)), same_keys_in_every_process():
        return _runnable(compile_fx(gm, fakes))


def _runnable(compiled: object) -> Callable:
    """compile_fx's result, which is a callable unless inductor is set to export (AOTInductor
    returns file names): graphfuse needs the callable."""
    if not callable(compiled):
        raise UnsupportedError(
            f"inductor returned {type(compiled).__name__} instead of a compiled function: graphfuse needs "
            "torch._inductor.config.aot_inductor settings off (unset the AOTInductor mode before gf.compile)"
        )
    return compiled


@contextlib.contextmanager
def same_keys_in_every_process() -> Iterator[None]:
    """Inductor's cache keys pickle each input's metadata, and a memory format
    (`torch.contiguous_format`) pickles by the name "torch.contiguous_format", which pickle
    resolves by searching sys.modules for the first module whose `torch` attribute has it:
    `__mp_main__` in a rank started by multiprocessing's spawn whose script imports torch,
    `torch._utils` in another process. So the same graph got different keys in a rank and in
    a compile worker (and could in a restart): each missed the other's cache entries. While
    this is active, a memory format pickles as `memory_format(name)` in every process."""
    previous = copyreg.dispatch_table.get(torch.memory_format)
    copyreg.dispatch_table[torch.memory_format] = _memory_format_by_name
    try:
        yield
    finally:
        if previous is None:
            del copyreg.dispatch_table[torch.memory_format]
        else:
            copyreg.dispatch_table[torch.memory_format] = previous


def _memory_format_by_name(m: torch.memory_format) -> tuple:
    return memory_format, (str(m).removeprefix("torch."),)


def memory_format(name: str) -> torch.memory_format:
    """torch's memory format of that name ("contiguous_format"): what a memory format pickled
    under `same_keys_in_every_process` loads as."""
    found = getattr(torch, name, None)
    if not isinstance(found, torch.memory_format):
        raise ProgramFormatError(
            f"torch has no memory format named {name!r} (a compile job pickled by another torch?); "
            "run the compile workers with the same torch as the main process"
        )
    return found
