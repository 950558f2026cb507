"""graphfuse: ZeRO stage-1 data parallelism with tensor fusion, done by FX graph passes
over one traced training step (forward, backward and optimizer update)."""

from __future__ import annotations

from graphfuse import backend
from graphfuse.backend import ShardedOptimizer, shard_optimizer
from graphfuse.capture import capture
from graphfuse.errors import (
    CheckpointError,
    CheckpointMismatchError,
    GraphfuseError,
    PassContractError,
    ProgramFormatError,
    UnsupportedError,
)
from graphfuse.layout import Bucket, BucketLayout
from graphfuse.program import Program
from graphfuse.program_files import load_program, save_program
from graphfuse.runtime import DistModel
from graphfuse.signature import Signature
from graphfuse.strategy import Strategy

__version__ = "0.1.0"

backend.register()  # backend="graphfuse" for torch.compile, also when imported from a source tree


compile = DistModel
"""`gf.compile(model, optimizer, loss_fn, example_batch, strategy=None, group=None) -> DistModel`:
trace one training step of `model` and rewrite it into fused, sharded ZeRO-1 over `group` (the
default process group if initialised, else world size 1). One signature: DistModel's own."""


def save(
    dm: DistModel | ShardedOptimizer,
    path,
    mode: str | None = None,
    extra: dict | None = None,
    timeout: float | None = None,
    async_: bool = False,
):
    """Save `dm`'s training state (a DistModel, or a ShardedOptimizer with the weights it holds)
    to directory `path` (atomic; see graphfuse.checkpoint).
    `timeout`: seconds a rank waits for the others at each stage (default 300); `async_`:
    write in the background and return a handle whose `wait()` joins it."""
    from graphfuse import checkpoint

    return checkpoint.save(dm, path, mode=mode, extra=extra, timeout=timeout, async_=async_)


def load(dm: DistModel | ShardedOptimizer, path, timeout: float | None = None):
    """Load the checkpoint at `path` into `dm` in place; returns the `extra` saved with it."""
    from graphfuse import checkpoint

    return checkpoint.load(dm, path, timeout=timeout)


__all__ = [
    "Bucket",
    "BucketLayout",
    "CheckpointError",
    "CheckpointMismatchError",
    "DistModel",
    "GraphfuseError",
    "PassContractError",
    "Program",
    "ProgramFormatError",
    "ShardedOptimizer",
    "Signature",
    "Strategy",
    "UnsupportedError",
    "capture",
    "compile",
    "load",
    "load_program",
    "save",
    "save_program",
    "shard_optimizer",
]
