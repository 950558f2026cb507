"""`save` and `load` on torch.distributed.checkpoint (DCP): all ranks meet at each stage
(agree.Exchange), a save is published only once verified, and a load reads into staging
buffers and copies into the live ones only after every rank read and checked all of it."""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from graphfuse.checkpoint import directory, record, state
from graphfuse.checkpoint.agree import Exchange, describe
from graphfuse.checkpoint.plan import Piece, StatePlan
from graphfuse.checkpoint.record import Record
from graphfuse.checkpoint.storage import (
    DCP_META,
    EXTRA_FILE,
    META_FILE,
    Chunks,
    LoadPlanner,
    SavePlanner,
    VerifiedReader,
    check_files,
    crc32,
    file_records,
    identity,
    read_dcp_metadata,
    tensor_md,
    verify_files,
)
from graphfuse.errors import CheckpointError

FAILURES = (Exception, CheckpointException)  # DCP's CheckpointException derives from BaseException


def _exchange(dm, timeout: float | None) -> Exchange:
    return Exchange(dm.group, dm.rank, dm.world_size, getattr(dm, "group_name", ""), timeout)


# ---- save -----------------------------------------------------------------------------------
def _pickle(extra) -> bytes | None:
    if extra is None:
        return None
    buf = io.BytesIO()
    try:
        torch.save(extra, buf)
    except Exception as e:
        raise CheckpointError(f"extra: cannot be saved ({type(e).__name__}: {e}); pass plain data") from None
    return buf.getvalue()


def save(dm, path: str | os.PathLike, mode: str | None = None, extra=None, timeout: float | None = None) -> None:
    """Save `dm` to directory `path`: every rank writes into `<path>.saving`; rank 0 checks
    that every rank's files are there with the sizes and CRC-32s their ranks computed, writes
    graphfuse.json, and only then replaces `<path>`. `extra` is the caller's plain data (e.g.
    {"scheduler": sched.state_dict()}), returned by `load`. A failure on any rank raises the
    same CheckpointError on all ranks, within `timeout` seconds of waiting for each other."""
    ex = _exchange(dm, timeout)
    final = Path(path).absolute()
    tmp, old = directory.siblings(final)
    error, sd, blob, save_id = None, None, None, None
    try:
        mode = state.mode_of(dm, mode)
        sd = state.state_dict(dm, mode)
        sd.pop("graphfuse")
        if dm.rank == 0:
            for p in (final, old, tmp):
                directory.check_replaceable(p)
            blob = _pickle(extra)
            save_id = uuid.uuid4().hex
            directory.begin(tmp, save_id)
    except FAILURES as e:
        error = e
    save_id = ex("gf.save (prepare)", error, save_id)[0]

    error, records = None, None
    try:
        writer = dcp.FileSystemWriter(str(tmp), thread_count=1, sync_files=True)
        try:
            dcp.save(sd, storage_writer=writer, planner=SavePlanner(), process_group=dm.group)
        except FAILURES as e:
            raise CheckpointError(f"{tmp}: writing failed, {describe(e)}") from None
        records = file_records(tmp, dm.rank)
    except FAILURES as e:
        error = e
    gathered = ex("gf.save (write)", error, records)

    error = None
    if dm.rank == 0:
        try:
            files = {k: v for f in gathered for k, v in f.items()}
            _finish(dm, mode, tmp, final, files, blob, save_id)
        except FAILURES as e:
            error = e
    ex("gf.save (publish)", error)


def _finish(dm, mode: str, tmp: Path, final: Path, files: dict, blob: bytes | None, save_id: str) -> None:
    """Rank 0: verify every rank's files, write extra.pt and graphfuse.json, publish."""
    md = read_dcp_metadata(tmp, files.get(DCP_META))
    verify_files(tmp, files, md)
    if blob is not None:
        directory.write_file(tmp / EXTRA_FILE, blob)
        files[EXTRA_FILE] = {"bytes": len(blob), "crc32": crc32(tmp / EXTRA_FILE)}
    rec = state.record_of(dm, state.plan(dm), mode, files, save_id)
    directory.write_file(tmp / META_FILE, rec.to_json().encode())
    directory.publish(tmp, final)


