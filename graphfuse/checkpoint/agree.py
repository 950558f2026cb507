"""The exchange among a DistModel's or ShardedOptimizer's ranks around a save or load (the
agreement itself, `Exchange`, is graphfuse/ranks.py: gf.compile's start uses it too)."""

from __future__ import annotations

from graphfuse.checkpoint.training_state import TrainingState
from graphfuse.ranks import Exchange


def exchange(dm: TrainingState, timeout: float | None) -> Exchange:
    """The exchange among `dm`'s ranks."""
    return Exchange(dm.group, dm.rank, dm.world_size, dm.group_name, timeout)
