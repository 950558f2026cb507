"""The one atomic-directory protocol of checkpoints (gf.save and `ckpt convert`): write into
`<path>.saving`, fsync, move `<path>` to `<path>.old`, rename, remove `.old`; and never replace
a directory graphfuse did not write."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from graphfuse.checkpoint.storage import DATA_FILE, DCP_META, EXTRA_FILE, META_FILE
from graphfuse.errors import CheckpointError

MARKER = ".graphfuse"  # written first into a staging directory: {"save_id", "host", "pid"}
_OURS = {META_FILE, EXTRA_FILE, DCP_META, DCP_META + ".tmp", MARKER}


def siblings(final: Path) -> tuple[Path, Path]:
    """(`<path>.saving`, `<path>.old`): where a save stages, and where the previous one waits."""
    return final.with_name(final.name + ".saving"), final.with_name(final.name + ".old")


def is_ours(d: Path) -> bool:
    """Whether directory `d` is a graphfuse checkpoint or a save's staging directory: it holds
    only the file names graphfuse writes, and its record or its marker."""
    names = set()
    for e in d.iterdir():
        if e.is_symlink() or not e.is_file():
            return False
        if e.name not in _OURS and not DATA_FILE.fullmatch(e.name):
            return False
        names.add(e.name)
    return META_FILE in names or MARKER in names


def check_replaceable(p: Path) -> None:
    """Refuse to write at (or remove) `p` unless nothing is there, an empty directory, or a
    checkpoint graphfuse wrote; the error names what is there and the way out."""
    if not os.path.lexists(p):
        return
    if p.is_symlink() or not p.is_dir():
        kind = "a symbolic link" if p.is_symlink() else "a file"
        raise CheckpointError(f"{p}: is {kind}, not a graphfuse checkpoint; choose another path or move it away")
    if not any(p.iterdir()) or is_ours(p):
        return
    shown = sorted(e.name for e in p.iterdir())[:3]
    raise CheckpointError(
        f"{p}: exists and is not a graphfuse checkpoint (it holds {shown}...); graphfuse replaces only "
        "checkpoints it wrote: choose another path, or move that directory away"
    )


def remove(p: Path) -> None:
    """Remove a directory graphfuse wrote (checked again: a user may have put files in it)."""
    if os.path.lexists(p):
        check_replaceable(p)
        shutil.rmtree(p)


def fsync(p: Path) -> None:
    """Flush a file or a directory (its entries: creations and renames) to the device."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(tmp: Path, save_id: str) -> None:
    """A fresh, empty staging directory at `tmp` holding only the marker with `save_id`."""
    remove(tmp)
    tmp.mkdir(parents=True)
    (tmp / MARKER).write_text(json.dumps({"save_id": save_id, "host": socket.gethostname(), "pid": os.getpid()}))
    fsync(tmp / MARKER)
    fsync(tmp)
    fsync(tmp.parent)


def write_file(f: Path, data: bytes) -> None:
    """Write and flush `f` (graphfuse.json, extra.pt) before any rename can publish it."""
    with open(f, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def publish(tmp: Path, final: Path) -> None:
    """Make the complete, flushed staging directory `tmp` the checkpoint at `final`; the
    previous one is removed only once the new one is in place (and flushed)."""
    _, old = siblings(final)
    fsync(tmp)
    parent = final.parent
    if os.path.lexists(final):
        check_replaceable(final)
        remove(old)
        final.rename(old)  # between these two renames, `load` falls back to <path>.old
        fsync(parent)
    tmp.rename(final)
    fsync(parent)
    remove(old)
    fsync(parent)


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
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(lock)
            if holder is not None:
                raise _held_error(lock, holder, "save again") from None
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "save_id": save_id}, f)
        return lock
    raise CheckpointError(f"{lock}: could not be taken; another saver races for it")


def release(final: Path, save_id: str) -> None:
    """Remove `<path>.lock` if this save holds it."""
    lock = lock_path(final)
    try:
        if json.loads(lock.read_text()).get("save_id") == save_id:
            lock.unlink()
    except (OSError, ValueError):
        pass


def check_unlocked(final: Path, wait: float = 10.0) -> None:
    """Wait up to `wait` seconds for a live save holding the checkpoint to finish, then
    refuse to load (a save that just ended on another rank may not have released it yet)."""
    deadline = time.monotonic() + wait
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
