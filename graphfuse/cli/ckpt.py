"""The checkpoint commands' printing (`graphfuse ckpt info`, `graphfuse inspect CHECKPOINT` and
`graphfuse ckpt convert`); reading, checking and converting are done in graphfuse.checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rich.table import Table
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from graphfuse.checkpoint import convert, directory, record
from graphfuse.checkpoint.storage import DCP_META, crc32, read_dcp_metadata
from graphfuse.cli.args import CliFailure, UsageError, existing, kind_of, wide_console
from graphfuse.cli.facts import bucket_facts, owners_text


def _nbytes(entry: TensorStorageMetadata) -> int:
    return entry.size.numel() * entry.properties.dtype.itemsize


def file_checks(where: Path, md: Metadata, rec: record.Record | None, verify: bool) -> list[dict]:
    """Every data file: its size on disk against the size its record (or else DCP's index)
    says, and with a record and `verify`, its CRC-32. "damage" is None for a sound file."""
    needed: dict[str, int] = {}  # file -> the end of the last chunk DCP indexed in it
    for info in md.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    recorded = rec.files if rec else {}
    out = []
    for name in sorted(set(needed) | set(recorded)):
        f, want = where / name, recorded.get(name)
        size = f.stat().st_size if f.is_file() else None
        expected = want["bytes"] if want else needed[name]
        damage = None
        if size is None:
            damage = "missing"
        elif verify and want is not None and size != expected:
            damage = f"{size:,} bytes, {expected:,} recorded ({'cut short' if size < expected else 'grown'})"
        elif verify and size < needed.get(name, 0):
            damage = f"{size:,} bytes, but DCP's index reads up to byte {needed[name]:,} (cut short)"
        elif verify and want is not None and crc32(f) != want["crc32"]:
            damage = "CRC-32 differs from the recorded one (altered)"
        out.append(
            {
                "file": name,
                "bytes": size,
                "expected_bytes": expected,
                "crc32_recorded": want is not None,
                "checked": verify,
                "damage": damage,
            }
        )
    return out


def checkpoint_dir(path: str) -> Path:
    """`path`, if it holds a checkpoint (told by its contents, as `graphfuse inspect` tells it);
    else a UsageError (exit 2): a random file or a program is not a damaged checkpoint."""
    where = existing(path, "checkpoint directory")
    kind = kind_of(where)  # a UsageError for what is neither a program nor a checkpoint
    if kind != "checkpoint":
        what = "a program directory" if kind == "program" else "a `graphfuse trace` output"
        raise UsageError(f"{path}: is {what}, not a checkpoint; read it with graphfuse inspect {path}")
    return where


def checkpoint_facts(path: str, verify: bool = True) -> dict:
    """What `ckpt info` says about the checkpoint at `path`, JSON-ready."""
    where = checkpoint_dir(path)
    rec = record.read(where)
    md = read_dcp_metadata(where, rec.files.get(DCP_META) if rec and verify else None)
    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    layout = rec.bucket_layout() if rec else None
    return {
        "kind": "checkpoint",
        "path": str(where),
        "mode": rec.mode if rec else "balanced (plain torch.distributed.checkpoint, no graphfuse.json)",
        "world_size": rec.world_size if rec else None,
        "fingerprint": rec.fingerprint if rec else None,
        "steps": rec.steps if rec else None,
        "optimizer": rec.optimizer if rec else None,
        "layout": None if layout is None else {"align_bytes": layout.align_bytes, "bucket_bytes": layout.bucket_bytes},
        "buckets": bucket_facts(layout) if layout else [],
        "tensors": [
            {
                "key": k,
                "shape": list(v.size),
                "dtype": str(v.properties.dtype).removeprefix("torch."),
                "chunks": len(v.chunks),
                "bytes": _nbytes(v),
            }
            for k, v in tensors.items()
        ],
        "other_entries": len(md.state_dict_metadata) - len(tensors),
        "files": file_checks(where, md, rec, verify),
        "verified": verify,
    }


def _head(f: dict) -> Table:
    head = Table(title=f"checkpoint {f['path']}", show_header=False, title_justify="left")
    head.add_row("mode", f["mode"])
    head.add_row("world size", str(f["world_size"] or "-"))
    head.add_row("layout fingerprint", f["fingerprint"] or "-")
    if f["layout"]:
        head.add_row(
            "buckets",
            f"{len(f['buckets'])} (cap {f['layout']['bucket_bytes'] / 2**20:g} MiB, "
            f"align {f['layout']['align_bytes']} B)",
        )
        head.add_row("steps", str(f["steps"]))
        head.add_row("optimizer", str(f["optimizer"] or "-"))
    head.add_row("tensors", str(len(f["tensors"])))
    head.add_row("tensor bytes", f"{sum(t['bytes'] for t in f['tensors']):,}")
    head.add_row("other entries", str(f["other_entries"]))
    on_disk = sum(x["bytes"] or 0 for x in f["files"])
    head.add_row("data files", f"{len(f['files'])} ({on_disk:,} bytes)")
    return head


def _tables(f: dict) -> list[Table]:
    tensors = Table(title="tensors", title_justify="left")
    for col in ("key", "shape", "dtype", "chunks", "bytes"):
        tensors.add_column(col, justify="right" if col in ("chunks", "bytes") else "left", no_wrap=True)
    for t in f["tensors"]:
        tensors.add_row(t["key"], str(tuple(t["shape"])), t["dtype"], str(t["chunks"]), f"{t['bytes']:,}")
    params = Table(title="parameters in the layout", title_justify="left")
    for col in ("bucket", "parameter", "offset", "elements", "padding", "owners"):
        params.add_column(col, justify="right" if col in ("offset", "elements", "padding") else "left", no_wrap=True)
    for b in f["buckets"]:
        for p in b["params"]:
            params.add_row(
                b["name"], p["fqn"], f"{p['offset']:,}", f"{p['elements']:,}", f"{p['padding']:,}", owners_text(p)
            )
    files = Table(title="files" + ("" if f["verified"] else " (not verified: --no-verify)"), title_justify="left")
    for col in ("file", "bytes", "state"):
        files.add_column(col, justify="right" if col == "bytes" else "left", no_wrap=True)
    for x in f["files"]:
        state = x["damage"] or (
            "ok (size and CRC-32)" if x["crc32_recorded"] and x["checked"] else "ok (size)" if x["checked"] else "-"
        )
        files.add_row(x["file"], "-" if x["bytes"] is None else f"{x['bytes']:,}", state)
    return [tensors] + ([params] if f["buckets"] else []) + [files]


def cli_info(path: str, verify: bool = True, as_json: bool = False) -> int:
    """Print a checkpoint's mode, world size, layout, tensors and files; 1 if a file is damaged."""
    facts = checkpoint_facts(path, verify)
    damaged = [x for x in facts["files"] if x["damage"]]
    if as_json:
        print(json.dumps(facts, indent=1))
    else:
        console = wide_console()
        for table in (_head(facts), *_tables(facts)):
            console.print(table)
    if damaged:
        x = damaged[0]
        more = f" (and {len(damaged) - 1} more files)" if len(damaged) > 1 else ""
        raise CliFailure(
            f"{Path(path) / x['file']}: {x['damage']}{more}; the checkpoint is damaged: restore it from a good copy"
        )
    return 0


def cli_convert(src: str, dst: str, to: str) -> int:
    """Convert an unbalanced checkpoint into a balanced one (every state in its parameter's shape).
    An existing destination is refused before any work; a failed conversion leaves nothing."""
    checkpoint_dir(src)
    if os.path.lexists(dst):
        raise UsageError(f"{dst}: exists; choose a new destination (nothing was written)")
    staging, _ = directory.siblings(Path(dst).absolute())
    staged_before = os.path.lexists(staging)
    try:
        done = convert.convert(src, dst, to, progress=lambda stage: print(f"{stage}...", flush=True))
    except BaseException:
        if not staged_before and staging.is_dir():  # ours: this conversion made it
            shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"wrote balanced checkpoint {done['path']} ({done['slices']} state slices from {done['world_size']} ranks)")
    return 0
