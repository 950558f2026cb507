"""graphfuse: ZeRO stage-1 data parallelism with tensor fusion, done by FX graph passes
over one traced training step (forward, backward and optimizer update)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from graphfuse import checkpoint
from graphfuse._version import __version__
from graphfuse.capture.step import capture
from graphfuse.checkpoint import Checkpointer
from graphfuse.errors import (
    CheckpointError,
    CheckpointMismatchError,
    GraphfuseError,
    PassContractError,
    ProgramFormatError,
    UnsupportedError,
    VerifyError,
)
from graphfuse.frontends import registration
from graphfuse.frontends.dist_model import DistModel
from graphfuse.frontends.sharded_optimizer import ShardedOptimizer, shard_optimizer
from graphfuse.ir.layout import Bucket, BucketLayout
from graphfuse.ir.program import Program
from graphfuse.ir.signature import Signature
from graphfuse.logs import install as _install_logging
from graphfuse.program_files import load_program, save_program
from graphfuse.runtime.metrics import StepMetrics
from graphfuse.strategy import Strategy

registration.register()  # backend="graphfuse" for torch.compile, also when imported from a source tree
_install_logging()  # INFO lines on rank 0 only; GRAPHFUSE_LOG (see graphfuse.logs)


def compile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    loss_fn: Callable,
    example_batch,
    strategy: Strategy | None = None,
    group: dist.ProcessGroup | None = None,
) -> DistModel:
    """Trace one training step of `model` (forward, backward and `optimizer`'s update) and
    rewrite it into fused, sharded ZeRO-1 over `group`.

    Args:
        model: the module to train; its parameters become views into the buckets.
        optimizer: a torch.optim optimizer over the model's parameters (docs/models.md lists
            those supported), fresh; after this call its state_dict() and load_state_dict()
            speak for the shards and its step() raises (docs/habits.md). A list of optimizers over
            disjoint parameters (torch.optim.Muon for the hidden matrices, AdamW for the rest)
            steps as one, each param group with its own optimizer's math.
        loss_fn: `loss_fn(model, batch) -> scalar tensor`.
        example_batch: a pytree of tensors shaped as the batches to come.
        strategy: the configuration (gf.Strategy()); None: the defaults.
        group: the process group to shard over; None: the default group if initialised,
            else world size 1.

    Returns:
        A DistModel: `dm(batch)` runs one step and returns the loss.

    Raises:
        UnsupportedError: the model, optimizer or strategy cannot be compiled (before any
            state changes), naming the offending part and the way out.
    """
    return DistModel(model, optimizer, loss_fn, example_batch, strategy, group)


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
    return checkpoint.save(dm, path, mode=mode, extra=extra, timeout=timeout, async_=async_)


def load(dm: DistModel | ShardedOptimizer, path, timeout: float | None = None):
    """Load the checkpoint at `path` into `dm` in place; returns the `extra` saved with it."""
    return checkpoint.load(dm, path, timeout=timeout)


__all__ = [
    "Bucket",
    "BucketLayout",
    "CheckpointError",
    "CheckpointMismatchError",
    "Checkpointer",
    "DistModel",
    "GraphfuseError",
    "PassContractError",
    "Program",
    "ProgramFormatError",
    "ShardedOptimizer",
    "Signature",
    "StepMetrics",
    "Strategy",
    "UnsupportedError",
    "VerifyError",
    "__version__",
    "capture",
    "compile",
    "load",
    "load_program",
    "save",
    "save_program",
    "shard_optimizer",
]
