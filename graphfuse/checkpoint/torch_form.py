"""The optimizer state graphfuse holds, in torch.optim's form: full tensors gathered from the
shards (one all-gather per state shard), keyed by FQN or, as `torch.optim.Optimizer.state_dict()`
keys them, by parameter index; and loading either form (or a plain torch optimizer's
state_dict(), or one saved before its first step) through graphfuse.checkpoint's validated
in-memory load. Used by both owners of training state: a DistModel and a ShardedOptimizer."""

from __future__ import annotations

from typing import cast

import torch

from graphfuse.checkpoint.memory import load_state_dict
from graphfuse.checkpoint.state import plan
from graphfuse.checkpoint.training_state import TrainingState
from graphfuse.errors import CheckpointMismatchError, UnsupportedError
from graphfuse.ir import signature as sig
from graphfuse.ir.state_plan import MASTER
from graphfuse.optim import Optimizers, torch_host_states
from graphfuse.ranks import Exchange, all_gather_flat, backend_of

TORCH_MODE = "torch"
TIMEOUT = 300.0  # seconds a rank waits for the others to call state_dict() too (a test may lower it)


def _gather(owner: TrainingState, shard: torch.Tensor) -> torch.Tensor:
    """The whole bucket-sized tensor of which every rank holds `shard`."""
    if owner.world_size == 1:
        return shard
    # Gloo gathers host tensors only; the state goes back to the shard's device.
    host = backend_of(owner.group, shard.device.type) == "gloo" and shard.device.type != "cpu"
    src = shard.cpu() if host else shard.contiguous()
    whole = src.new_empty(src.numel() * owner.world_size)
    all_gather_flat(whole, src, owner.group)
    return whole.to(shard.device)


def _groups(owner: TrainingState, part: int | None) -> tuple[list[dict], range]:
    """The live param groups of the optimizer (of optimizer `part` of several: graphfuse.optim.Optimizers)
    and their indices among the step's groups."""
    if part is None:
        return owner.optimizer.param_groups, range(len(owner.optimizer.param_groups))
    return _several(owner).optimizers[part].param_groups, range(*_several(owner).spans[part])


def _several(owner: TrainingState) -> Optimizers:
    """The owner's optimizers where a `part` of them is asked for: only the members of an
    `Optimizers` are given a part (graphfuse.frontends.habits.route_optimizers)."""
    return cast(Optimizers, owner.optimizer)


def param_fqns(owner: TrainingState, part: int | None = None) -> list[str]:
    """The FQN of every parameter of the optimizer's param groups, in torch.optim's index order
    (a tied parameter by its first name, as model.named_parameters() gives it)."""
    fqn = {id(p): n for n, p in owner.model.named_parameters()}
    return [fqn[id(p)] for g in _groups(owner, part)[0] for p in g["params"]]


def torch_form(owner: TrainingState, by_index: bool = False, part: int | None = None) -> dict:
    """{"state": {fqn: {state: full tensor, "step"}}, "param_groups": [{..., "params": [fqn]}]}:
    what get_optimizer_state_dict(model, optim, StateDictOptions(full_state_dict=True)) gives
    for the same plain torch optimizer, so that torch.optim loading it steps on exactly as
    graphfuse would. `by_index`: keyed by parameter index instead, as torch.optim's own
    `state_dict()` (what DCP's get_state_dict and accelerate read). A param group that has not
    stepped yet has no state, as in torch.optim. Collective: every rank must call it. fp32
    master weights are left out (torch.optim has none); loading derives them from the weights.
    `part`: of several optimizers (graphfuse.optim.Optimizers), the state dict of optimizer `part` alone."""
    if owner.world_size > 1:  # the gathers are collectives: a call on one rank only would hang in them
        ask = "optimizer.state_dict() gathers the optimizer state, which graphfuse holds in shards across ranks"
        Exchange(owner.group, owner.rank, owner.world_size, owner.group_name, TIMEOUT, error=UnsupportedError)(
            f"{ask}, so every rank must call it (a call on rank 0 only cannot complete; gf.save writes each rank's "
            "shards without gathering)",
            None,
        )
    program, steps = owner.program, owner.steps
    groups, mine = _groups(owner, part)
    stepped = {f for g, spec in enumerate(program.optim.groups) if steps[g] > 0 and g in mine for f in spec.params}
    shards = program.signature.names(sig.SHARD)
    state: dict[str, dict] = {}
    with torch.no_grad():
        for bucket in owner.layout.buckets:
            for name in (n for n in shards if n.split(".", 1)[0] == bucket.name):
                what = name.split(".", 1)[1]
                if what == MASTER or not stepped.intersection(bucket.fqns):
                    continue
                whole = _gather(owner, owner.tensors[name])
                for slot in program.state_layout(bucket, what).slots:  # each state in its own shape
                    if slot.fqn in stepped:
                        state.setdefault(slot.fqn, {})[what] = whole[slice(*slot.data_range)].view(slot.shape).clone()
    for g, group in zip(mine, groups):
        spec = program.optim.groups[g]
        if spec.has_step and steps[g] > 0:
            # and the 0-d states graphfuse computes on the host (NAdam's mu_product, ASGD's eta and mu)
            host = torch_host_states(spec, steps[g], owner.carried[g], float(group["lr"]))
            for fqn in spec.params:
                state.setdefault(fqn, {}).update(
                    step=torch.tensor(float(steps[g])), **{k: v.clone() for k, v in host.items()}
                )
    form = {
        "state": state,
        "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(spec.params)}
            for group, spec in zip(groups, program.optim.groups[mine.start : mine.stop])
        ],
    }
    return _by_index(owner, form, part) if by_index else form


