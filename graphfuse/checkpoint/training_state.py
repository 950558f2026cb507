"""`TrainingState`: what graphfuse.checkpoint reads (and, for `steps` and `carried`, writes) of
the object it saves or loads, declared here on the consumer's side so that checkpoint/ never
imports the runtime or the frontends that implement it (DistModel, ShardedOptimizer)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from graphfuse.errors import UnsupportedError
from graphfuse.ir.layout import BucketLayout
from graphfuse.ir.program import Program
from graphfuse.optim.several import Optimizers
from graphfuse.strategy import Strategy


@runtime_checkable
class TrainingState(Protocol):
    """A Program bound to its tensors on one rank of a process group, with the model whose
    parameters are views into the buckets and the optimizer whose param groups hold the
    hyper-parameters. Read-only members are properties, so that an implementation may serve
    them from elsewhere (runtime/bound.py's BoundFront does); a load assigns `steps` and `carried`."""

    steps: list[int]  # steps taken, per param group
    carried: list[dict[str, float]]  # what each group's last step left for the next (ASGD's eta)

    @property
    def program(self) -> Program: ...
    @property
    def layout(self) -> BucketLayout: ...
    @property
    def tensors(self) -> dict[str, torch.Tensor]: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer | Optimizers: ...  # several: graphfuse.optim.Optimizers
    @property
    def strategy(self) -> Strategy: ...
    @property
    def group(self) -> dist.ProcessGroup | None: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def group_name(self) -> str: ...


def expect_training_state(obj: object, how: str) -> TrainingState:
    """`obj`, refused unless it has every member of TrainingState."""
    if not isinstance(obj, TrainingState):
        raise UnsupportedError(
            f"{how}: expected a gf.DistModel or gf.ShardedOptimizer (graphfuse.checkpoint.TrainingState), "
            f"got {type(obj).__name__!r}; pass the object gf.compile or gf.shard_optimizer returned"
        )
    return obj
