"""Checkpoints of a DistModel, in one package: the plan (`plan`), graphfuse.json (`record`), DCP
storage (`storage`), the atomic directory (`directory`), rank agreement (`agree`), the state as
views (`state`), in-memory loads (`memory`), frozen parameters' state (`carried`), `saving`,
`loading`, offline conversion (`convert`) and numbered checkpoints of a job (`manager`)."""

from __future__ import annotations

from graphfuse.checkpoint.loading import load
from graphfuse.checkpoint.manager import Checkpointer
from graphfuse.checkpoint.memory import load_state_dict
from graphfuse.checkpoint.record import MODES
from graphfuse.checkpoint.saving import SaveHandle, save
from graphfuse.checkpoint.state import state_dict
from graphfuse.ranks import DEFAULT_TIMEOUT

__all__ = ["DEFAULT_TIMEOUT", "MODES", "Checkpointer", "SaveHandle", "load", "load_state_dict", "save", "state_dict"]
