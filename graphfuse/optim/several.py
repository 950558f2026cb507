"""Several torch.optim optimizers over disjoint parameters compiled as one step (Muon for the
hidden matrices beside AdamW for the rest): gf.compile and gf.shard_optimizer take a list."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from graphfuse.errors import UnsupportedError


class Optimizers:
    """The optimizers of one step, their param groups in one list (the same dicts: an LR
    scheduler on any of them acts on the step). Group g of the step is group g - start(i) of
    optimizer i, where `spans[i]` is [start, stop). Its `state_dict()` is one torch.optim state
    dict per optimizer, as the user's own code would save them; `load_state_dict` takes that list."""

    # Set on the instance by graphfuse.frontends.habits.route_optimizers, which the DistModel or
    # ShardedOptimizer that owns the state calls as it takes them.
    state_dict: Callable[[], list[dict]]
    load_state_dict: Callable[[list[dict]], None]

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise UnsupportedError(
                f"the optimizer argument must be a torch.optim.Optimizer or a non-empty list of them, got "
                f"{optimizers!r}"
            )
        self.optimizers = tuple(optimizers)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.spans, at = [], 0
        for o in self.optimizers:
            self.spans.append((at, at + len(o.param_groups)))
            at += len(o.param_groups)
        self.defaults: dict = {}
        self.state: Mapping = {}  # gf.compile routes it to the shards (graphfuse.frontends.habits)

    @property
    def _opt_called(self) -> bool:
        return all(getattr(o, "_opt_called", False) for o in self.optimizers)

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:  # the step ran: every optimizer's LR schedulers check this
        for o in self.optimizers:
            # torch's LR schedulers set and read this flag; torch.optim.Optimizer does not declare it
            o._opt_called = value  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"Optimizers({', '.join(type(o).__name__ for o in self.optimizers)})"


def as_one(optimizer) -> torch.optim.Optimizer | Optimizers:
    """`optimizer` itself, or a list or tuple of optimizers as one `Optimizers` (a list of one
    is that optimizer)."""
    if isinstance(optimizer, list | tuple):
        return (
            optimizer[0]
            if len(optimizer) == 1 and isinstance(optimizer[0], torch.optim.Optimizer)
            else Optimizers(optimizer)
        )
    return optimizer
