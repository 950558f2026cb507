"""Bucket planning: pure arithmetic on shapes, dtypes and the gradient order.

No FX and no process group here. Every offset, padding, shard and slice is decided once,
in this file (graphfuse/ir/ownership.py places parameters updated whole), and every other
part of graphfuse reads it from the `BucketLayout`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from graphfuse.errors import ProgramFormatError, UnsupportedError
from graphfuse.ir.boxes import Box, flat_boxes
from graphfuse.ir.ownership import place

FORMAT = 1


def itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


@dataclass(frozen=True)
class ParamInfo:
    """What the planner needs to know of one trainable parameter."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    group: int  # optimizer param group

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Slot:
    """One parameter's place in its bucket: elements [offset, offset + numel) hold it,
    [offset + numel, offset + padded) are zero padding."""

    fqn: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    padded: int

    @property
    def data_range(self) -> tuple[int, int]:
        """The bucket elements that hold the parameter, [start, stop)."""
        return self.offset, self.offset + self.numel

    @property
    def padding(self) -> int:
        """How many zero elements follow the parameter in the bucket."""
        return self.padded - self.numel


@dataclass(frozen=True)
class Slice:
    """The part of one parameter that lies in one rank's shard (the `slice@<fqn>` view):
    shard elements [shard_start, shard_end) hold the parameter's flat elements
    [param_start, param_start + (shard_end - shard_start))."""

    fqn: str
    shard_start: int
    shard_end: int
    param_start: int

    @property
    def numel(self) -> int:
        return self.shard_end - self.shard_start

    @property
    def shard_range(self) -> tuple[int, int]:
        """The elements of the rank's shard (and of every state shard) that hold it, [start, stop)."""
        return self.shard_start, self.shard_end

    @property
    def param_range(self) -> tuple[int, int]:
        """The parameter's flat elements it holds, [start, stop)."""
        return self.param_start, self.param_start + self.numel

    def boxes(self, shape: tuple[int, ...]) -> list[Box]:
        """The chunks of the parameter (of `shape`) it holds, with start and stop counted in
        shard elements: what a balanced checkpoint writes from this slice."""
        shift = self.shard_start - self.param_start
        return [Box(b.start + shift, b.stop + shift, b.offsets, b.sizes) for b in flat_boxes(shape, *self.param_range)]


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: str
    device: str
    group: int
    slots: tuple[Slot, ...]
    size: int  # padded elements, a multiple of world_size * alignment
    world_size: int

    @property
    def name(self) -> str:
        return f"bucket{self.index}"

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(s.fqn for s in self.slots)

    @property
    def shard_size(self) -> int:
        return self.size // self.world_size

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The bucket elements that are rank `rank`'s shard, [start, stop)."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def bucket_range(self, rank: int, s: Slice) -> tuple[int, int]:
        """The bucket elements of `s`, one of `slices(rank)`, [start, stop)."""
        lo, _ = self.shard_range(rank)
        return lo + s.shard_start, lo + s.shard_end

    def slices(self, rank: int) -> tuple[Slice, ...]:
        """The parameters' data (never their padding) inside rank `rank`'s shard, in bucket order."""
        lo, hi = self.shard_range(rank)
        out = []
        for s in self.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < b:
                out.append(Slice(s.fqn, a - lo, b - lo, a - s.offset))
        return tuple(out)

    def owner(self, fqn: str) -> int:
        """The rank whose shard holds the start of `fqn` (all of it, for a parameter updated whole)."""
        return self.slot(fqn).offset // self.shard_size

    def slot(self, fqn: str) -> Slot:
        for s in self.slots:
            if s.fqn == fqn:
                return s
        raise KeyError(fqn)


