"""`optimizer.state` of an optimizer whose state graphfuse holds in shards (gf.compile routes the
user's optimizer to it; a ShardedOptimizer has it too)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping

import torch

from graphfuse.errors import UnsupportedError


class ShardedState(Mapping):
    """`optimizer.state` when graphfuse holds the optimizer state in shards across ranks: no
    rank has a parameter's whole state, so reading an entry raises with the call to use
    instead. Always true, so that code asking "has this optimizer any state yet?" (DCP's
    get_state_dict runs a step with zero gradients if not) never steps it behind the user's back."""

    def __init__(self, params: list[torch.Tensor], owner) -> None:
        self._params = {id(p): p for p in params}
        self.owner = weakref.ref(owner)  # the DistModel or ShardedOptimizer whose shards hold the state

    def stepped(self) -> bool:
        """Whether the owner is alive and has stepped (its shards hold state a new owner would lose)."""
        owner = self.owner()
        return owner is not None and any(owner.steps)

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._params)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._params.values())

    def __contains__(self, p: object) -> bool:
        return id(p) in self._params

    def __getitem__(self, p: torch.Tensor) -> dict:
        raise UnsupportedError(
            "optimizer.state[param]: graphfuse holds the optimizer state in shards across ranks (ZeRO-1), so no rank "
            "has a parameter's whole state; read optimizer.state_dict() (gathered, a collective: call it on "
            "every rank), "
            "or this rank's shards with DistModel.named_slices()"
        )
