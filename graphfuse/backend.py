"""The torch.compile backend "graphfuse" (forward and backward compiled by inductor through
AOTAutograd), and the names of the torch.compile path: `shard_optimizer` / `ShardedOptimizer`."""

from __future__ import annotations

import torch

from graphfuse.inductor import compile_graph
from graphfuse.sharded_optimizer import ShardedOptimizer, shard_optimizer
from graphfuse.update_program import capture_update

__all__ = ["ShardedOptimizer", "capture_update", "graphfuse_backend", "shard_optimizer"]


def graphfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """torch.compile backend "graphfuse": forward and backward compiled by inductor. Pair it
    with `gf.shard_optimizer(optimizer, model=model)` for the fused, sharded optimizer step."""
    return compile_graph(gm, example_inputs)
