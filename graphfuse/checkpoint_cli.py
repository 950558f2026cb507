"""Offline checkpoint tools, one process and no process group: `graphfuse ckpt info` and
`graphfuse ckpt convert SRC DST --to balanced`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graphfuse.checkpoint_io import (
    EXTRA_FILE,
    META_FILE,
    LoadPlanner,
    check_files,
    file_records,
    read_dcp_metadata,
    read_meta,
)
from graphfuse.errors import CheckpointError
from graphfuse.layout import BucketLayout
from graphfuse.passes.serializer import derive_plan


def _nbytes(entry: TensorStorageMetadata) -> int:
    return entry.size.numel() * entry.properties.dtype.itemsize


def cli_info(path: str) -> int:
    """Print a checkpoint's mode, world size, layout fingerprint, tensors and bytes."""
    where = Path(path)
    meta = read_meta(where)
    md = read_dcp_metadata(where, meta)
    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    files = sorted({info.relative_path for info in md.storage_data.values()})
    on_disk = sum((where / f).stat().st_size for f in files if (where / f).exists())
    console = Console()
    head = Table(title=f"checkpoint {where}", show_header=False)
    head.add_row("mode", meta["mode"] if meta else "balanced (plain torch.distributed.checkpoint, no graphfuse.json)")
    head.add_row("world size", str(meta["world_size"]) if meta else "-")
    head.add_row("layout fingerprint", meta["fingerprint"] if meta else "-")
    if meta:
        layout = meta["layout"]
        head.add_row(
            "buckets",
            f"{len(layout['buckets'])} (cap {layout['bucket_bytes'] / 2**20:g} MiB, align {layout['align_bytes']} B)",
        )
        head.add_row("steps", str(meta["steps"]))
    head.add_row("tensors", str(len(tensors)))
    head.add_row("tensor bytes", f"{sum(_nbytes(v) for v in tensors.values()):,}")
    head.add_row("other entries", str(len(md.state_dict_metadata) - len(tensors)))
    head.add_row("data files", f"{len(files)} ({on_disk:,} bytes)")
    console.print(head)
    table = Table(title="tensors")
    for col in ("key", "shape", "dtype", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for key, v in tensors.items():
        table.add_row(
            key,
            str(tuple(v.size)),
            str(v.properties.dtype).removeprefix("torch."),
            str(len(v.chunks)),
            f"{_nbytes(v):,}",
        )
    console.print(table)
    return 0


def cli_convert(src: str, dst: str, to: str) -> int:
    """Convert an unbalanced checkpoint into a balanced one (every state in its parameter's
    shape), reading exactly what each saving rank's serializer plan wrote."""
    if to != "balanced":
        raise CheckpointError(f"cannot convert to {to!r}; only --to balanced is supported")
    src_dir, dst_dir = Path(src), Path(dst).absolute()
    meta = read_meta(src_dir)
    md = read_dcp_metadata(src_dir, meta)
    if meta is None or meta["mode"] != "unbalanced":
        raise CheckpointError(f"{src_dir}: not an unbalanced graphfuse checkpoint; a balanced one needs no conversion")
    check_files(src_dir, md, meta, set(md.state_dict_metadata))
    layout = BucketLayout.from_json(meta["layout"])
    groups = tuple(tuple(g) for g in meta["groups"])
    plans = [
        derive_plan(layout, r, meta["shards"], meta["aliases"], groups, tuple(meta["step_groups"]))
        for r in range(layout.world_size)
    ]

    source: dict = {}
    for key, entry in md.state_dict_metadata.items():
        source[key] = (
            torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            if isinstance(entry, TensorStorageMetadata)
            else None
        )
    out: dict = {"model": {}, "optim": {"state": {}, "param_groups": []}}
    with Progress(transient=False) as progress:
        task = progress.add_task("reading", total=1)
        dcp.load(source, storage_reader=dcp.FileSystemReader(str(src_dir)), planner=LoadPlanner(), no_dist=True)
        progress.update(task, completed=1)
        pieces = [(plan, p) for plan in plans for p in plan.saved("balanced") if p.path[0] == "optim"]
        task = progress.add_task("assembling states", total=len(pieces))
        for plan, p in pieces:
            q = next(
                q for q in plan.saved("unbalanced") if q.tensor == p.tensor and q.start <= p.start and p.stop <= q.stop
            )
            state = out["optim"]["state"].setdefault(p.path[2], {})
            full = state.get(p.path[3])
            if full is None:
                full = state[p.path[3]] = torch.zeros(p.shape, dtype=getattr(torch, p.dtype))
            box = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))
            full[box].copy_(source[q.key][p.start - q.start : p.stop - q.start].view(p.sizes))
            progress.advance(task)
        for key, value in source.items():
            if key.startswith("model."):
                out["model"][key[6:]] = value
            elif key.startswith("optim.state.") and key.endswith(".step"):
                out["optim"]["state"].setdefault(key[12:-5], {})["step"] = value
            elif key.startswith("optim.param_groups."):
                g, name = key[len("optim.param_groups.") :].split(".", 1)
                while len(out["optim"]["param_groups"]) <= int(g):
                    out["optim"]["param_groups"].append({})
                out["optim"]["param_groups"][int(g)][name] = value
        task = progress.add_task("writing", total=1)
        tmp = dst_dir.with_name(dst_dir.name + ".saving")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        dcp.save(out, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=1), no_dist=True)
        if (src_dir / EXTRA_FILE).exists():
            shutil.copyfile(src_dir / EXTRA_FILE, tmp / EXTRA_FILE)
        (tmp / META_FILE).write_text(json.dumps({**meta, "mode": "balanced", "files": file_records(tmp, 0)}, indent=1))
        if dst_dir.exists():
            raise CheckpointError(f"{dst_dir}: exists; choose a new destination")
        tmp.rename(dst_dir)
        progress.update(task, completed=1)
    Console().print(f"wrote balanced checkpoint {dst_dir} ({len(pieces)} state chunks from {layout.world_size} ranks)")
    return 0
