"""The one atomic-directory writer (checkpoints and program files): stage into a directory of its
own, flush every file and directory, move the previous directory aside, rename, then remove the
previous one; and never replace or remove a directory graphfuse did not write."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from graphfuse.errors import GraphfuseError

MARKER = ".graphfuse"  # written first into a staging directory: {"host", "pid", ...}


@dataclass(frozen=True)
class Kind:
    """A kind of directory graphfuse writes: what messages call it, the file names it holds,
    the file a finished one holds, and the error its refusals raise."""

    what: str  # "graphfuse checkpoint", "program directory"
    names: Callable[[str], bool]  # whether a file name is one this kind writes
    complete: str  # the file every finished directory of this kind holds
    error: type[GraphfuseError]

    def ours(self, d: Path) -> bool:
        """Whether directory `d` is one of this kind or its staging directory: only its own
        regular files, and the file that completes one or the staging marker."""
        names = set()
        for e in d.iterdir():
            if e.is_symlink() or not e.is_file() or not (e.name == MARKER or self.names(e.name)):
                return False
            names.add(e.name)
        return self.complete in names or MARKER in names

    def check_replaceable(self, p: Path) -> None:
        """Refuse to write at (or remove) `p` unless nothing is there, an empty directory, or
        one of this kind; the error names what is there and the way out."""
        if not os.path.lexists(p):
            return
        if p.is_symlink() or not p.is_dir():
            kind = "a symbolic link" if p.is_symlink() else "a file"
            raise self.error(f"{p}: is {kind}, not a {self.what}; choose another path or move it away")
        if not any(p.iterdir()) or self.ours(p):
            return
        shown = sorted(e.name for e in p.iterdir())[:3]
        raise self.error(
            f"{p}: exists and is not a {self.what} (it holds {shown}...); graphfuse replaces only what it wrote: "
            "choose another path, or move that directory away"
        )

    def remove(self, p: Path) -> None:
        """Remove a directory of this kind (checked again: a user may have put files in it).
        The file that marks it as ours goes last, so that a removal killed at any point leaves a
        directory still recognised as ours (or an empty one) for the next save to replace."""
        if not os.path.lexists(p):
            return
        self.check_replaceable(p)  # refuses anything but an empty directory or one of ours
        last = (MARKER, self.complete)
        for e in sorted(p.iterdir(), key=lambda e: e.name in last):
            e.unlink()
        p.rmdir()


def fsync(p: Path) -> None:
    """Flush a file or a directory (its entries: creations and renames) to the device."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(f: Path, data: bytes) -> None:
    """Write and flush `f` before any rename can publish it."""
    with open(f, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def make_parents(kind: Kind, p: Path) -> None:
    """Create the missing directories above `p` (as `mkdir -p`, and as DCP's FileSystemWriter
    does), each flushed into its parent, so that a save into a new folder works as a user of
    torch.distributed.checkpoint expects; an ancestor that is not a directory is refused by name."""
    missing = []
    for d in p.parents:
        if d.is_dir():
            break
        if os.path.lexists(d):
            raise kind.error(
                f"{d}: exists and is not a directory, so {p} cannot be written under it; choose another path"
            )
        missing.append(d)
    for d in reversed(missing):
        d.mkdir(exist_ok=True)  # another rank or process may create it at the same moment
        fsync(d.parent)


def begin(kind: Kind, staging: Path, **marker) -> None:
    """A fresh, empty staging directory holding only the marker (host, pid and `marker`), so that
    one left by a crash is recognised as graphfuse's and may be replaced."""
    kind.remove(staging)
    make_parents(kind, staging)
    staging.mkdir()
    write_file(staging / MARKER, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), **marker}).encode())
    fsync(staging)
    fsync(staging.parent)


def publish(kind: Kind, staging: Path, final: Path, previous: Path) -> None:
    """Make the complete staging directory the one at `final`: the previous one is moved to
    `previous` and removed only once the new one is in place and flushed."""
    (staging / MARKER).unlink(missing_ok=True)
    fsync(staging)
    parent = final.parent
    if os.path.lexists(final):
        kind.check_replaceable(final)
        kind.remove(previous)
        final.rename(previous)  # between these two renames, a reader may fall back to `previous`
        fsync(parent)
    staging.rename(final)
    fsync(parent)
    kind.remove(previous)
    fsync(parent)


def write_dir(kind: Kind, final: Path, files: dict[str, bytes], staging: Path, previous: Path) -> None:
    """Write `files` as the directory `final` in one step (staged at `staging`)."""
    for p in (final, previous):
        kind.check_replaceable(p)
    begin(kind, staging)
    for name, data in files.items():
        write_file(staging / name, data)
    publish(kind, staging, final, previous)
