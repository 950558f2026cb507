"""The files of a program directory: the manifest, reading listed files safely (regular files
inside the directory only, size caps before reading, SHA-256 checked), and the atomic write
(graphfuse.atomic_dir)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path

from graphfuse import atomic_dir
from graphfuse.errors import GraphfuseError, ProgramFormatError

from .limits import MAX_BYTES
from .values import short

FORMAT_NAME = "graphfuse-program"
FORMAT_VERSION = 2
MANIFEST, PROGRAM, GRAPH, CONSTANTS = "manifest.json", "program.json", "graph.json", "constants.safetensors"
FILES = (PROGRAM, GRAPH, CONSTANTS)  # what a manifest may list; manifest.json lists the others
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}


def open_dir(path: Path) -> int:
    """A file descriptor of the program directory; every file is opened relative to it."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ProgramFormatError(
            f"{path}: not a program directory ({e.strerror}); save one with gf.save_program"
        ) from None


def read_file(dir_fd: int, path: Path, name: str, size: int | None = None) -> bytes:
    """The bytes of `name` in the directory: refused unless it is a regular file in it (not a
    symbolic link, FIFO or device), and its size is within MAX_BYTES and `size` if given."""
    where = path / name
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ProgramFormatError(
                f"{where}: is a symbolic link; a program directory holds only regular files"
            ) from None
        raise ProgramFormatError(f"{where}: cannot read the file ({e.strerror}); the program is incomplete") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise ProgramFormatError(f"{where}: is {kind}; a program directory holds only regular files")
        if st.st_size > MAX_BYTES[name]:
            raise ProgramFormatError(
                f"{where}: {st.st_size:,} bytes, more than the limit {MAX_BYTES[name]:,} for this file"
            )
        if size is not None and st.st_size != size:
            how = "truncated" if st.st_size < size else "altered"
            raise ProgramFormatError(f"{where}: {how}: {st.st_size} bytes, the manifest says {size}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(st.st_size + 1)  # one more: a file that grows while read is refused
    except OSError as e:
        raise ProgramFormatError(f"{where}: cannot read the file ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) != st.st_size:
        raise ProgramFormatError(f"{where}: changed while it was read")
    return data


def parse_json(path: Path, data: bytes):
    """Strict JSON (no NaN or Infinity) of a file; any defect names the file."""

    def no_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        return json.loads(data.decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProgramFormatError(f"{path}: not a JSON file of this format ({type(e).__name__}: {short(e)})") from None


def read_manifest(dir_fd: int, path: Path) -> dict:
    """The checked manifest: format, a version this graphfuse reads, and a valid entry
    ({bytes within the file's limit, sha256}) for program.json, graph.json and optionally constants."""
    where = path / MANIFEST
    try:
        os.stat(MANIFEST, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise ProgramFormatError(
            f"{path}: not a program directory (no {MANIFEST}); save one with gf.save_program"
        ) from None
    except OSError:
        pass  # read_file names the cause
    manifest = parse_json(where, read_file(dir_fd, path, MANIFEST))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ProgramFormatError(f"{where}: not a graphfuse program manifest (format must be {FORMAT_NAME!r})")
    version = manifest.get("version")
    if type(version) is not int or version < 1:
        raise ProgramFormatError(f"{where}: invalid format version {short(version)}")
    if version > FORMAT_VERSION:
        raise ProgramFormatError(
            f"{where}: format version {version} is newer than this graphfuse reads ({FORMAT_VERSION}); "
            f"the program was written by graphfuse {short(manifest.get('graphfuse_version'))}: upgrade graphfuse"
        )
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not set(listed) <= set(FILES) or not {PROGRAM, GRAPH} <= set(listed):
        raise ProgramFormatError(
            f"{where}: 'files' must list {PROGRAM}, {GRAPH} and optionally {CONSTANTS}, nothing else"
        )
    for name, entry in listed.items():
        if not (
            isinstance(entry, dict)
            and set(entry) == {"bytes", "sha256"}
            and type(entry["bytes"]) is int
            and isinstance(entry["sha256"], str)
            and _HEX64.match(entry["sha256"])
        ):
            raise ProgramFormatError(f"{where}: the entry of {name} must be {{bytes, sha256}}")
        if not 0 <= entry["bytes"] <= MAX_BYTES[name]:
            raise ProgramFormatError(
                f"{where}: {name} is listed at {entry['bytes']:,} bytes; the limit is {MAX_BYTES[name]:,}"
            )
    return manifest


def read_listed(dir_fd: int, path: Path, manifest: dict) -> dict[str, bytes]:
    """Every file the manifest lists, of the listed size and SHA-256."""
    out = {}
    for name, entry in manifest["files"].items():
        data = read_file(dir_fd, path, name, entry["bytes"])
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ProgramFormatError(f"{path / name}: altered: its sha256 is not the one in the manifest")
        out[name] = data
    return out


def manifest_bytes(files: dict[str, bytes], torch_version: str, graphfuse_version: str) -> bytes:
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "torch_version": torch_version,
        "graphfuse_version": graphfuse_version,
        "files": {
            name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()
        },
    }
    return json_bytes(manifest)


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, allow_nan=False, ensure_ascii=False) + "\n").encode()


PROGRAM_DIR = atomic_dir.Kind("program directory", lambda name: name in (MANIFEST, *FILES), MANIFEST, GraphfuseError)


def write_dir(path: Path, files: dict[str, bytes]) -> None:
    """Write `files` as the directory `path`, replacing it atomically if it holds a program
    (or is empty); anything else at `path` is refused and left alone. Staged per process, so
    that ranks writing the same program (same bytes) do not remove each other's staging."""
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    previous = path.with_name(f".{path.name}.old-{os.getpid()}")
    atomic_dir.write_dir(PROGRAM_DIR, path, files, staging, previous)
