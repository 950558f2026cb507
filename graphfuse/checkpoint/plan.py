"""The checkpoint plan: which flat range of which runtime tensor is saved and loaded under
which checkpoint key, as which chunk of which tensor, in both modes. Derived once per rank
from the layout and the program's signature; everything else executes it."""

from __future__ import annotations

from collections.abc import Mapping

from graphfuse.ir import signature as sig
from graphfuse.ir.layout import Bucket, BucketLayout, flat_boxes  # flat_boxes: re-exported
from graphfuse.ir.state_layout import state_bucket
from graphfuse.ir.state_plan import MASTER, Piece, StatePlan


def _states(shards: dict[str, str], bucket) -> list[tuple[str, str, str]]:
    """(state, runtime tensor, dtype) of every state shard of `bucket`, master included."""
    return [(n.split(".", 1)[1], n, d) for n, d in shards.items() if n.split(".", 1)[0] == bucket.name]


Shapes = Mapping[str, Mapping[str, tuple[int, ...]]]  # Program.state_shapes: shard -> {FQN: its state's shape}


def state_layouts(bucket: Bucket, shards: dict[str, str], shapes: Shapes) -> list[tuple[str, str, str, Bucket]]:
    """(state, runtime tensor, dtype, the layout of its shard) of every state shard of `bucket`:
    the bucket's own layout, or its own where the state is not shaped like each member."""
    return [(state, n, d, state_bucket(bucket, shapes.get(n))) for state, n, d in _states(shards, bucket)]


def _param_pieces(
    layout: BucketLayout, rank: int, shards: dict[str, str], aliases: dict[str, str], shapes: Shapes
) -> list[Piece]:
    """Each parameter's data in this rank's shards, as boxes of the parameter's own shape:
    the weights (`model.<fqn>`, from the bucket) and every state (`optim.state.<fqn>.<s>`), a
    state not shaped like its parameter in its own shape."""
    pieces = []
    tied: dict[str, list[str]] = {}
    for alias, canonical in aliases.items():
        tied.setdefault(canonical, []).append(alias)
    for bucket in layout.buckets:
        lo, _ = bucket.shard_range(rank)
        for slot in bucket.slots:
            whole = (0,) * len(slot.shape)
            pieces.append(
                Piece(
                    ("model", slot.fqn),
                    bucket.name,
                    slot.offset,
                    slot.offset + slot.numel,
                    slot.shape,
                    whole,
                    slot.shape,
                    bucket.dtype,
                    save=False,
                )
            )
        for s in bucket.slices(rank):
            slot = bucket.slot(s.fqn)
            for x, y, offsets, sizes in flat_boxes(slot.shape, s.param_start, s.param_start + s.numel):
                at, n = s.shard_start + x - s.param_start, y - x
                for fqn in (s.fqn, *tied.get(s.fqn, ())):
                    pieces.append(
                        Piece(
                            ("model", fqn),
                            bucket.name,
                            lo + at,
                            lo + at + n,
                            slot.shape,
                            offsets,
                            sizes,
                            bucket.dtype,
                            load=False,
                        )
                    )
        for state, tensor, dtype, own in state_layouts(bucket, shards, shapes):
            for s in own.slices(rank):
                shape = own.slot(s.fqn).shape
                for x, y, offsets, sizes in flat_boxes(shape, s.param_start, s.param_start + s.numel):
                    at = s.shard_start + x - s.param_start
                    path = ("optim", "state", s.fqn, state)
                    pieces.append(Piece(path, tensor, at, at + y - x, shape, offsets, sizes, dtype))
    return pieces


def _slice_pieces(layout: BucketLayout, rank: int, shards: dict[str, str], shapes: Shapes) -> list[Piece]:
    """Unbalanced: each state's `slice@<fqn>.<state>@rank<r>`, whole, as this rank holds it."""
    pieces = []
    for bucket in layout.buckets:
        for state, tensor, dtype, own in state_layouts(bucket, shards, shapes):
            for s in own.slices(rank):
                key = f"slice@{s.fqn}.{state}@rank{rank}"
                pieces.append(Piece((key,), tensor, s.shard_start, s.shard_end, (s.numel,), (0,), (s.numel,), dtype))
    return pieces


def derive_plan(
    layout: BucketLayout,
    rank: int,
    shards: dict[str, str],
    aliases: dict[str, str],
    groups: tuple[tuple[str, ...], ...],
    step_groups: tuple[int, ...],
    state_shapes: Shapes | None = None,
) -> StatePlan:
    """The plan of rank `rank`. `shards` maps every state shard ("bucket<b>.<state>") to its
    dtype; `aliases` maps tied FQNs to their canonical FQN; `state_shapes` lays out the state
    shards whose states are not shaped like their parameters (Program.state_shapes). The offline
    converter calls this with what a checkpoint records, so it reads exactly what the saving ranks wrote."""
    shapes = state_shapes or {}
    balanced = _param_pieces(layout, rank, shards, aliases, shapes)
    model = [p for p in balanced if p.path[0] == "model"]
    return StatePlan(
        rank=rank,
        world_size=layout.world_size,
        fingerprint=layout.fingerprint,
        unbalanced=tuple(model + _slice_pieces(layout, rank, shards, shapes)),
        balanced=tuple(balanced),
        groups=groups,
        step_groups=step_groups,
        master=any(n.endswith(f".{MASTER}") for n in shards),
    )


def plan_of(program) -> StatePlan:
    """The plan of `program`'s rank, from its layout, its state shards and its optimizer."""
    shards = {n: program.inputs_meta[n].dtype for n in program.signature.names(sig.SHARD)}
    groups = tuple(g.params for g in program.optim.groups)
    step_groups = tuple(g for g, spec in enumerate(program.optim.groups) if spec.has_step)
    return derive_plan(
        program.layout, program.rank, shards, dict(program.signature.aliases), groups, step_groups, program.state_shapes
    )
