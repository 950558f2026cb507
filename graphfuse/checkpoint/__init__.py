"""Checkpoints of a DistModel or ShardedOptimizer (what they read of it: `TrainingState`), in one
package: the plan (`plan`), graphfuse.json (`record`), DCP storage (`storage`), the atomic directory
(`directory`), rank agreement (`agree`), the state as views (`state`), in-memory loads (`memory`),
frozen parameters' state (`carried`), `saving`, `loading`, `convert`, numbered checkpoints (`manager`)."""

from __future__ import annotations

from graphfuse.checkpoint.loading import load
from graphfuse.checkpoint.manager import Checkpointer, rng_state, set_rng_state
from graphfuse.checkpoint.memory import load_state_dict
from graphfuse.checkpoint.record import MODES
from graphfuse.checkpoint.saving import SaveHandle, save
from graphfuse.checkpoint.state import state_dict
from graphfuse.checkpoint.training_state import TrainingState
from graphfuse.ranks import DEFAULT_TIMEOUT

__all__ = [
    "DEFAULT_TIMEOUT",
    "MODES",
    "Checkpointer",
    "SaveHandle",
    "TrainingState",
    "load",
    "load_state_dict",
    "rng_state",
    "save",
    "set_rng_state",
    "state_dict",
]
