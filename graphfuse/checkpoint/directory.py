"""Checkpoint directories on graphfuse.atomic_dir (gf.save and `ckpt convert`): staged in
`<path>.saving`, the previous one kept at `<path>.old` until the new one is in place; never
replacing a directory graphfuse did not write. And the lock of a save in progress."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from graphfuse import atomic_dir
from graphfuse.checkpoint.storage import DATA_FILE, DCP_META, EXTRA_FILE, META_FILE
from graphfuse.errors import CheckpointError

_NAMES = {META_FILE, EXTRA_FILE, DCP_META, DCP_META + ".tmp"}
CHECKPOINT = atomic_dir.Kind(
    "graphfuse checkpoint", lambda name: name in _NAMES or bool(DATA_FILE.fullmatch(name)), META_FILE, CheckpointError
)
is_ours, check_replaceable, remove = CHECKPOINT.ours, CHECKPOINT.check_replaceable, CHECKPOINT.remove


def siblings(final: Path) -> tuple[Path, Path]:
    """(`<path>.saving`, `<path>.old`): where a save stages, and where the previous one waits."""
    return final.with_name(final.name + ".saving"), final.with_name(final.name + ".old")


def begin(tmp: Path, save_id: str) -> None:
    """A fresh, empty staging directory at `tmp`, marked with `save_id`."""
    atomic_dir.begin(CHECKPOINT, tmp, save_id=save_id)


def publish(tmp: Path, final: Path) -> None:
    """Make the complete, flushed staging directory `tmp` the checkpoint at `final`."""
    atomic_dir.publish(CHECKPOINT, tmp, final, siblings(final)[1])


# ---- the lock: one saver at a time, and loaders told to wait --------------------------------
def lock_path(final: Path) -> Path:
    return final.with_name(final.name + ".lock")


def _holder(lock: Path) -> dict | None:
    """The lock's holder, or None when there is no lock or its holder died on this host."""
    try:
        holder = json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"host": "?", "pid": "?"}  # being written, or damaged: treat as held
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        if not _alive(holder["pid"]):
            return None  # a saver killed on this host: its lock is stale
    return holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process its parent has not reaped yet is a zombie: dead all the same
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _held_error(lock: Path, holder: dict, doing: str) -> CheckpointError:
    return CheckpointError(
        f"{lock}: a save by host {holder.get('host')} pid {holder.get('pid')} holds this checkpoint; {doing} "
        "after it finishes (if that process is gone, remove the lock file)"
    )


def acquire(final: Path, save_id: str) -> Path:
    """Take `<path>.lock` for a save (created exclusively, holding host and pid), taking over
    a stale one left by a saver that died on this host; refused while another save holds it."""
    lock = lock_path(final)
    atomic_dir.make_parents(CHECKPOINT, lock)  # the lock is the first file a save writes
    # The lock appears whole or not at all: written under a name of this process, then linked
    # into place (a link fails if the lock exists). Created empty and then written, a saver
    # killed in between would leave an empty lock that no later save could tell from a held one.
    mine = lock.with_name(f".{lock.name}.{os.getpid()}")
    mine.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "save_id": save_id}))
    try:
        for _ in range(2):
            try:
                os.link(mine, lock)
            except FileExistsError:
                holder = _holder(lock)
                if holder is not None:
                    raise _held_error(lock, holder, "save again") from None
                lock.unlink(missing_ok=True)
                continue
            return lock
    finally:
        mine.unlink(missing_ok=True)
    raise CheckpointError(f"{lock}: could not be taken; another saver races for it")


def release(final: Path, save_id: str) -> None:
    """Remove `<path>.lock` if this save holds it."""
    lock = lock_path(final)
    try:
        if json.loads(lock.read_text()).get("save_id") == save_id:
            lock.unlink()
    except (OSError, ValueError):
        pass


LOCK_WAIT_S = 10.0  # how long a load waits for a live save's lock (read at each call; a test may lower it)


def check_unlocked(final: Path, wait: float | None = None) -> None:
    """Wait up to `wait` seconds (LOCK_WAIT_S) for a live save holding the checkpoint to finish,
    then refuse to load (a save that just ended on another rank may not have released it yet)."""
    deadline = time.monotonic() + (LOCK_WAIT_S if wait is None else wait)
    while (holder := _holder(lock_path(final))) is not None:
        if time.monotonic() > deadline:
            raise _held_error(lock_path(final), holder, "load it")
        time.sleep(0.05)


def resolve(path: Path) -> Path:
    """The directory to load: `path`, or `<path>.old` when a save was interrupted between
    its two renames."""
    _, old = siblings(path)
    if not path.exists() and old.is_dir():
        return old
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint directory here")
    return path
