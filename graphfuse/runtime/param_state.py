"""Deferred parameter all-gather at run time (Strategy.overlap_param_gather): whether the model's
views of other ranks' shards are a step old, the refusal to run the model on them, and `sync`'s gather."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from graphfuse.errors import GraphfuseError, UnsupportedError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program
from graphfuse.ranks import all_gather_flat


class ParamState:
    """`stale`: after a deferred step, each bucket holds this rank's updated shard and the other
    ranks' shards of the step before. The model's forward is refused while stale (outside
    graphfuse's own tracing), so stale weights are never used silently."""

    def __init__(self) -> None:
        self.deferred = False
        self.stale = False  # bind_tensors fills whole buckets
        self._tracing = 0

    def start(self, program: Program, model: torch.nn.Module) -> None:
        self.deferred = any(s.role == sig.NEW_BUCKET_SHARD for s in program.signature.outputs)
        self.stale = False
        if self.deferred:
            model.register_forward_pre_hook(self._refuse_stale_forward)

    def _refuse_stale_forward(self, module: torch.nn.Module, args) -> None:
        if self.stale and not self._tracing:
            raise UnsupportedError(
                "the model's parameters are one step old on this rank (Strategy.overlap_param_gather defers the "
                "all-gather to the next step): call dm.sync() on every rank before running the model outside dm(batch)"
            )

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Capture runs the model's forward on fake tensors, whose values do not matter."""
        self._tracing += 1
        try:
            yield
        finally:
            self._tracing -= 1


def gather_shards(
    program: Program, tensors: dict[str, torch.Tensor], group: dist.ProcessGroup | None, host: bool
) -> None:
    """All-gather every rank's shard of each bucket into the whole bucket, in place (through a
    host copy with `host`: Gloo over CUDA tensors)."""
    with torch.no_grad():
        for bucket in program.bucket_layout.buckets:
            flat = tensors[bucket.name]
            work = flat.cpu() if host else flat
            shard = work[slice(*bucket.shard_range(program.rank))].clone()
            all_gather_flat(work, shard, group)
            if host:
                flat.copy_(work)


def destination(program: Program, tensors: dict[str, torch.Tensor], spec: sig.OutputSpec) -> torch.Tensor:
    """Where output `spec` is written: its target input, or for a bucket's shard (deferred
    all-gather) this rank's range of the bucket."""
    target = spec.target
    if target is None:
        raise GraphfuseError(f"output {spec.name!r} ({spec.role}) replaces no input, so it has no destination")
    if spec.role == sig.NEW_BUCKET_SHARD:
        bucket = next(b for b in program.bucket_layout.buckets if b.name == target)
        return tensors[target][slice(*bucket.shard_range(program.rank))]
    return tensors[target]
