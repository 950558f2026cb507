"""`graphfuse trace FILE.py:FACTORY`: capture a training step and rewrite it for a world size with
no process group (planning needs none), saving each rank's program and the passes' statistics."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

import graphfuse as gf
from graphfuse import atomic_dir
from graphfuse.capture.step import capture
from graphfuse.cli.args import TRACE_FILE, CliFailure, UsageError
from graphfuse.errors import GraphfuseError
from graphfuse.ir.program import Program
from graphfuse.passes import run_pipeline, verify
from graphfuse.program_files.files import PROGRAM_DIR

TRACE_FORMAT = 1
RANK_DIR = re.compile(r"rank\d+")  # the program directories a trace writes beside trace.json
# The name torch gives the default process group: a program planned here runs as it is under
# init_process_group, and DistModel.from_program rebinds any other group.
DEFAULT_GROUP = "0"


def load_factory(spec: str):
    """The function `FACTORY` of `FILE.py:FACTORY`, the file run as a module named after it."""
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name.isidentifier():
        raise UsageError(f"{spec!r}: expected FILE.py:FACTORY, e.g. model.py:make")
    path = Path(file)
    if not path.is_file():
        raise UsageError(f"{file}: no such file")
    sys.path.insert(0, str(path.resolve().parent))  # the factory's file may import its neighbours
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"{file}: Python cannot import it (expected a .py file)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise CliFailure(
            f"{file} raised {type(e).__name__} when imported: {e} (rerun with --debug for the traceback)"
        ) from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(f"{file} has no function {name}")
    return factory


def call_factory(spec: str):
    """(model, optimizer, loss_fn, example_batch, strategy or None) from the user's factory."""
    factory = load_factory(spec)
    try:
        made = factory()
    except Exception as e:
        raise CliFailure(f"{spec} raised {type(e).__name__}: {e} (rerun with --debug for the traceback)") from e
    if not isinstance(made, tuple | list) or len(made) not in (4, 5):
        raise UsageError(
            f"{spec} must return (model, optimizer, loss_fn, example_batch[, strategy]), got {type(made).__name__}"
        )
    model, optimizer, loss_fn, batch = made[:4]
    strategy = made[4] if len(made) == 5 else None
    for ok, what in (
        (isinstance(model, torch.nn.Module), "model: a torch.nn.Module"),
        (
            isinstance(optimizer, torch.optim.Optimizer)
            or (
                isinstance(optimizer, list | tuple)
                and optimizer
                and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
            ),
            "optimizer: a torch.optim.Optimizer or a list of them",
        ),
        (callable(loss_fn), "loss_fn: callable as loss_fn(model, batch)"),
        (strategy is None or isinstance(strategy, gf.Strategy), "strategy: a graphfuse.Strategy"),
    ):
        if not ok:
            raise UsageError(f"{spec} returned a wrong {what.split(':')[0]}; it must be {what.split(': ')[1]}")
    return model, optimizer, loss_fn, batch, strategy


def strategy_for(args, given: gf.Strategy | None, device_type: str) -> gf.Strategy:
    """The factory's Strategy (or the default) with the command line's options, 'auto' resolved."""
    changes = {}
    if args.bucket_mb is not None:
        changes["bucket_size_mb"] = args.bucket_mb
    if args.align_bytes is not None:
        changes["align_bytes"] = args.align_bytes
    if args.no_overlap:
        changes["overlap"] = False
    strategy = dataclasses.replace(given or gf.Strategy(), **changes)
    backend = args.backend or ("nccl" if device_type == "cuda" else "gloo")
    return strategy.for_backend(backend, device_type)


def phase_counts(program: Program) -> dict[str, int]:
    """Operator nodes by phase ("other" for nodes no pass marked)."""
    return dict(Counter(n.meta.get("phase", "other") for n in program.graph.nodes if n.op == "call_function"))


def plan_rank(made, strategy: gf.Strategy, world_size: int, rank: int) -> tuple[dict[str, int], Program]:
    """(the captured step's node count per phase, its rewrite for `rank` of `world_size`); each rank gets its own
    capture because the passes edit the graph in place."""
    model, optimizer, loss_fn, batch, _ = made
    captured = capture(model, optimizer, loss_fn, batch, strategy)
    before = phase_counts(captured)
    program = captured.with_(world_size=world_size, rank=rank, group_name=DEFAULT_GROUP)
    program = verify(run_pipeline(program))
    return before, program


