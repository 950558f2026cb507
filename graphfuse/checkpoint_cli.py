"""The checkpoint commands' printing (`graphfuse ckpt info` and `graphfuse ckpt convert`); the
work is done in graphfuse.checkpoint."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graphfuse.checkpoint import convert, record
from graphfuse.checkpoint.storage import DCP_META, read_dcp_metadata


def _nbytes(entry: TensorStorageMetadata) -> int:
    return entry.size.numel() * entry.properties.dtype.itemsize


def cli_info(path: str) -> int:
    """Print a checkpoint's mode, world size, layout fingerprint, tensors and bytes."""
    where = Path(path)
    rec = record.read(where)
    md = read_dcp_metadata(where, rec.files.get(DCP_META) if rec else None)
    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    files = sorted({info.relative_path for info in md.storage_data.values()})
    on_disk = sum((where / f).stat().st_size for f in files if (where / f).exists())
    console = Console()
    head = Table(title=f"checkpoint {where}", show_header=False)
    head.add_row("mode", rec.mode if rec else "balanced (plain torch.distributed.checkpoint, no graphfuse.json)")
    head.add_row("world size", str(rec.world_size) if rec else "-")
    head.add_row("layout fingerprint", rec.fingerprint if rec else "-")
    if rec:
        layout = rec.layout
        head.add_row(
            "buckets",
            f"{len(layout['buckets'])} (cap {layout['bucket_bytes'] / 2**20:g} MiB, align {layout['align_bytes']} B)",
        )
        head.add_row("steps", str(rec.steps))
        head.add_row("optimizer", str(rec.optimizer or "-"))
    head.add_row("tensors", str(len(tensors)))
    head.add_row("tensor bytes", f"{sum(_nbytes(v) for v in tensors.values()):,}")
    head.add_row("other entries", str(len(md.state_dict_metadata) - len(tensors)))
    head.add_row("data files", f"{len(files)} ({on_disk:,} bytes)")
    console.print(head)
    table = Table(title="tensors")
    for col in ("key", "shape", "dtype", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for key, v in tensors.items():
        dtype = str(v.properties.dtype).removeprefix("torch.")
        table.add_row(key, str(tuple(v.size)), dtype, str(len(v.chunks)), f"{_nbytes(v):,}")
    console.print(table)
    return 0


def cli_convert(src: str, dst: str, to: str) -> int:
    """Convert an unbalanced checkpoint into a balanced one (every state in its parameter's shape)."""
    console = Console()
    done = convert.convert(src, dst, to, progress=lambda stage: console.print(f"{stage}..."))
    console.print(
        f"wrote balanced checkpoint {done['path']} ({done['slices']} state slices from {done['world_size']} ranks)"
    )
    return 0
