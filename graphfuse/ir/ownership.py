"""Whole-parameter ownership inside one bucket: pure arithmetic that gives each parameter whose
update reads it whole (Muon's orthogonalisation) one owning rank, so it never crosses a shard."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple


class Placement(NamedTuple):
    """Where `place` put a bucket's members: per member (in the order given) its owning rank,
    its offset in the bucket and its padded length (the last member of a rank's run is padded
    to the next rank's run, or the bucket's end); and the bucket's size."""

    owners: tuple[int, ...]
    offsets: tuple[int, ...]
    padded: tuple[int, ...]
    size: int


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def padding_bound(sizes: list[int], world_size: int, align: int) -> int:
    """The most zero elements `place` adds beyond the members' own (aligned) lengths: each
    rank's run is at most ceil(total / world) + the largest member, rounded up to `align`."""
    return world_size * (max(sizes) + align)


def assign(sizes: list[int], costs: list[int], world_size: int) -> list[int]:
    """Owners balancing the update's cost: members by cost, largest first, each to the rank of
    least cost so far (ties: the lower rank) among those whose length stays within
    ceil(total / world) + the largest member, which bounds the padding (`padding_bound`). A
    rank of least length always has room, so a member always finds one; every cost counts at
    least 1, so ranks fill in rank order and the ranks that own nothing are the last ones."""
    cap = -(-sum(sizes) // world_size) + max(sizes)
    cost_of, length = [0] * world_size, [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-costs[i], -sizes[i], i)):
        room = [r for r in range(world_size) if length[r] + sizes[i] <= cap]
        r = min(room, key=lambda r: (cost_of[r], r))
        owners[i] = r
        cost_of[r] += max(1, costs[i])
        length[r] += sizes[i]
    return owners


def place(
    sizes: list[int], costs: list[int], world_size: int, align: int, kinds: Sequence[Hashable] | None = None
) -> Placement:
    """Lay out members of `sizes` elements (each a multiple of `align`, at least one) so that
    each lies wholly inside its owner's shard: rank r's members, in the order given, from the
    start of shard r; every shard as long as the longest run, rounded up to `align`. With
    `kinds` (one per member; plan_buckets gives the shape), a run keeps the members of one kind
    next to each other, kinds in the order they first appear in it: same-shape matrices a rank
    owns then form one (k, m, n) view of its shard, which CUDA's batched Newton-Schulz reads and
    writes without copies (passes/sharded_update.py)."""
    if not sizes:
        raise ValueError("place() needs at least one member")
    owners = assign(sizes, costs, world_size)
    runs = [[i for i in range(len(sizes)) if owners[i] == r] for r in range(world_size)]
    if kinds is not None:
        runs = [_by_kind(run, kinds) for run in runs]
    shard = _round_up(max(sum(sizes[i] for i in run) for run in runs), align)
    offsets, padded = [0] * len(sizes), list(sizes)
    starts = []  # (offset, member) in bucket order
    for r, run in enumerate(runs):
        at = r * shard
        for i in run:
            offsets[i] = at
            starts.append((at, i))
            at += sizes[i]
    starts.sort()
    ends = [at for at, _ in starts[1:]] + [world_size * shard]
    for (at, i), end in zip(starts, ends):
        padded[i] = end - at
    return Placement(tuple(owners), tuple(offsets), tuple(padded), world_size * shard)


def _by_kind(run: list[int], kinds: Sequence[Hashable]) -> list[int]:
    """`run` with the members of one kind next to each other, kinds in order of first appearance."""
    first: dict[Hashable, int] = {}
    for at, i in enumerate(run):
        first.setdefault(kinds[i], at)
    return sorted(run, key=lambda i: first[kinds[i]])
