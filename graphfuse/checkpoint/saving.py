"""`save` on torch.distributed.checkpoint (DCP), now or in the background: every rank writes
into `<path>.saving`, rank 0 verifies every rank's files and only then publishes, and the ranks
meet after each stage (ranks.Exchange) so a failure anywhere ends the save everywhere."""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import traceback
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from graphfuse import atomic_dir
from graphfuse.checkpoint import directory, state
from graphfuse.checkpoint.agree import exchange
from graphfuse.checkpoint.record import Record
from graphfuse.checkpoint.storage import (
    DCP_META,
    EXTRA_FILE,
    META_FILE,
    Chunks,
    SavePlanner,
    crc32,
    dcp_save,
    file_records,
    read_dcp_metadata,
    verify_files,
)
from graphfuse.checkpoint.training_state import TrainingState, expect_training_state
from graphfuse.errors import CheckpointError
from graphfuse.ranks import FAILURES, Exchange, describe, hold

_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DistModel -> its SaveHandle in flight
_side_groups: dict[
    tuple[int, ...], Callable
] = {}  # ranks -> weak handle (ranks.hold) on their group for background saves


class SaveHandle:
    """A save running in the background; `wait()` joins it and raises its error, if any.
    The next gf.save or gf.load of the same model joins it first (raising its error there);
    call `wait()` before destroying the process group."""

    def __init__(self, run) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(run,), name="graphfuse-save")
        self._thread.start()

    def _main(self, run) -> None:
        try:
            run()
        except BaseException as e:  # handed to wait(): a background thread has nobody else to tell
            traceback.clear_frames(e.__traceback__)  # the lines stay; the frames' locals (the group) go
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise error


def join(dm: TrainingState) -> None:
    """Wait for the saves in flight before `dm` meets the other ranks outside its step: its own
    (its error is raised here, once), and every other model's, which share the side group of
    their ranks and, on the same group, the exchange's sequence; those keep their errors for
    their own next save, load or wait(). Every rank joins in its program's order: the same."""
    for other, handle in list(_pending.items()):
        if other is not dm:
            handle._thread.join()
    handle = _pending.pop(dm, None)
    if handle is not None:
        handle.wait()


def _pickle(extra) -> bytes | None:
    if extra is None:
        return None
    buf = io.BytesIO()
    try:
        torch.save(extra, buf)
    except Exception as e:
        raise CheckpointError(f"extra: cannot be saved ({type(e).__name__}: {e}); pass plain data") from None
    return buf.getvalue()


def _copy(value):
    """A host copy of a state value (pinned on CUDA), so that training may go on meanwhile."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, Chunks):
        return Chunks(value.shape, value.dtype, [(o, s, _copy(v)) for o, s, v in value.chunks])
    if isinstance(value, torch.Tensor):
        out = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
        return out.copy_(value, non_blocking=value.is_cuda)
    return value


def save(
    dm: TrainingState,
    path: str | os.PathLike,
    mode: str | None = None,
    extra=None,
    timeout: float | None = None,
    async_: bool = False,
) -> SaveHandle | None:
    """Save `dm` to directory `path`; `extra` is the caller's plain data (e.g. {"scheduler":
    sched.state_dict()}), returned by `load`. A failure on any rank raises the same
    CheckpointError on all ranks, each waiting at most `timeout` seconds for the others.
    `async_=True`: the state is copied to host memory, the files are written by a background
    thread, and a `SaveHandle` is returned (its `wait()` raises a failure)."""
    expect_training_state(dm, "gf.save")
    join(dm)
    ex, final = exchange(dm, timeout), Path(path).absolute()
    tmp, old = directory.siblings(final)
    error, sd, rec, blob, save_id = None, None, None, None, None
    try:
        mode = state.mode_of(dm, mode)
        sd = state.state_dict(dm, mode)
        rec = state.record_of(dm, state.plan(dm), mode)
        del sd["graphfuse"]
        if async_:  # before the exchange: nothing may fail on one rank between it and DCP's collectives
            sd = _copy(sd)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        if dm.rank == 0:
            save_id = uuid.uuid4().hex
            directory.acquire(final, save_id)
            for p in (final, old, tmp):
                directory.check_replaceable(p)
            blob = _pickle(extra)
            directory.begin(tmp, save_id)
    except FAILURES as e:
        error = e
    try:
        save_id = ex("gf.save (prepare)", error, save_id)[0]
        assert sd is not None and rec is not None  # ex raised unless the prepare succeeded on every rank
        if async_:
            group = _side_group(dm)
            handle = SaveHandle(lambda: _publish_unlock(dm, ex, group, sd, rec, tmp, final, blob, save_id))
            _pending[dm] = handle
            return handle
    except BaseException:
        if dm.rank == 0 and save_id is not None:
            directory.release(final, save_id)
        raise
    _publish_unlock(dm, ex, dm.group, sd, rec, tmp, final, blob, save_id)
    return None


def _side_group(dm: TrainingState):
    """A process group of the same ranks for background saves, so that their collectives
    never interleave with the training step's on `dm.group`. One per set of ranks, shared by
    every model on them (join lets one background save run at a time): torch names a group made
    by its ranks alone after those ranks, so a second one would take the first one's name and
    rendezvous (two models saving in the background hung). Over all ranks, every rank is here
    and torch numbers the group instead. Held weakly: torch keeps it until destroy_process_group()."""
    if dm.world_size == 1:
        return None
    ranks = tuple(dist.get_process_group_ranks(dm.group))
    group = _side_groups[ranks]() if ranks in _side_groups else None
    if group is None:
        local = len(ranks) < dist.get_world_size()
        made = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=local)
        if not isinstance(made, dist.ProcessGroup):  # NON_GROUP_MEMBER: this rank is one of `ranks`, so never
            raise CheckpointError(f"torch.distributed.new_group({list(ranks)}) gave this rank no group ({made!r})")
        group = made
        _side_groups[ranks] = hold(group)
    return group


def _publish_unlock(
    dm: TrainingState, ex: Exchange, group, sd: dict, rec: Record, tmp: Path, final: Path, blob, save_id
) -> None:
    try:
        _write_and_publish(dm, ex, group, sd, rec, tmp, final, blob, save_id)
    finally:
        if dm.rank == 0:
            directory.release(final, save_id)


def _write_and_publish(
    dm: TrainingState, ex: Exchange, group, sd: dict, rec: Record, tmp: Path, final: Path, blob, save_id
) -> None:
    error, records = None, None
    try:
        writer = dcp.FileSystemWriter(str(tmp), thread_count=1, sync_files=True)
        try:
            dcp_save(sd, writer, SavePlanner(), group, single=dm.world_size == 1)
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
            _finish(rec, tmp, final, files, blob, save_id)
        except FAILURES as e:
            error = e
        directory.release(final, save_id)  # before the others learn the save ended
    ex("gf.save (publish)", error)


def _finish(rec: Record, tmp: Path, final: Path, files: dict, blob: bytes | None, save_id: str) -> None:
    """Rank 0: verify every rank's files, write extra.pt and graphfuse.json, publish."""
    md = read_dcp_metadata(tmp, files.get(DCP_META))
    verify_files(tmp, files, md)
    if blob is not None:
        atomic_dir.write_file(tmp / EXTRA_FILE, blob)
        files[EXTRA_FILE] = {"bytes": len(blob), "crc32": crc32(tmp / EXTRA_FILE)}
    rec = dataclasses.replace(rec, files=files, save_id=save_id)
    atomic_dir.write_file(tmp / META_FILE, rec.to_json().encode())
    directory.publish(tmp, final)
