"""`load` from torch.distributed.checkpoint (DCP): every rank validates, then reads into staging
buffers, meeting the others after each stage (ranks.Exchange); the live buffers change only
after every rank read and checked all of it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata

from graphfuse.checkpoint import carried, directory, record, state
from graphfuse.checkpoint.agree import exchange
from graphfuse.checkpoint.record import Record
from graphfuse.checkpoint.saving import join
from graphfuse.checkpoint.storage import (
    DCP_META,
    EXTRA_FILE,
    META_FILE,
    Chunks,
    LoadPlanner,
    VerifiedReader,
    check_files,
    crc32,
    dcp_load,
    identity,
    read_dcp_metadata,
    tensor_md,
)
from graphfuse.checkpoint.training_state import TrainingState, expect_training_state
from graphfuse.errors import CheckpointError, CheckpointMismatchError
from graphfuse.ir.state_plan import Piece, StatePlan
from graphfuse.ranks import FAILURES, describe


# ---- load -----------------------------------------------------------------------------------
@dataclass
class _Checked:
    """What a load validated on this rank, before reading any tensor."""

    where: Path
    record: Record | None
    md: Metadata
    targets: dict
    derived: list[tuple[Piece, Piece]]
    small: dict  # step states, and a plain checkpoint's param groups
    staged: dict  # a staging buffer for every target, allocated before the ranks agree
    frozen: dict  # the carried optimizer state of parameters frozen here (carried.py)
    seen: dict[str, tuple]  # identity of every file read, to see that none changes meanwhile
    extra: object
    groups: list[dict] | None


def load(dm: TrainingState, path: str | os.PathLike, timeout: float | None = None):
    """Load the checkpoint at `path` into `dm` in place and return the `extra` it was saved
    with. A graphfuse checkpoint of either mode, or a plain DCP checkpoint of {"model",
    "optim"} from get_state_dict. Nothing changes unless every rank validated and read all of it."""
    expect_training_state(dm, "gf.load")
    join(dm)
    ex, p = exchange(dm, timeout), state.plan(dm)
    error, checked = None, None
    try:
        directory.check_unlocked(Path(path).absolute())
        checked = _validate(dm, p, directory.resolve(Path(path).absolute()))
    except FAILURES as e:
        error = e
    ex("gf.load (validate)", error)
    assert checked is not None  # ex raised unless every rank validated
    error, staged = None, None
    try:
        staged = _read(dm, p, checked)
    except FAILURES as e:
        error = e
    ex("gf.load (read)", error)
    assert staged is not None  # ex raised unless every rank read
    pairs, steps, groups, carry = staged
    with torch.no_grad():
        for live, new in pairs:
            live.copy_(new)
    state.apply(dm, checked.derived, steps, groups, carry)
    carried.hold(dm, checked.frozen)
    return checked.extra


def _validate(dm: TrainingState, p: StatePlan, where: Path) -> _Checked:
    seen = {META_FILE: identity(where / META_FILE)} if (where / META_FILE).exists() else {}
    rec = record.read(where)
    md = read_dcp_metadata(where, rec.files.get(DCP_META) if rec else None)
    mode, name = (rec.mode if rec else "balanced"), str(where)
    if rec:
        state.check_layout(dm, p, rec, name)
        state.check_optimizer(dm, rec, name)
    wanted, derived = state.targets(dm, p, mode, lambda k: k in md.state_dict_metadata)
    for key, target in wanted.items():
        entry = tensor_md(md, key, where)
        state.check_tensor(key, target, tuple(entry.size), entry.properties.dtype, name)
    small: dict = {k: torch.zeros(tuple(tensor_md(md, k, where).size)) for k in state.step_keys(p)}
    small.update(
        {
            k: torch.zeros(tuple(tensor_md(md, k, where).size))
            for k in state.carried_keys(dm, p)
            if k in md.state_dict_metadata
        }
    )
    if rec is None:  # a plain checkpoint's param groups are in the data, read with the steps
        small.update({k: None for k in md.state_dict_metadata if k.startswith("optim.param_groups.")})
    frozen = {}
    for k in carried.keys(dm, md.state_dict_metadata):
        entry = tensor_md(md, k, where)
        frozen[k] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    seen |= check_files(where, md, rec.files if rec else None, set(wanted) | set(small) | set(frozen))
    groups = state.check_groups(dm, p, rec.param_groups, name) if rec else None
    staged = {k: _stage(t) for k, t in wanted.items()}  # may run out of memory: before the exchange
    return _Checked(where, rec, md, wanted, derived, small, staged, frozen, seen, _read_extra(where, rec), groups)


def _stage(target):
    if isinstance(target, Chunks):
        return Chunks(target.shape, target.dtype, [(o, s, torch.empty_like(v)) for o, s, v in target.chunks])
    return torch.empty_like(target)


def _read(dm: TrainingState, p: StatePlan, c: _Checked) -> tuple[list, list[int], list[dict], list[dict]]:
    """Read every target into a staging copy and check what only the data can tell: the
    steps, what they carried (ASGD's eta), a plain checkpoint's param groups, and that no
    file changed while it was read."""
    staged = c.staged
    into = {**staged, **c.small, **c.frozen}
    try:
        dcp_load(into, VerifiedReader(c.where, c.md), LoadPlanner(), dm.group, single=dm.world_size == 1)
    except FAILURES as e:
        raise CheckpointError(f"{c.where}: reading failed, {describe(e)}") from None
    for name, before in c.seen.items():
        if not (c.where / name).exists() or identity(c.where / name) != before:
            raise CheckpointError(
                f"{c.where / name}: changed while it was being loaded (another job saving to {c.where}?); load again"
            )
    name = str(c.where)
    has = c.md.state_dict_metadata.__contains__
    steps = state.steps_of(
        p,
        c.record,
        lambda k: into[k].item(),
        has,
        name,
        lambda g: carried.step_of_group(dm, g, lambda k: into[k].item(), has),
    )
    groups = c.groups
    if groups is None:
        saved: list[dict] = []
        for key in c.small:
            if key.startswith("optim.param_groups."):
                g, hyper = key[len("optim.param_groups.") :].split(".", 1)
                if not g.isdigit() or int(g) >= len(dm.optimizer.param_groups):
                    raise CheckpointMismatchError(f"{name}: {key!r} names a param group this optimizer does not have")
                saved += [{} for _ in range(int(g) + 1 - len(saved))]
                saved[int(g)][hyper] = into[key]
        groups = state.check_groups(dm, p, saved, name)
    carry = state.carried_of(dm, p, steps, groups, lambda k: into[k].item(), lambda k: k in c.small, name)
    pairs = []
    for key, target in c.targets.items():
        new = staged[key]
        if isinstance(target, Chunks):
            pairs += [(v, n) for (_, _, v), (_, _, n) in zip(target.chunks, new.chunks)]
        else:
            pairs.append((target, new))
    return pairs, steps, groups, carry


def _read_extra(where: Path, rec: Record | None):
    f = where / EXTRA_FILE
    if not f.exists():
        if rec is not None and EXTRA_FILE in rec.files:
            raise CheckpointError(f"{f}: missing; graphfuse.json records it")
        return None
    want = rec.files.get(EXTRA_FILE) if rec else None
    if want is not None and (f.stat().st_size != want["bytes"] or crc32(f) != want["crc32"]):
        raise CheckpointError(f"{f}: contents differ from when it was saved (size or CRC-32 mismatch)")
    try:
        return torch.load(f, weights_only=True)
    except Exception as e:  # truncated zip, unpickling refused, ...
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
