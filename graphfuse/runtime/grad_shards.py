"""Gradient shards made outside a program, for `ShardedOptimizer.clip_grad_norm_`: each bucket's
gradients packed and averaged across ranks exactly as the program's reduce-scatter pass does
(so the step that reads them is bitwise the step that would have reduced them itself), and the
global norm of shards spread over the ranks, as torch.nn.utils.clip_grad_norm_ computes it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from graphfuse.ir.layout import Bucket, BucketLayout


def _pack(bucket: Bucket, grads: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The bucket's gradients and zero padding in one flat buffer of `dtype` (a copy casts as
    the pass's `_to_copy` does)."""
    device = grads[bucket.slots[0].fqn].device
    flat = torch.zeros(bucket.size, dtype=dtype, device=device)
    for slot in bucket.slots:
        flat[slice(*slot.data_range)].copy_(grads[slot.fqn].reshape(-1))
    return flat


def reduce_scatter_grads(
    layout: BucketLayout,
    grads: dict[str, torch.Tensor],
    buckets: list[Bucket],
    master: torch.dtype | None,
    group: dist.ProcessGroup | None,
    group_name: str,
) -> list[torch.Tensor]:
    """Each of `buckets`' averaged gradient shard (in the master dtype where there is one), by
    the functional reduce-scatter the program itself issues."""
    shards = []
    for bucket in buckets:
        packed = _pack(bucket, grads, master or getattr(torch, bucket.dtype))
        if layout.world_size == 1:
            shards.append(packed)
            continue
        host = packed.device.type != "cpu" and "nccl" not in str(dist.get_backend(group))
        work = packed.cpu() if host else packed  # Gloo reduces host tensors only
        shard = torch.ops._c10d_functional.reduce_scatter_tensor(work, "avg", layout.world_size, group_name)
        shards.append(torch.ops._c10d_functional.wait_tensor(shard).to(packed.device))
    return shards


def clip_shards(
    shards: list[torch.Tensor], max_norm: float, norm_type: float, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The `norm_type`-norm of all ranks' shards together (padding is zero and adds nothing),
    one all-reduce; every shard scaled in place by min(1, max_norm / (norm + 1e-6))."""
    norm_type = float(norm_type)
    device = shards[0].device if shards else torch.device("cpu")
    if norm_type == float("inf"):
        total = torch.stack([s.abs().max().float() for s in shards]).max() if shards else torch.zeros((), device=device)
        op = dist.ReduceOp.MAX
    else:
        total = sum(
            (torch.linalg.vector_norm(s.float(), norm_type) ** norm_type for s in shards),
            torch.zeros((), device=device),
        )
        op = dist.ReduceOp.SUM
    if group is not None and dist.get_world_size(group) > 1:
        host = total.device.type != "cpu" and "nccl" not in str(dist.get_backend(group))
        work = total.cpu() if host else total
        dist.all_reduce(work, op=op, group=group)
        total = work.to(device)
    norm = total if norm_type == float("inf") else total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for s in shards:
        s.mul_(coef)  # as the clip pass's mul: the 0-d fp32 factor, computed in the shard's dtype
    return norm