# ---- load -----------------------------------------------------------------------------------
@dataclass
class _Checked:
    """What a load validated on this rank, before reading any tensor."""

    where: Path
    record: Record | None
    md: object
    targets: dict
    derived: list[tuple[Piece, Piece]]
    small: dict  # step states, and a plain checkpoint's param groups
    seen: dict[str, tuple]  # identity of every file read, to see that none changes meanwhile
    extra: object
    groups: list[dict] | None


def load(dm, path: str | os.PathLike, timeout: float | None = None):
    """Load the checkpoint at `path` into `dm` in place and return the `extra` it was saved
    with. A graphfuse checkpoint of either mode, or a plain DCP checkpoint of {"model",
    "optim"} from get_state_dict. Nothing changes unless every rank validated and read all of it."""
    ex, p = _exchange(dm, timeout), state.plan(dm)
    error, checked = None, None
    try:
        checked = _validate(dm, p, directory.resolve(Path(path).absolute()))
    except FAILURES as e:
        error = e
    ex("gf.load (validate)", error)
    error, staged = None, None
    try:
        staged = _read(dm, p, checked)
    except FAILURES as e:
        error = e
    ex("gf.load (read)", error)
    pairs, steps, groups = staged
    with torch.no_grad():
        for live, new in pairs:
            live.copy_(new)
    state.apply(dm, checked.derived, steps, groups)
    return checked.extra


def _validate(dm, p: StatePlan, where: Path) -> _Checked:
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
    if rec is None:  # a plain checkpoint's param groups are in the data, read with the steps
        small.update({k: None for k in md.state_dict_metadata if k.startswith("optim.param_groups.")})
    seen |= check_files(where, md, rec.files if rec else None, set(wanted) | set(small))
    groups = state.check_groups(dm, p, rec.param_groups, name) if rec else None
    return _Checked(where, rec, md, wanted, derived, small, seen, _read_extra(where, rec), groups)


def _stage(target):
    if isinstance(target, Chunks):
        return Chunks(target.shape, target.dtype, [(o, s, torch.empty_like(v)) for o, s, v in target.chunks])
    return torch.empty_like(target)


def _read(dm, p: StatePlan, c: _Checked) -> tuple[list, list[int], list[dict]]:
    """Read every target into a staging copy and check what only the data can tell: the
    steps, a plain checkpoint's param groups, and that no file changed while it was read."""
    staged = {k: _stage(t) for k, t in c.targets.items()}
    into = {**staged, **c.small}
    try:
        dcp.load(into, storage_reader=VerifiedReader(c.where, c.md), planner=LoadPlanner(), process_group=dm.group)
    except FAILURES as e:
        raise CheckpointError(f"{c.where}: reading failed, {describe(e)}") from None
    for name, before in c.seen.items():
        if not (c.where / name).exists() or identity(c.where / name) != before:
            raise CheckpointError(
                f"{c.where / name}: changed while it was being loaded (another job saving to {c.where}?); load again"
            )
    name = str(c.where)
    steps = state.steps_of(p, c.record, lambda k: into[k].item(), lambda k: k in c.md.state_dict_metadata, name)
    groups = c.groups
    if groups is None:
        saved: list[dict] = []
        for key in c.small:
            if key.startswith("optim.param_groups."):
                g, hyper = key[len("optim.param_groups.") :].split(".", 1)
                saved += [{} for _ in range(int(g) + 1 - len(saved))]
                saved[int(g)][hyper] = into[key]
        groups = state.check_groups(dm, p, saved, name)
    pairs = []
    for key, target in c.targets.items():
        new = staged[key]
        if isinstance(target, Chunks):
            pairs += [(v, n) for (_, _, v), (_, _, n) in zip(target.chunks, new.chunks)]
        else:
            pairs.append((target, new))
    return pairs, steps, groups


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