def _by_index(owner: TrainingState, form: dict, part: int | None) -> dict:
    """`form` keyed as torch.optim.Optimizer.state_dict() keys it: every parameter of the param
    groups by its position (frozen ones too), the state ordered by that position."""
    fqns = param_fqns(owner, part)
    index = {f: i for i, f in enumerate(fqns)}
    groups, at = [], 0
    for group, live in zip(form["param_groups"], _groups(owner, part)[0]):
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + len(live["params"])))}
        )
        at += len(live["params"])
    state = {index[f]: form["state"][f] for f in fqns if f in form["state"]}
    return {"state": state, "param_groups": groups}


def _fresh_state(owner: TrainingState) -> dict[str, dict]:
    """The state of an optimizer that never stepped, as a checkpoint would hold it: zeros in
    every state's full shape, step 0 (loading it resets the shards, as loading torch.optim's
    empty state resets a torch optimizer)."""
    state: dict[str, dict] = {}
    for piece in plan(owner).balanced:
        if piece.path[0] == "optim" and piece.path[-1] != MASTER:
            fqn, what = piece.path[2], piece.path[3]
            state.setdefault(fqn, {})[what] = torch.zeros(piece.shape, dtype=getattr(torch, piece.dtype))
    for spec in owner.program.optim.groups:
        if spec.has_step:
            for fqn in spec.params:
                state.setdefault(fqn, {})["step"] = torch.tensor(0.0)
    return state


def load_torch_form(owner: TrainingState, sd: dict, part: int | None = None) -> None:
    """Load {"state", "param_groups"} keyed by FQN, or by parameter index in param-group order
    (a plain torch optimizer's state_dict()); the weights are left as they are. An empty
    "state" (an optimizer saved before its first step) resets the optimizer to that. `part`:
    `sd` is optimizer `part`'s of several; the others keep their state (gathered: a collective)."""
    names = param_fqns(owner, part)

    def fqn(key) -> str:
        if isinstance(key, int):
            if not 0 <= key < len(names):
                raise CheckpointMismatchError(
                    f"state dict: parameter index {key} is out of range; this optimizer has {len(names)} parameters"
                )
            return names[key]
        return key

    state = {fqn(k): v for k, v in sd["state"].items()} or _fresh_state(owner)
    groups = [{**g, "params": [fqn(k) for k in g.get("params", [])]} for g in sd["param_groups"]]
    if part is not None:
        state, groups = _with_the_others(owner, part, state, groups)
    model = {k: v.detach().clone() for k, v in owner.model.state_dict().items()}
    load_state_dict(owner, {"model": model, "optim": {"state": state, "param_groups": groups}})


def _with_the_others(owner: TrainingState, part: int, state: dict, groups: list[dict]) -> tuple[dict, list[dict]]:
    """Optimizer `part`'s loaded state and groups among the current ones of the other optimizers
    (zeros where they have not stepped), the whole step's state as `load_state_dict` takes it."""
    mine = set(param_fqns(owner, part))
    current = torch_form(owner)
    merged = {f: v for f, v in (_fresh_state(owner) | current["state"]).items() if f not in mine}
    merged.update({f: v for f, v in state.items() if f in mine})
    span = range(*_several(owner).spans[part])
    if len(groups) != len(span):
        raise CheckpointMismatchError(
            f"state dict of optimizer {part} ({type(_several(owner).optimizers[part]).__name__}) has "
            f"{len(groups)} param groups, "
            f"the live one {len(span)}; load the state dict this optimizer saved"
        )
    every = current["param_groups"]
    return merged, every[: span.start] + groups + every[span.stop :]
