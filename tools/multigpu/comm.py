"""bench_multigpu.py comm
For each --bucket-mb (default 25 64 256): graphfuse compiles the model with that bucket
size; the in-step time of its reduce-scatters and all-gathers is measured with
torch.profiler over --steps steps; then the same collectives
(dist.reduce_scatter_tensor with AVG / dist.all_gather_into_tensor, on buffers of each
bucket's size and dtype, the reduce-scatter in the dtype graphfuse reduces in) are issued
alone, back to back, --iters times each, and timed the same way.
- CUDA: the duration of NCCL kernels (trace events of category "kernel" whose name
  contains "ReduceScatter" / "AllGather").
- CPU: the duration of Gloo's own events on its worker threads ("gloo:all_gather"; Gloo
  runs reduce_scatter_tensor as "gloo:all_reduce"). CPU numbers only prove the code path.
Bytes per collective come from the bucket layout (reduce-scatter: the full input,
bucket.size elements in the reduce dtype; all-gather: the full output, bucket.size in the
parameters' dtype). busbw = bytes * (N-1)/N / time, summed over the step's collectives of
one kind. A collective's time includes waiting for late ranks, so every rank measures its
own total and the rank with the smallest time (the last to arrive waits least) is
reported, both in the step and alone. ratio = busbw in the step / busbw alone (target
>= 0.9).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rich.table import Table

import graphfuse as gf
from graphfuse.testing.models import GPTConfig, gpt_loss
from multigpu.common import (
    LR,
    WD,
    batches_for,
    collective_kind,
    compile_mode,
    device_of,
    free_memory,
    fresh_model,
    gpt_config,
    nbytes,
    profile,
)


def step_collectives(dm: gf.DistModel) -> list[tuple[str, int, torch.dtype]]:
    """(kind, elements, dtype) of every collective graphfuse issues in one step."""
    master = dm.strategy.master_dtype
    out = []
    for b in dm.layout.buckets:
        dtype = getattr(torch, b.dtype)
        out.append(("reduce_scatter", b.size, master if master is not None else dtype))
    for b in dm.layout.buckets:
        out.append(("all_gather", b.size, getattr(torch, b.dtype)))
    return out


def kind_times(events: list[dict], device: torch.device) -> dict[str, tuple[float, int]]:
    """Total µs and count of collective events of each kind."""
    out: dict[str, tuple[float, int]] = {}
    for e in events:
        k = collective_kind(e, device)
        if k:
            t, c = out.get(k, (0.0, 0))
            out[k] = (t + e["dur"], c + 1)
    return out


def isolated_us(kind: str, numel: int, dtype: torch.dtype, iters: int, device: torch.device) -> tuple[float, int]:
    """µs per collective of this kind and size issued alone in a loop, and how many events the
    profiler saw."""
    n = dist.get_world_size()
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // n, dtype=dtype, device=device)
    if kind == "reduce_scatter":

        def issue():
            dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG)
    else:

        def issue():
            dist.all_gather_into_tensor(full, shard)

    for _ in range(3):
        issue()
    events = profile(issue, iters, device)
    total, count = kind_times(events, device).get(kind, (0.0, 0))
    return (total / count if count else float("nan")), count


def comm_bucket(args, cfg: GPTConfig, mb: float, batch, device: torch.device) -> dict:
    master = args.dtype == "bf16"
    model = fresh_model(cfg, device, torch.bfloat16 if master else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    strategy = gf.Strategy(
        bucket_size_mb=mb, compile=compile_mode(args), master_dtype=torch.float32 if master else None
    )
    dm = gf.compile(model, opt, gpt_loss, batch, strategy=strategy)
    for _ in range(args.warmup):
        dm(batch)
    events = profile(lambda: dm(batch), args.steps, device)
    measured = kind_times(events, device)
    colls = step_collectives(dm)
    iso_cache: dict[tuple, tuple[float, int]] = {}
    res = {}
    for kind in ("reduce_scatter", "all_gather"):
        mine = [c for c in colls if c[0] == kind]
        expected = len(mine) * args.steps
        total_us, count = measured.get(kind, (0.0, 0))
        # If the profiler missed some events (seen with Gloo's worker threads), scale the
        # measured total to the expected count; `events_seen` records it.
        in_step_us = (total_us * expected / count / args.steps) if count else float("nan")
        alone_us = 0.0
        for c in mine:
            if c not in iso_cache:
                iso_cache[c] = isolated_us(kind, c[1], c[2], args.iters, device)
            alone_us += iso_cache[c][0]
        res[kind] = {
            "collectives_per_step": len(mine),
            "bytes": [c[1] * torch.empty((), dtype=c[2]).element_size() for c in mine],
            "dtype": str(mine[0][2]).removeprefix("torch."),
            "in_step_us": in_step_us,
            "alone_us": alone_us,
            "events_seen": count,
            "events_expected": expected,
            "alone_events_seen": sum(v[1] for k, v in iso_cache.items() if k[0] == kind),
        }
    res["param_bytes"] = nbytes(model.parameters())
    return res


def comm(args) -> dict:
    device = device_of(args)
    cfg = gpt_config(args, "gpt2-small")
    batch = batches_for(cfg, args.batch or 4, 1, device)[0]
    out = {}
    for mb in args.bucket_mb:
        out[str(mb)] = comm_bucket(args, cfg, mb, batch, device)
        free_memory(device)  # the previous bucket size's model and buckets are gone
    return out


def report_comm(args, results: list[dict], where: str) -> tuple[dict, list]:
    n = args.world_size
    rows = {}
    for mb in map(str, args.bucket_mb):
        rows[mb] = {"param_bytes": results[0][mb]["param_bytes"]}
        for kind in ("reduce_scatter", "all_gather"):
            per_rank = [r[mb][kind] for r in results]
            r0 = per_rank[0]
            moved = sum(r0["bytes"]) * (n - 1) / n
            in_us = min(r["in_step_us"] for r in per_rank)
            alone = min(r["alone_us"] for r in per_rank)
            busbw_in, busbw_alone = moved / in_us / 1e3, moved / alone / 1e3  # GB/s
            rows[mb][kind] = {
                "collectives_per_step": r0["collectives_per_step"],
                "bytes": r0["bytes"],
                "dtype": r0["dtype"],
                "in_step_us": in_us,
                "alone_us": alone,
                "busbw_in_step_GBps": busbw_in,
                "busbw_alone_GBps": busbw_alone,
                "ratio": busbw_in / busbw_alone,
                "events_seen_per_rank": [r["events_seen"] for r in per_rank],
                "events_expected": r0["events_expected"],
            }
    table = Table(title=f"collectives: in graphfuse's step vs alone, {n} ranks, {args.device} ({where})")
    for col in (
        "bucket MB",
        "collective",
        "count",
        "MB each (max)",
        "dtype",
        "µs/step in step",
        "µs alone",
        "busbw in step GB/s",
        "busbw alone GB/s",
        "ratio",
    ):
        table.add_column(col, justify="right")
    for mb, r in rows.items():
        for kind in ("reduce_scatter", "all_gather"):
            k = r[kind]
            table.add_row(
                mb,
                kind,
                str(k["collectives_per_step"]),
                f"{max(k['bytes']) / 2**20:.2f}",
                k["dtype"],
                f"{k['in_step_us']:.1f}",
                f"{k['alone_us']:.1f}",
                f"{k['busbw_in_step_GBps']:.2f}",
                f"{k['busbw_alone_GBps']:.2f}",
                f"{k['ratio']:.2f}",
            )
    return rows, [table]
