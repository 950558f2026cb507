"""The job directory a compile shares with its worker processes: a piece claimed by one process
only, marked done or failed, files written whole, example inputs described by their strides."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def strided_meta(x: torch.Tensor) -> dict:
    """Shape, strides, storage offset, dtype and device of an example input, as JSON."""
    return {
        "shape": list(x.shape),
        "stride": list(x.stride()),
        "offset": x.storage_offset(),
        "dtype": str(x.dtype).removeprefix("torch."),
        "device": str(x.device),
    }


def claim(job: Path, j: int) -> bool:
    """Take piece j for this process; False if another took it first."""
    try:
        os.close(os.open(job / f"claim-{j}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def mark(job: Path, j: int, what: str, text: str = "") -> None:
    """Piece j is `what` ("done", "failed" with the traceback)."""
    write_whole(job / f"{what}-{j}", text.encode())


def write_whole(path: Path, data: bytes) -> None:
    """Write `path` so that readers see it whole or not at all."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
