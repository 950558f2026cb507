"""The limits a program file must keep, checked before anything is read or allocated; each is
generous for a real training step and refuses a file built to exhaust memory or the stack."""

from __future__ import annotations

MIB = 2**20

# Largest size of each file, checked against the manifest and the file system before reading.
MAX_BYTES = {
    "manifest.json": 1 * MIB,
    "program.json": 64 * MIB,
    "graph.json": 512 * MIB,
    "constants.safetensors": 1024 * MIB,
}
MAX_DEPTH = 32  # nesting of encoded values in graph.json and of the batch tree
MAX_NDIM = 32  # dimensions of one tensor
MAX_NUMEL = 2**48  # elements of one tensor (and the largest dimension, stride or offset)
MAX_NODES = 2_000_000  # nodes of one graph
