"""Boxes: a flat element range [lo, hi) of a tensor of some shape, cut into the fewest
rectangular chunks (offsets and sizes per dimension), as DCP's chunk plans name them."""

from __future__ import annotations

from typing import NamedTuple


class Box(NamedTuple):
    """Flat elements [start, stop) of a tensor that are its chunk at `offsets` of size `sizes`."""

    start: int
    stop: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Split the flat element range [lo, hi) of a tensor of `shape` into the fewest boxes that
    are each contiguous in the tensor, in order: at most 2·ndim−1 of them."""
    if not shape:
        return [Box(lo, hi, (), ())] if hi > lo else []
    n = len(shape)
    strides = [1] * n
    for k in range(n - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    total = strides[0] * shape[0]
    out, x = [], lo
    while x < hi:
        # The coarsest dimension k whose unit block starts at x and fits: the box ranges over
        # dim k, is full in every later dim, and stays inside one block of dim k-1.
        k = next(k for k in range(n) if x % strides[k] == 0 and x + strides[k] <= hi)
        outer = total if k == 0 else strides[k - 1]
        y = min(hi - (hi - x) % strides[k], (x // outer + 1) * outer)
        index, rem = [], x
        for s in strides:
            index.append(rem // s)
            rem %= s
        offsets = tuple(index[: k + 1]) + (0,) * (n - k - 1)
        sizes = (1,) * k + ((y - x) // strides[k],) + tuple(shape[k + 1 :])
        out.append(Box(x, y, offsets, sizes))
        x = y
    return out
