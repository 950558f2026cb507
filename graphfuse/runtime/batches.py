"""A batch's identity: its key (the pytree structure with each leaf's shape, dtype and device),
the key of the batches a program was traced for, and how a new batch differs from it."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from graphfuse.capture.tracing import tensor_meta
from graphfuse.errors import UnsupportedError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, TensorMeta


def batch_key(batch) -> tuple:
    """What a traced program is specialised on: the batch's structure, and each leaf's shape,
    dtype and device (tensors) or value (anything else)."""
    return flatten_batch(batch)[0]


def flatten_batch(batch) -> tuple[tuple, list[torch.Tensor]]:
    """(`batch_key(batch)`, the batch's tensor leaves in order), with one flatten."""
    leaves, spec = pytree.tree_flatten(batch)
    key: list[TensorMeta | tuple[str, str]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(tensor_meta(leaf))
        else:
            key.append(("const", repr(leaf)))
    return (str(spec), tuple(key)), [x for x in leaves if isinstance(x, torch.Tensor)]


def program_batch_key(program: Program) -> tuple:
    """`batch_key` of the batches `program` was traced for (all batch leaves are tensors)."""
    spec = pytree.treespec_loads(program.signature.batch_spec)
    return (str(spec), tuple(program.inputs_meta[n] for n in program.signature.names(sig.BATCH)))


def batch_change(example: tuple, key: tuple) -> str:
    """How the batch with `key` differs from the example batch (keys as `batch_key`)."""
    if example[0] != key[0]:
        return f"the batch's structure changed from {example[0]} to {key[0]}"
    diffs = []
    for i, (a, b) in enumerate(zip(example[1], key[1])):
        if a == b:
            continue
        if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):
            pairs = zip(("shape", "dtype", "device"), (a.shape, a.dtype, a.device), (b.shape, b.dtype, b.device))
            parts = [f"{what} {x} -> {y}" for what, x, y in pairs if x != y]
            diffs.append(f"leaf {i}: " + ", ".join(parts))
        else:
            diffs.append(f"leaf {i}: {a} -> {b}")
    return "; ".join(diffs) or "the example's own, whose program the cache dropped"


def check_batch(key: tuple) -> None:
    """Refuse an empty batch before tracing it (its loss is a mean over nothing)."""
    for i, leaf in enumerate(key[1]):
        if isinstance(leaf, TensorMeta) and leaf.shape and leaf.shape[0] == 0:
            raise UnsupportedError(
                f"batch leaf {i} has shape {leaf.shape}: an empty batch, whose mean loss and gradients are "
                "undefined. Skip empty batches (for example DataLoader(..., drop_last=True)) before calling the "
                "DistModel"
            )
