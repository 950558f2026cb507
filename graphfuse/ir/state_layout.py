"""The layout of a state shard whose states are not shaped like their parameters (Adafactor's
row and column factors of a matrix): pure arithmetic on a bucket laid out whole, like the
bucket layout itself (graphfuse/ir/layout.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from graphfuse.errors import GraphfuseError
from graphfuse.ir.layout import Bucket, Slot


def state_bucket(bucket: Bucket, shapes: Mapping[str, tuple[int, ...]] | None) -> Bucket:
    """The layout of one state shard of `bucket` ("bucket<b>.<state>"): the bucket's own where
    `shapes` is None (every member's state shaped like the member). Otherwise `shapes` (FQN ->
    shape) names the members that have the state and its shape (Adafactor's row factor of a
    matrix, and none for a vector); each such member lies whole in its owner's shard (a bucket
    laid out whole), and its state lies in the owner's state shard: the owner's members in
    bucket order, every state shard as long as the longest (at least one element). A state never
    crosses ranks (no collective moves it), so it is not aligned."""
    if shapes is None:
        return bucket
    runs: list[list[tuple[str, tuple[int, ...], int]]] = [[] for _ in range(bucket.world_size)]
    for slot in bucket.slots:
        if slot.fqn not in shapes:
            continue
        owner = bucket.owner(slot.fqn)
        if slot.numel and (slot.offset + slot.numel - 1) // bucket.shard_size != owner:
            raise GraphfuseError(
                f"{bucket.name}: {slot.fqn} crosses a shard boundary, but its optimizer state is not shaped like it "
                "and must lie with the whole parameter on one rank; plan the layout with plan_buckets(whole=...)"
            )
        shape = tuple(shapes[slot.fqn])
        runs[owner].append((slot.fqn, shape, math.prod(shape)))
    shard = max(1, *(sum(n for *_, n in run) for run in runs))
    slots = []
    for r, run in enumerate(runs):
        at = r * shard
        for i, (fqn, shape, n) in enumerate(run):
            end = at + n if i + 1 < len(run) else (r + 1) * shard
            slots.append(Slot(fqn, shape, at, n, end - at))
            at += n
    return Bucket(
        bucket.index,
        bucket.dtype,
        bucket.device,
        bucket.group,
        tuple(slots),
        shard * bucket.world_size,
        bucket.world_size,
    )
