"""A PyTorch user's usual calls on a model and optimizer whose training state graphfuse owns:
each works as in plain PyTorch or raises, never silently does nothing (docs/habits.md).

After gf.compile the user's optimizer routes `state_dict()` / `load_state_dict()` to the
state graphfuse holds, refuses `step()` and `add_param_group()`, and its `state` stands for the
sharded state; the model syncs before `state_dict()` and refreshes fp32 master shards after
`load_state_dict()`. A `ShardedOptimizer` gets the same `state`."""

from __future__ import annotations

import types
import weakref
from typing import Protocol, cast

import torch

from graphfuse.checkpoint.torch_form import load_torch_form, torch_form
from graphfuse.checkpoint.training_state import TrainingState
from graphfuse.errors import UnsupportedError
from graphfuse.optim import Optimizers, ShardedState


class Owner(TrainingState, Protocol):
    """What owns a routed optimizer's state: a DistModel, or the ShardedOptimizer wrapping it."""

    def load_state_dict(self, state_dict: dict) -> None: ...


class _DistModel(Owner, Protocol):
    """A DistModel as an owner (habits cannot import it): it syncs its weights and finishes loads."""

    def sync(self) -> None: ...
    def loaded(self) -> None: ...


def check_unowned(opt: torch.optim.Optimizer | Optimizers, how: str) -> None:
    """Refuse an optimizer whose state a live DistModel or ShardedOptimizer that has stepped
    holds: a new owner would start from zero state and the old one's would be lost silently."""
    if isinstance(opt, Optimizers):
        for o in opt.optimizers:
            check_unowned(o, how)
        return
    if isinstance(opt.state, ShardedState) and opt.state.stepped():
        raise UnsupportedError(
            f"{how}: {type(opt).__name__} already belongs to a DistModel or ShardedOptimizer that has stepped, whose "
            "shards hold its state; build a fresh optimizer and move the state with "
            "new.load_state_dict(old.state_dict())"
        )


def refuse_add_param_group(owner_name: str):
    def add_param_group(self, param_group: dict) -> None:
        raise UnsupportedError(
            f"add_param_group after {owner_name}: the compiled update was traced with the param groups it had then; "
            f"add every param group before {owner_name}"
        )

    return add_param_group


def route_optimizers(opt: Optimizers, owner: Owner, how: str) -> None:
    """Several optimizers: each speaks for its own param groups' state (its state_dict() is what
    the same plain torch optimizer would give), and `opt` for all of them (a list of those)."""
    for part, o in enumerate(opt.optimizers):
        route_optimizer(o, owner, how, part)
    ref = weakref.ref(owner)

    def state_dict(self) -> list[dict]:
        """One torch.optim state dict per optimizer, in order. A collective: call it on every rank."""
        return [o.state_dict() for o in self.optimizers]

    def load_state_dict(self, state_dicts: list[dict]) -> None:
        if not isinstance(state_dicts, list | tuple) or len(state_dicts) != len(self.optimizers):
            raise UnsupportedError(
                f"{self!r}.load_state_dict takes a list of {len(self.optimizers)} state dicts, one per optimizer"
            )
        for o, sd in zip(self.optimizers, state_dicts):
            o.load_state_dict(sd)

    opt.state_dict = types.MethodType(state_dict, opt)
    opt.load_state_dict = types.MethodType(load_state_dict, opt)
    opt.state = ShardedState([p for g in opt.param_groups for p in g["params"] if p.requires_grad], ref())


def route_optimizer(opt: torch.optim.Optimizer | Optimizers, owner: Owner, how: str, part: int | None = None) -> None:
    """Make the user's optimizer `opt` speak for the state `owner` holds (a DistModel, or the
    ShardedOptimizer that wraps `opt`); `how` names what replaces `opt.step()`. `part`: `opt`
    is optimizer `part` of several (graphfuse.optim.Optimizers) and speaks for its groups only."""
    if isinstance(opt, Optimizers):
        route_optimizers(opt, owner, how)
        return
    ref = weakref.ref(owner)  # weak: the optimizer must not keep its owner (and its process group) alive

    def live() -> Owner:
        o = ref()
        if o is None:
            raise UnsupportedError(f"the object that held this optimizer's state is gone; {how} again")
        return o

    def state_dict(self) -> dict:
        """The optimizer state graphfuse holds, gathered into torch.optim's form (keyed by
        parameter index). A collective: call it on every rank."""

        o = live()
        if isinstance(o, torch.optim.Optimizer):  # a ShardedOptimizer: its weights are always current
            return o.state_dict() if part is None else torch_form(o, by_index=True, part=part)
        dm = cast(_DistModel, o)  # not a ShardedOptimizer: a DistModel
        dm.sync()
        return torch_form(dm, by_index=True, part=part)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch.optim's form (by index or FQN) into the state graphfuse holds, validated first."""
        if part is None:
            live().load_state_dict(state_dict)
            return
        o = live()
        load_torch_form(o, state_dict, part=part)
        if not isinstance(o, torch.optim.Optimizer):
            cast(_DistModel, o).loaded()  # not a ShardedOptimizer: a DistModel

    def step(self, closure=None):
        raise UnsupportedError(
            f"{type(self).__name__}.step() after {how}: graphfuse runs this optimizer's update, sharded, and a step "
            f"here would update the weights outside it. {STEP_INSTEAD[how]}"
        )

    # torch's LR schedulers wrap optimizer.step to see that it ran, and warn when it was replaced
    # after them; the owner's step sets optimizer._opt_called itself, which is what they check.
    # The user's optimizer is patched on purpose, per instance: its methods and `state` speak for the shards.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # the mark torch's LR schedulers look for
    opt.state_dict = types.MethodType(state_dict, opt)  # type: ignore[method-assign]
    opt.load_state_dict = types.MethodType(load_state_dict, opt)  # type: ignore[method-assign]
    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
    opt.add_param_group = types.MethodType(refuse_add_param_group(how), opt)  # type: ignore[method-assign]
    # stands for torch.optim's defaultdict of states, which no rank holds whole
    opt.state = ShardedState(  # type: ignore[assignment]
        [p for g in opt.param_groups for p in g["params"] if p.requires_grad], owner
    )


STEP_INSTEAD = {
    "gf.compile": "The DistModel's call, dm(batch), runs the whole step (forward, backward and update): call only that",
    "gf.shard_optimizer": "Call step() of the optimizer gf.shard_optimizer returned",
}


def hook_model(dm) -> None:
    """`model.state_dict()` shows current weights (a deferred all-gather is finished first), and
    `model.load_state_dict()` reaches the fp32 master shards the update reads, which would
    otherwise overwrite the loaded weights at the next step."""
    ref = weakref.ref(dm)

    def before_state_dict(module, prefix, keep_vars) -> None:
        live = ref()
        if live is not None:
            live.sync()

    def after_load(module, incompatible) -> None:
        live = ref()
        if live is not None:
            loaded = {n for n, _ in module.named_parameters()} - set(incompatible.missing_keys)
            live.weights_loaded(loaded)

    dm.model.register_state_dict_pre_hook(before_state_dict)
    dm.model.register_load_state_dict_post_hook(after_load)