def run_trace(args) -> int:
    if args.rank is not None and args.rank >= args.world_size:
        raise UsageError(
            f"--rank {args.rank} is not a rank of --world-size {args.world_size} (0 to {args.world_size - 1})"
        )
    out = Path(args.out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / TRACE_FILE).is_file())):
        raise UsageError(f"{out}: exists and is not an earlier trace output; choose another --out or remove it")
    earlier = earlier_programs(out)
    ranks = list(range(args.world_size)) if args.all_ranks else [args.rank or 0]
    say = (lambda *a, **k: None) if args.json else (lambda *a: print(*a, flush=True))
    say(f"graphfuse trace: running {args.factory}")
    made = call_factory(args.factory)
    device = next(made[0].parameters(), torch.empty(0)).device.type
    strategy = strategy_for(args, made[4], device)
    record = {
        "format": TRACE_FORMAT,
        "factory": args.factory,
        "world_size": args.world_size,
        "strategy": strategy.to_json(),
        "ranks": {},
    }
    for rank in ranks:
        t0 = time.perf_counter()
        say(f"capturing and rewriting rank {rank} of {args.world_size}...")
        before, program = plan_rank(made, strategy, args.world_size, rank)
        if rank == ranks[0]:  # the step traced and rewritten: only now is an earlier trace replaced
            replace_earlier(out, record, [d for d in earlier if d.name not in {f"rank{r}" for r in ranks}])
        gf.save_program(program, out / f"rank{rank}")
        record["ranks"][str(rank)] = {
            "program": f"rank{rank}",
            "captured_nodes": before,
            "passes": [dataclasses.asdict(p) for p in program.passes],
            "seconds": round(time.perf_counter() - t0, 3),
        }
        say(
            f"wrote {out / f'rank{rank}'} ({sum(1 for _ in program.graph.nodes)} nodes, "
            f"{len(program.bucket_layout.buckets)} buckets)"
        )
    write_record(out, record)
    if args.json:
        print(json.dumps({"out": str(out), "ranks": ranks, "programs": [str(out / f"rank{r}") for r in ranks]}))
    else:
        say(f"next: graphfuse inspect {out}   or   graphfuse report {out} --out report.html")
    return 0


def earlier_programs(out: Path) -> list[Path]:
    """The rank<R>/ directories of an earlier trace in `out`, checked before any work: one that
    holds files graphfuse did not write (or is a link or a file) is refused, never removed."""
    if not out.is_dir():
        return []
    found = sorted(d for d in out.iterdir() if RANK_DIR.fullmatch(d.name) and (d.is_dir() or d.is_symlink()))
    for d in found:
        try:
            PROGRAM_DIR.check_replaceable(d)
        except GraphfuseError as e:
            raise UsageError(
                f"{e} (a new trace into {out} replaces its rank<R>/ programs; nothing was written)"
            ) from None
    return found


def replace_earlier(out: Path, record: dict, stale: list[Path]) -> None:
    """Make `out` a trace output of no rank yet, then remove the earlier trace's programs of
    ranks this trace does not write (gf.load_program would load them as if current). Those it
    writes are replaced one by one, atomically; nothing else in `out` is touched. Killed part
    way, `out` is still a trace output (its trace.json lists no rank) that the next trace replaces."""
    out.mkdir(parents=True, exist_ok=True)
    write_record(out, record)
    for d in stale:
        PROGRAM_DIR.remove(d)  # checked again: only a program directory's own files go
    atomic_dir.fsync(out)


def write_record(out: Path, record: dict) -> None:
    """trace.json, replaced in one rename: a reader sees the earlier record or this one."""
    staging = out / f".{TRACE_FILE}.tmp-{os.getpid()}"
    atomic_dir.write_file(staging, (json.dumps(record, indent=1) + "\n").encode())
    os.replace(staging, out / TRACE_FILE)


def read_trace(directory: Path) -> dict | None:
    """The trace record of a `graphfuse trace` output, or None if `directory` is not one."""
    f = directory / TRACE_FILE
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{f}: unreadable ({e}); trace the model again") from None
    if (
        not isinstance(record, dict)
        or record.get("format") != TRACE_FORMAT
        or not isinstance(record.get("ranks"), dict)
    ):
        raise UsageError(f"{f}: not a trace record of this graphfuse; trace the model again")
    return record
