"""The storage side of checkpoints: chunked tensors and planners for torch.distributed.checkpoint
(DCP), DCP's index read without running code, and the checks that a directory is whole."""

from __future__ import annotations

import io
import os
import pickle
import re
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, state_dict_loader, state_dict_saver
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from graphfuse.errors import CheckpointError

META_FILE = "graphfuse.json"  # graphfuse's own record: mode, layout, steps, param groups, file checksums
EXTRA_FILE = "extra.pt"  # the caller's `extra`, read back with torch.load(weights_only=True)
DCP_META = ".metadata"  # DCP's own index of keys, chunks and where each chunk is stored
DATA_FILE = re.compile(r"__\d+_\d+\.distcp")  # DCP's data files: __<rank>_<n>.distcp


@dataclass
class Chunks:
    """A tensor of `shape` of which this process holds some rectangular chunks, each a view
    (of a live buffer on save, of a staging buffer on load). DCP writes and fills exactly these."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]  # (offsets, sizes, view)

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)), props, self.size()),
            )
            for off, sz, _ in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), torch.Size(sz)) for off, sz, _ in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, _, view in self.chunks:
            if torch.Size(off) == index.offset:
                return view
        raise ValueError(f"no chunk of {index.fqn} at {tuple(index.offset or ())}")


# A rank's in-memory state dict holds Chunks: torch.save of it must load back with torch.load's
# default weights_only=True in any process that imported graphfuse (plain data, no code).
torch.serialization.add_safe_globals([Chunks])


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, also resolving `Chunks` leaves to their chunk views."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """Loads a flat {checkpoint key: tensor | Chunks | None} dict, copying every chunk into the
    tensor given for it; non-tensor values are read with torch.load(weights_only=True)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


# ---- DCP's index, without running code ---------------------------------------------------
_MD_CLASSES = {
    c.__name__: c
    for c in (
        Metadata,
        TensorStorageMetadata,
        dcp_md.BytesStorageMetadata,
        TensorProperties,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        dcp_md._MEM_FORMAT_ENCODING,
    )
}
_ALLOWED = {("torch.distributed.checkpoint.metadata", name): cls for name, cls in _MD_CLASSES.items()} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # looks a name up in torch's layouts
    ("pathlib", "PosixPath"): PurePosixPath,  # StorageMeta.checkpoint_id: a path, never opened
    ("pathlib", "WindowsPath"): PureWindowsPath,
    ("pathlib", "Path"): PurePosixPath,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata classes, torch.Size, dtypes, layouts and plain containers:
    an index can describe chunks, never name a function to call."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        cls = _ALLOWED.get((module, name))
        if cls is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class; refusing to load it")
        return cls


def _check_index(md: object, f: Path) -> Metadata:
    """The unpickled object's shape: the types DCP's reader relies on, and data file names
    that stay inside the checkpoint directory."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{f}: {what}; the checkpoint is damaged")

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise bad("not a torch.distributed.checkpoint Metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, dcp_md.BytesStorageMetadata)):
            raise bad(f"entry {key!r} is neither a tensor nor a bytes entry")
        if isinstance(entry, TensorStorageMetadata) and not (
            isinstance(entry.size, torch.Size)
            and isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)
            and all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks)
        ):
            raise bad(f"tensor entry {key!r} is malformed")
    if not isinstance(md.storage_data, dict):
        raise bad("its storage index is not a mapping")
    for index, info in md.storage_data.items():
        ok = (
            isinstance(index, MetadataIndex)
            and isinstance(info, dcp_fs._StorageInfo)
            and isinstance(info.relative_path, str)
            and "/" not in info.relative_path
            and "\\" not in info.relative_path
            and info.relative_path not in ("", ".", "..")
            and all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length))
        )
        if not ok:
            raise bad(f"the storage entry of {getattr(index, 'fqn', index)!r} is malformed")
    return md


def read_dcp_metadata(path: Path, record: dict | None = None) -> Metadata:
    """DCP's index, unpickled by an unpickler that admits only DCP's metadata classes, after
    checking it against the size and CRC-32 graphfuse.json recorded (if any): an altered
    index could point at wrong offsets, which no later check would see."""
    f = path / DCP_META
    try:
        data = f.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; {path} is not a torch.distributed.checkpoint directory") from None
    except OSError as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    if record is not None and (len(data) != record["bytes"] or zlib.crc32(data) != record["crc32"]):
        raise CheckpointError(
            f"{f}: contents differ from when it was saved (size or CRC-32 mismatch); the checkpoint is damaged"
        )
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # a truncated, altered or hostile pickle raises anything
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged") from None
    return _check_index(md, f)


class VerifiedReader(FileSystemReader):
    """DCP's file reader that never unpickles `.metadata` itself: it hands DCP the index
    graphfuse already read safely and checked, so the index read is the index used."""

    def __init__(self, path: Path, md: Metadata) -> None:
        super().__init__(str(path))
        self._md = md

    def read_metadata(self, *args, **kwargs) -> Metadata:
        meta = getattr(self._md, "storage_meta", None)
        if meta is None:
            meta = self._md.storage_meta = StorageMeta()
        meta.load_id = self.load_id
        return self._md


def tensor_md(md: Metadata, key: str, path: Path) -> TensorStorageMetadata:
    entry = md.state_dict_metadata.get(key)
    if entry is None:
        raise CheckpointError(f"{path / DCP_META}: key {key!r} is missing from the checkpoint")
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"{path / DCP_META}: key {key!r} holds an object, not a tensor")
    return entry


# ---- calling DCP -------------------------------------------------------------------------
# DCP's core: its public save/load warn on every single-process call, even when told no_dist;
# a torch without these private functions gets the public calls (and their warning)
_save_state_dict = getattr(state_dict_saver, "_save_state_dict", None)
_load_state_dict = getattr(state_dict_loader, "_load_state_dict", None)


def dcp_save(sd: dict, writer, planner, group, single: bool) -> None:
    """dcp.save over `group`, or in this process alone (`single`) without DCP's warning."""
    if single and _save_state_dict is not None:
        _save_state_dict(state_dict=sd, storage_writer=writer, planner=planner, no_dist=True)
    else:
        dcp.save(sd, storage_writer=writer, planner=planner, process_group=group, no_dist=single)


