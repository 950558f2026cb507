"""What a checkpoint holds of a program, as data: the Pieces (one saved tensor each, with where it
lives in this rank's buckets and shards) and the StatePlan that lists them. The serializer pass
derives the plan (graphfuse/checkpoint/plan.py) and records it on the Program; checkpoints
execute it."""

from __future__ import annotations

from dataclasses import dataclass

MASTER = "master"  # the state name of a bucket's fp32 master shard ("bucket<b>.master"), the one spelling


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of runtime tensor `tensor` (a name in DistModel.tensors) are the
    chunk at `offsets` of size `sizes` of the checkpoint tensor at `path` (of shape `shape`).

    Every piece is contiguous in the checkpoint tensor too, so `view(sizes)` of the flat
    range is the chunk. Weights are replicated, so every rank writes the boxes of its shard
    (`load=False`) but loads whole parameters (`save=False`); a tied alias is written only.
    """

    path: tuple[str, ...]  # nested state-dict path; DCP's flattened key is ".".join(path)
    tensor: str
    start: int
    stop: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str
    load: bool = True
    save: bool = True

    @property
    def key(self) -> str:
        return ".".join(self.path)


@dataclass(frozen=True)
class StatePlan:
    """Both checkpoint modes' pieces for one rank, plus what is not a slice of a buffer."""

    rank: int
    world_size: int
    fingerprint: str
    unbalanced: tuple[Piece, ...]
    balanced: tuple[Piece, ...]
    groups: tuple[tuple[str, ...], ...]  # each param group's FQNs, as optim.param_groups[g]["params"]
    step_groups: tuple[int, ...]  # groups whose parameters carry a "step" state (Adam, AdamW)
    master: bool  # fp32 master shards exist (saved as optim.state.<fqn>.master)

    def pieces(self, mode: str) -> tuple[Piece, ...]:
        return self.unbalanced if mode == "unbalanced" else self.balanced

    def saved(self, mode: str) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces(mode) if p.save)

    def loaded(self, mode: str) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces(mode) if p.load)
