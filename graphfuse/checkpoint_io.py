"""The storage side of checkpoints: chunked tensors for torch.distributed.checkpoint (DCP),
its planners, and the checks that a checkpoint directory is whole before anything is loaded."""

from __future__ import annotations

import io
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from graphfuse.errors import CheckpointError

META_FILE = "graphfuse.json"  # graphfuse's own record: mode, layout, steps, param groups, file checksums
EXTRA_FILE = "extra.pt"  # the caller's `extra`, read back with torch.load(weights_only=True)
DCP_META = ".metadata"  # DCP's own index of keys, chunks and where each chunk is stored
FORMAT = 1


@dataclass
class Chunks:
    """A tensor of `shape` of which this process holds some rectangular chunks, each a view
    (of a live buffer on save and on load). DCP writes and fills exactly these chunks."""

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
        raise ValueError(f"no chunk of {index.fqn} at {tuple(index.offset)}")


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


def read_dcp_metadata(path: Path, meta: dict | None = None) -> Metadata:
    """DCP's index, after checking it against the size and CRC-32 graphfuse.json recorded
    (a graphfuse checkpoint): an altered index can unpickle into wrong offsets, which no
    later check would see before the buffers are overwritten."""
    rec = (meta or {}).get("files", {}).get(DCP_META)
    f = path / DCP_META
    if rec is not None and f.exists() and (os.path.getsize(f) != rec["bytes"] or crc32(f) != rec["crc32"]):
        raise CheckpointError(
            f"{f}: contents differ from when it was saved (size or CRC-32 mismatch); the checkpoint is damaged"
        )
    try:
        return FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path / DCP_META}: missing; {path} is not a torch.distributed.checkpoint directory"
        ) from None
    except Exception as e:  # a truncated or altered pickle raises anything
        raise CheckpointError(
            f"{path / DCP_META}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged"
        ) from None


def read_meta(path: Path) -> dict | None:
    """graphfuse.json, or None for a plain DCP checkpoint (written without graphfuse)."""
    f = path / META_FILE
    if not f.exists():
        return None
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable ({e}); the checkpoint is damaged") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: format {meta.get('format')!r} is not {FORMAT}; upgrade graphfuse")
    return meta


def tensor_md(md: Metadata, key: str, path: Path) -> TensorStorageMetadata:
    entry = md.state_dict_metadata.get(key)
    if entry is None:
        raise CheckpointError(f"{path / DCP_META}: key {key!r} is missing from the checkpoint")
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"{path / DCP_META}: key {key!r} holds an object, not a tensor")
    return entry


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


def check_files(path: Path, md: Metadata, meta: dict | None, keys: set[str]) -> None:
    """Before anything is loaded: every data file holding one of `keys` exists, is long
    enough for every chunk DCP indexed in it, and (graphfuse checkpoints) has its CRC-32."""
    per_file: dict[str, tuple[int, list[str]]] = {}
    for index, info in md.storage_data.items():
        end, names = per_file.get(info.relative_path, (0, []))
        if index.fqn in keys and index.fqn not in names:
            names.append(index.fqn)
        per_file[info.relative_path] = (max(end, info.offset + info.length), names)
    records = (meta or {}).get("files", {})
    for name, (end, names) in sorted(per_file.items()):
        if not names:
            continue
        f = path / name
        what = f"key {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        if not f.exists():
            raise CheckpointError(f"{f}: missing; it holds {what}")
        size = os.path.getsize(f)
        if size < end:
            raise CheckpointError(f"{f}: truncated to {size} bytes, {end} expected; it holds {what}")
        rec = records.get(name)
        if rec is not None and (rec["bytes"] != size or rec["crc32"] != crc32(f)):
            raise CheckpointError(f"{f}: contents differ from when it was saved (CRC-32 mismatch); it holds {what}")