def dcp_load(sd: dict, reader, planner, group, single: bool) -> None:
    """dcp.load into `sd` (plain tensors and Chunks, no Stateful) over `group`, or alone."""
    if single and _load_state_dict is not None:
        _load_state_dict(state_dict=sd, storage_reader=reader, planner=planner, no_dist=True)
    else:
        dcp.load(sd, storage_reader=reader, planner=planner, process_group=group, no_dist=single)


# ---- files ---------------------------------------------------------------------------------
def crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def file_records(directory: Path, rank: int) -> dict[str, dict]:
    """Size and CRC-32 of the data files DCP wrote for `rank` (named __<rank>_<n>.distcp),
    and for rank 0, the coordinator, of DCP's index `.metadata` too."""
    files = sorted(directory.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (directory / DCP_META).exists():
        files.append(directory / DCP_META)
    return {f.name: {"bytes": f.stat().st_size, "crc32": crc32(f)} for f in files}


def verify_files(directory: Path, records: dict[str, dict], md: Metadata | None = None) -> None:
    """Every recorded file is present with its size and CRC-32, and (given DCP's index) every
    file the index points into is recorded: what a publishing rank checks before it publishes."""
    for name, rec in sorted(records.items()):
        f = directory / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing at publication (a file system not shared by all ranks?)")
        size = f.stat().st_size
        if size != rec["bytes"] or crc32(f) != rec["crc32"]:
            raise CheckpointError(f"{f}: {size} bytes or its CRC-32 differ from what its rank wrote")
    if md is not None:
        unrecorded = sorted({i.relative_path for i in md.storage_data.values()} - set(records))
        if unrecorded:
            raise CheckpointError(f"{directory / unrecorded[0]}: indexed by .metadata but written by no rank")


def check_files(path: Path, md: Metadata, records: dict | None, keys: set[str]) -> dict[str, tuple]:
    """Before anything is loaded: every data file holding one of `keys` exists, is long
    enough for every chunk DCP indexed in it, and (graphfuse checkpoints) has its CRC-32.
    Returns each checked file's identity, to see later that none changed during the load."""
    per_file: dict[str, tuple[int, list[str]]] = {}
    for index, info in md.storage_data.items():
        end, names = per_file.get(info.relative_path, (0, []))
        if index.fqn in keys and index.fqn not in names:
            names.append(index.fqn)
        per_file[info.relative_path] = (max(end, info.offset + info.length), names)
    records, seen = records or {}, {}
    for name, (end, names) in sorted(per_file.items()):
        if not names:
            continue
        f = path / name
        what = f"key {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        if not f.is_file():
            raise CheckpointError(f"{f}: missing; it holds {what}")
        seen[name] = identity(f)
        size = os.path.getsize(f)
        if size < end:
            raise CheckpointError(f"{f}: truncated to {size} bytes, {end} expected; it holds {what}")
        rec = records.get(name)
        if rec is not None and (rec["bytes"] != size or rec["crc32"] != crc32(f)):
            raise CheckpointError(f"{f}: contents differ from when it was saved (CRC-32 mismatch); it holds {what}")
    return seen


def identity(f: Path) -> tuple:
    """What changes when a file is replaced or rewritten (inode, size, modification time)."""
    st = f.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns)
