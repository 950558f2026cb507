"""`DistModel.load_state_dict`: an in-memory state dict (from `state_dict`, or a plain
{"model", "optim"} of full tensors) validated like a checkpoint on disk, then copied in place."""

from __future__ import annotations

import torch

from graphfuse.checkpoint import carried
from graphfuse.checkpoint.record import from_dict
from graphfuse.checkpoint.state import (
    apply,
    carried_of,
    check_groups,
    check_layout,
    check_optimizer,
    check_tensor,
    plan,
    steps_of,
    targets,
)
from graphfuse.checkpoint.storage import Chunks
from graphfuse.checkpoint.training_state import TrainingState
from graphfuse.errors import CheckpointError, CheckpointMismatchError


def _lookup(sd: dict, key_path: tuple[str, ...]):
    d = sd
    for k in key_path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _split(key: str) -> tuple[str, ...]:
    """A target key back into its state-dict path: "model.<fqn>", "optim.state.<fqn>.<s>" or "slice@..."."""
    if key.startswith("model."):
        return ("model", key[6:])
    if key.startswith("optim.state."):
        fqn, state = key[12:].rsplit(".", 1)
        return ("optim", "state", fqn, state)
    return (key,)


def _pairs(key: str, target, source, where: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source tensor) pairs that fill `target` from an in-memory value."""
    tchunks = target.chunks if isinstance(target, Chunks) else [((0,) * target.dim(), tuple(target.shape), target)]
    if isinstance(source, torch.Tensor):
        return [(v, source[tuple(slice(o, o + s) for o, s in zip(off, sz))]) for off, sz, v in tchunks]
    held = {(tuple(off), tuple(sz)): t for off, sz, t in source.chunks}
    out = []
    for off, sz, v in tchunks:
        src = held.get((tuple(off), tuple(sz)))
        if src is None:
            raise CheckpointMismatchError(
                f"{where}: key {key!r} lacks the chunk at offsets {tuple(off)} of size {tuple(sz)} this rank holds; "
                "an in-memory state dict loads only at the layout it came from; use gf.save and gf.load to reshard"
            )
        out.append((v, src))
    return out


def load_state_dict(dm: TrainingState, sd: dict) -> None:
    """Copy `sd` (from state_dict, or a plain {"model", "optim"} of full tensors) into the
    live buffers, after validating every key, shape, dtype, step and the layout."""
    where, p = "state dict", plan(dm)
    record = from_dict(sd["graphfuse"], where) if sd.get("graphfuse") is not None else None
    mode = record.mode if record else "balanced"
    if record:
        check_layout(dm, p, record, where)
        check_optimizer(dm, record, where)

    def has(key: str) -> bool:
        return _lookup(sd, _split(key)) is not None

    def get(key: str):
        source = _lookup(sd, _split(key))
        if not isinstance(source, (torch.Tensor, Chunks)):
            raise CheckpointError(
                f"{where}: key {key!r} is missing" if source is None else f"{where}: key {key!r} is not a tensor"
            )
        return source

    wanted, derived = targets(dm, p, mode, has)
    pairs = []
    for key, target in wanted.items():
        source = get(key)
        check_tensor(key, target, tuple(source.size()), source.dtype, where)
        pairs += _pairs(key, target, source, where)
    for dst, src in pairs:
        if dst.shape != src.shape:
            raise CheckpointMismatchError(
                f"{where}: a chunk of shape {tuple(src.shape)} cannot fill one of {tuple(dst.shape)}"
            )
    frozen = {k: get(k).clone() for k in carried.keys(dm, _flat_optim_keys(sd))}
    steps = steps_of(
        p,
        record,
        lambda k: get(k).item(),
        has,
        where,
        lambda g: carried.step_of_group(dm, g, lambda k: get(k).item(), has),
    )
    saved_groups = record.param_groups if record else (_lookup(sd, ("optim", "param_groups")) or [])
    groups = check_groups(dm, p, saved_groups, where)
    carry = carried_of(dm, p, steps, groups, lambda k: get(k).item(), has, where)
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
    apply(dm, derived, steps, groups, carry)
    carried.hold(dm, frozen)


def _flat_optim_keys(sd: dict) -> list[str]:
    states = _lookup(sd, ("optim", "state"))
    if not isinstance(states, dict):
        return []
    return [f"optim.state.{f}.{s}" for f, d in states.items() if isinstance(d, dict) for s in d]
