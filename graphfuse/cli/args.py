"""The options of `graphfuse trace` and `graphfuse demo`, checked when parsed (so a bad value is
one line and exit 2, never a traceback from deep inside), and the CLI's two error kinds."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from rich.console import Console

from graphfuse.program_files.files import MANIFEST


class UsageError(Exception):
    """The command line names something that does not exist or cannot be used: exit 2."""


class CliFailure(Exception):
    """The command ran and failed (a check differs, the user's code raised): exit 1."""


def existing(path: str, what: str = "path") -> Path:
    """`path` as a Path; a UsageError naming it if nothing is there."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{path}: no such {what}")
    return p


def _int_at_least(lo: int, why: str = ""):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}{why}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


DEMO_HEADS = 4  # attention heads of the demo's GPT: --d-model must be a multiple of this


def _d_model(text: str) -> int:
    value = _int_at_least(DEMO_HEADS)(text)
    if value % DEMO_HEADS:
        raise argparse.ArgumentTypeError(
            f"must be a multiple of {DEMO_HEADS} (the demo's attention heads), got {value}; try "
            f"{value - value % DEMO_HEADS or DEMO_HEADS}"
        )
    return value


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=_int_at_least(1), default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--layers", type=_int_at_least(1), default=2, help="transformer blocks")
    p.add_argument("--d-model", type=_d_model, default=64, help=f"embedding width, a multiple of {DEMO_HEADS}")
    p.add_argument("--bucket-mb", type=_positive_float, default=0.25, help="bucket size cap in MiB (> 0)")
    p.add_argument(
        "--steps",
        type=_int_at_least(2, " (half are replayed after a checkpoint)"),
        default=30,
        help="training steps (>= 2)",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu, or cuda (one GPU per rank, NCCL)")
    p.add_argument("--compile", default="eager", choices=("eager", "inductor"), help="how the program runs")
    p.add_argument(
        "--out",
        default=None,
        help="keep the checkpoints in this directory (default: a temporary one, removed at the end)",
    )


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "factory",
        metavar="FILE.py:FACTORY",
        help="a function in FILE.py returning (model, optimizer, loss_fn, example_batch)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="directory to write: rank<R>/ (one program per rank) and trace.json; "
        "an earlier trace there is replaced, other files are left alone",
    )
    p.add_argument("--world-size", type=_int_at_least(1), default=1, help="ranks to plan for (no process group needed)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=_int_at_least(0), default=None, help="save only this rank's program (default 0)")
    which.add_argument("--all-ranks", action="store_true", help="save every rank's program")
    p.add_argument(
        "--bucket-mb", type=_positive_float, default=None, help="Strategy.bucket_size_mb (default: the Strategy's)"
    )
    p.add_argument("--align-bytes", type=_int_at_least(1), default=None, help="Strategy.align_bytes")
    p.add_argument(
        "--no-overlap", action="store_true", help="Strategy(overlap=False): wait for each collective at once"
    )
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="resolve the Strategy's 'auto' settings for this backend (default: gloo on CPU, nccl on CUDA)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as one JSON object")


class _PipedConsole(Console):
    """rich exits with status 1 when stdout is closed; the command's main says 141 instead."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # print nothing more
        raise BrokenPipeError("stdout was closed")


def wide_console() -> Console:
    """A console that never cuts or folds a cell: as wide as a row needs, in a pipe too (a
    terminal narrower than a row wraps it, which loses nothing)."""
    return _PipedConsole(width=max(shutil.get_terminal_size().columns, 100_000), highlight=False, soft_wrap=True)


CHECKPOINT_MARKS = ("graphfuse.json", ".metadata")


def kind_of(path: Path) -> str:
    """What `path` holds, told by its contents: "trace", "program" or "checkpoint"."""
    if path.is_dir():
        if (path / TRACE_FILE).is_file():
            return "trace"
        if (path / MANIFEST).is_file():
            return "program"
        if any((path / m).is_file() for m in CHECKPOINT_MARKS):
            return "checkpoint"
    raise UsageError(
        f"{path}: not a program directory ({MANIFEST}), a `graphfuse trace` output ({TRACE_FILE}) "
        f"or a checkpoint ({' or '.join(CHECKPOINT_MARKS)})"
    )


TRACE_FILE = "trace.json"  # beside the rank<R>/ program directories: what program files do not keep
