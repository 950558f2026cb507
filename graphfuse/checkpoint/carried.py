"""Optimizer state of parameters frozen after training: a frozen parameter has no shard in the
buckets, but its moments and step from the checkpoint are kept as they were and saved again, so
that unfreezing it later resumes them (eager torch.optim keeps them too; DCP's get_state_dict drops them)."""

from __future__ import annotations

import weakref

import torch

from graphfuse.checkpoint.training_state import TrainingState

_held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DistModel -> {checkpoint key: tensor}
PREFIX = "optim.state."


def frozen_fqns(dm: TrainingState) -> list[str]:
    """The optimizer's parameters that the compiled step does not train (requires_grad=False)."""
    fqn = {id(p): n for n, p in dm.model.named_parameters()}
    trained = set(dm.layout.fqns) | set(dm.program.signature.aliases)
    names = (fqn.get(id(p)) for g in dm.optimizer.param_groups for p in g["params"])
    return [n for n in names if n is not None and n not in trained]


def group_params(dm: TrainingState, groups: tuple[tuple[str, ...], ...]) -> list[list[str]]:
    """Every param group's FQNs as torch.optim lists them: the trained ones (`groups`), then the frozen."""
    frozen = set(frozen_fqns(dm))
    fqn = {id(p): n for n, p in dm.model.named_parameters()}
    return [
        list(trained) + [fqn[id(p)] for p in g["params"] if fqn.get(id(p)) in frozen]
        for trained, g in zip(groups, dm.optimizer.param_groups)
    ]


def keys(dm: TrainingState, available) -> list[str]:
    """The keys among `available` that hold state of a frozen parameter."""
    frozen = set(frozen_fqns(dm))
    return [k for k in available if k.startswith(PREFIX) and k[len(PREFIX) :].rsplit(".", 1)[0] in frozen]


def held(dm: TrainingState) -> dict[str, torch.Tensor]:
    """{"optim.state.<fqn>.<state>": tensor} carried by `dm` since its last load."""
    return _held.get(dm, {})


def hold(dm: TrainingState, values: dict[str, torch.Tensor]) -> None:
    """Carry `values` (read by a load that succeeded on every rank) in place of the previous ones."""
    _held[dm] = dict(values)


def add_to(sd: dict, dm: TrainingState) -> None:
    """Put the carried states into state dict `sd` under optim.state.<fqn>.<state>."""
    for key, value in held(dm).items():
        fqn, name = key[len(PREFIX) :].rsplit(".", 1)
        sd["optim"]["state"].setdefault(fqn, {})[name] = value


def step_of_group(dm: TrainingState, g: int, read, has) -> list[float]:
    """The carried step states of group `g`'s frozen parameters (read with `read`)."""
    frozen = set(frozen_fqns(dm))
    fqn = {id(p): n for n, p in dm.model.named_parameters()}
    names = [fqn.get(id(p)) for p in dm.optimizer.param_groups[g]["params"]]
    return [float(read(k)) for n in names if n in frozen and has(k := f"{PREFIX}{n}.step")]
