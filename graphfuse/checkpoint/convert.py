"""Offline conversion of an unbalanced checkpoint into a balanced one, in one process: each
`slice@` state lands where the layout's slices say, and the result is written through the
same atomic directory protocol as gf.save."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graphfuse import atomic_dir
from graphfuse.checkpoint import directory, record
from graphfuse.checkpoint.plan import state_layouts
from graphfuse.checkpoint.storage import (
    DCP_META,
    EXTRA_FILE,
    META_FILE,
    LoadPlanner,
    VerifiedReader,
    check_files,
    crc32,
    dcp_load,
    dcp_save,
    file_records,
    read_dcp_metadata,
)
from graphfuse.errors import CheckpointError
from graphfuse.ir.layout import BucketLayout

Progress = Callable[[str], None]  # told each stage's name as it starts


def _states(layout: BucketLayout, rec: record.Record, source: dict, src: Path) -> tuple[dict, int]:
    """{fqn: {state: tensor}} assembled from every rank's slices; and how many slices."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    count = 0
    for bucket in layout.buckets:
        for state, _, dtype, own in state_layouts(bucket, rec.shards, rec.shapes()):
            flats = {s.fqn: torch.zeros(s.numel, dtype=getattr(torch, dtype)) for s in own.slots}
            for r in range(layout.world_size):
                for s in own.slices(r):
                    key = f"slice@{s.fqn}.{state}@rank{r}"
                    t = source.get(key)
                    if not isinstance(t, torch.Tensor) or t.shape != (s.numel,) or t.dtype != flats[s.fqn].dtype:
                        raise CheckpointError(
                            f"{src / DCP_META}: key {key!r} is missing or not {s.numel} elements of {dtype}, "
                            "as the layout in graphfuse.json says; the checkpoint is damaged"
                        )
                    flats[s.fqn][s.param_start : s.param_start + s.numel] = t
                    count += 1
            for slot in own.slots:
                out.setdefault(slot.fqn, {})[state] = flats[slot.fqn].view(slot.shape)
    return out, count


def _balanced(source: dict, states: dict) -> dict:
    out: dict = {"model": {}, "optim": {"state": states, "param_groups": []}}
    for key, value in source.items():
        if key.startswith("model."):
            out["model"][key[6:]] = value
        elif key.startswith("optim.state."):  # steps, and the carried state of frozen parameters
            fqn, name = key[12:].rsplit(".", 1)
            out["optim"]["state"].setdefault(fqn, {})[name] = value
        elif key.startswith("optim.param_groups."):
            g, name = key[len("optim.param_groups.") :].split(".", 1)
            groups = out["optim"]["param_groups"]
            groups += [{} for _ in range(int(g) + 1 - len(groups))]
            groups[int(g)][name] = value
    return out


def convert(src: str, dst: str, to: str, progress: Progress = lambda stage: None) -> dict:
    """Write the unbalanced checkpoint `src` as a balanced one at `dst` (which must not
    exist). Returns {"path", "slices", "world_size"} for the caller to report."""
    if to != "balanced":
        raise CheckpointError(f"cannot convert to {to!r}; only --to balanced is supported")
    src_dir, dst_dir = Path(src).absolute(), Path(dst).absolute()
    rec = record.read(src_dir)
    if rec is None or rec.mode != "unbalanced":
        raise CheckpointError(f"{src_dir}: not an unbalanced graphfuse checkpoint; a balanced one needs no conversion")
    md = read_dcp_metadata(src_dir, rec.files.get(DCP_META))
    check_files(src_dir, md, rec.files, set(md.state_dict_metadata))
    layout = rec.bucket_layout()
    if os.path.lexists(dst_dir):
        raise CheckpointError(f"{dst_dir}: exists; choose a new destination")
    progress("reading")
    source: dict = {
        k: torch.empty(tuple(e.size), dtype=e.properties.dtype) if isinstance(e, TensorStorageMetadata) else None
        for k, e in md.state_dict_metadata.items()
    }
    dcp_load(source, VerifiedReader(src_dir, md), LoadPlanner(), None, single=True)
    progress("assembling states")
    states, count = _states(layout, rec, source, src_dir)
    out = _balanced(source, states)
    progress("writing")
    tmp, _ = directory.siblings(dst_dir)
    save_id = uuid.uuid4().hex
    directory.begin(tmp, save_id)
    dcp_save(out, dcp.FileSystemWriter(str(tmp), thread_count=1, sync_files=True), None, None, single=True)
    files = file_records(tmp, 0)
    if (src_dir / EXTRA_FILE).exists():
        blob = (src_dir / EXTRA_FILE).read_bytes()
        if EXTRA_FILE in rec.files and crc32(src_dir / EXTRA_FILE) != rec.files[EXTRA_FILE]["crc32"]:
            raise CheckpointError(f"{src_dir / EXTRA_FILE}: contents differ from when it was saved (CRC-32 mismatch)")
        atomic_dir.write_file(tmp / EXTRA_FILE, blob)
        files[EXTRA_FILE] = {"bytes": len(blob), "crc32": crc32(tmp / EXTRA_FILE)}
    new = dataclasses.replace(rec, format=record.FORMAT, mode="balanced", files=files, save_id=save_id)
    atomic_dir.write_file(tmp / META_FILE, new.to_json().encode())
    if os.path.lexists(dst_dir):
        raise CheckpointError(f"{dst_dir}: appeared while converting; choose a new destination")
    directory.publish(tmp, dst_dir)
    return {"path": str(dst_dir), "slices": count, "world_size": layout.world_size}