@dataclass(frozen=True)
class BucketLayout:
    """The global, rank-independent placement of every trainable parameter in flat buckets."""

    world_size: int
    align_bytes: int
    bucket_bytes: int
    buckets: tuple[Bucket, ...]

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def bucket_of(self, fqn: str) -> Bucket:
        for b in self.buckets:
            if fqn in b.fqns:
                return b
        raise KeyError(fqn)

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(f for b in self.buckets for f in b.fqns)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "world_size": self.world_size,
            "align_bytes": self.align_bytes,
            "bucket_bytes": self.bucket_bytes,
            "buckets": [
                {
                    "dtype": b.dtype,
                    "device": b.device,
                    "group": b.group,
                    "size": b.size,
                    "params": [[s.fqn, list(s.shape), s.offset, s.numel, s.padded] for s in b.slots],
                }
                for b in self.buckets
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> BucketLayout:
        if d.get("format") != FORMAT:
            raise ProgramFormatError(
                f"bucket layout format {d.get('format')!r} is not {FORMAT}, the one this graphfuse reads; "
                "load it with the graphfuse version that wrote it, or rebuild the program"
            )
        ws = d["world_size"]
        buckets = tuple(
            Bucket(
                index=i,
                dtype=b["dtype"],
                device=b["device"],
                group=b["group"],
                slots=tuple(Slot(f, tuple(shape), off, n, pad) for f, shape, off, n, pad in b["params"]),
                size=b["size"],
                world_size=ws,
            )
            for i, b in enumerate(d["buckets"])
        )
        return cls(ws, d["align_bytes"], d["bucket_bytes"], buckets)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _block_boundary(members: list[tuple[ParamInfo, int]], p: ParamInfo, blocks: Mapping[str, str]) -> bool:
    """Whether `p` may not join a bucket holding `members` (Strategy.align_buckets_to_blocks):
    it begins another aligned block, or it is outside the aligned blocks and the bucket holds an
    aligned block's parameters, or the other way round."""
    here = blocks.get(p.fqn)
    return here != blocks.get(members[-1][0].fqn) and here not in {blocks.get(m.fqn) for m, _ in members}


def _bucket(
    index: int, key: tuple, members: list[tuple[ParamInfo, int]], world_size: int, align: int, whole: Mapping[str, int]
) -> Bucket:
    """One bucket of `members` (param, aligned length): in the given order, or, for parameters
    updated whole, each inside one rank's shard (graphfuse.ir.ownership.place), those of one
    shape next to each other in it."""
    dtype, device, group, owned = key
    if owned:
        sizes, costs = [n for _, n in members], [whole[p.fqn] for p, _ in members]
        at = place(sizes, costs, world_size, align, kinds=[p.shape for p, _ in members])
        slots = [Slot(p.fqn, p.shape, off, p.numel, pad) for (p, _), off, pad in zip(members, at.offsets, at.padded)]
        return Bucket(index, dtype, device, group, tuple(sorted(slots, key=lambda s: s.offset)), at.size, world_size)
    slots, offset = [], 0
    for p, padded in members:
        slots.append(Slot(p.fqn, p.shape, offset, p.numel, padded))
        offset += padded
    size = _round_up(offset, world_size * align)
    last = slots[-1]
    slots[-1] = Slot(last.fqn, last.shape, last.offset, last.numel, last.padded + size - offset)
    return Bucket(index, dtype, device, group, tuple(slots), size, world_size)


def plan_buckets(
    params: list[ParamInfo],
    world_size: int,
    align_bytes: int,
    bucket_bytes: int,
    *,
    blocks: Mapping[str, str] | None = None,
    whole: Mapping[str, int] | None = None,
) -> BucketLayout:
    """Place `params`, given in the order backward produces their gradients, into buckets.

    Parameters are grouped by (dtype, device, param group), one open bucket per group; a
    parameter starts on an `align_bytes` boundary; a bucket's length is rounded up to a
    multiple of world_size × alignment, and a bucket closes before that length in bytes
    would pass `bucket_bytes` (a parameter larger than that gets a bucket of its own). Buckets are ordered by the
    moment their last gradient is produced, so the first bucket is the first one ready.

    With `blocks` (FQN -> its aligned block, from graphfuse.ir.blocks.aligned_blocks), a bucket
    also closes where an aligned block begins or ends: each such block has buckets of its own
    (more than one where it passes the cap, split at the same places in identical blocks), so
    identical blocks lie at identical bucket offsets and inductor compiles one kernel for all of
    them; at other offsets each block's kernels differ (the offsets are constants in their code)
    and are compiled once per block.

    `whole` (FQN -> the cost of its update) names the parameters whose update reads them whole:
    they get buckets of their own, each parameter lying wholly in one rank's shard
    (graphfuse.ir.ownership.place: owners balance the cost, padding is bounded, a rank's
    same-shape parameters lie next to each other).
    """
    if world_size < 1:
        raise UnsupportedError(
            f"plan_buckets: world_size must be >= 1, got {world_size}; pass the process group's size"
        )

    def align_of(dtype: str) -> int:
        return max(1, align_bytes // itemsize(dtype))

    closed = _fill(params, world_size, align_of, bucket_bytes, blocks or {}, whole or {})
    buckets = [
        _bucket(index, key, members, world_size, align_of(key[0]), whole or {})
        for index, (_, key, members) in enumerate(closed)
    ]
    return BucketLayout(world_size, align_bytes, bucket_bytes, tuple(buckets))


def _fill(
    params: list[ParamInfo],
    world_size: int,
    align_of: Callable[[str], int],
    bucket_bytes: int,
    own: Mapping[str, str],
    whole: Mapping[str, int],
) -> list[tuple[int, tuple, list[tuple[ParamInfo, int]]]]:
    """The closed buckets (ready position, key, [(param, padded length)]) in the order they are
    ready: plan_buckets' grouping, cap and block boundaries."""
    open_: dict[tuple, list[tuple[ParamInfo, int]]] = {}  # key -> [(param, padded)]
    closed: list[tuple[int, tuple, list[tuple[ParamInfo, int]]]] = []
    for pos, p in enumerate(params):
        key = (p.dtype, p.device, p.group, p.fqn in whole)
        padded = _round_up(max(p.numel, 1), align_of(p.dtype))
        members = open_.setdefault(key, [])
        used = sum(n for _, n in members)
        # The cap holds for the bucket's final length, rounded up to world_size × alignment.
        full = _round_up(used + padded, world_size * align_of(p.dtype)) * itemsize(p.dtype) > bucket_bytes
        if members and (full or (own and _block_boundary(members, p, own))):
            closed.append((pos - 1, key, members))
            members = open_[key] = []
        members.append((p, padded))
    last = len(params) - 1
    for key, members in open_.items():
        if members:
            closed.append((last, key, members))
    # A bucket is ready when its last member's gradient is; sort by that position.
    position = {p.fqn: i for i, p in enumerate(params)}
    closed.sort(key=lambda c: max(position[p.fqn] for p, _ in c[2]))
    return closed
