"""bench_multigpu.py step
--models (default gpt2-small 1b; 12x768 and 24x2048, vocab 50304, block 1024), bf16
compute with fp32 master weights and fp32 gradient reduction for every method:
- graphfuse: bf16 model, Strategy(master_dtype=torch.float32), inductor on CUDA;
- ddp_zero: fp32 model (the fp32 weights are the master copy), forward and loss under
  torch.autocast(bf16), DDP (fp32 all-reduce) + ZeroRedundancyOptimizer(AdamW);
- fsdp2: fp32 model, fully_shard per block and root with reshard_after_forward=False and
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), AdamW.
AdamW is fused for the peers on CUDA (foreach=False on CPU). tokens/s = N * batch * block
/ (median over steps of the slowest rank's step time). Peak memory is
torch.cuda.max_memory_allocated per rank (reset before each method; the max over ranks
is reported); on CPU memory is not reported (a process's peak RSS cannot be reset
between methods).
Exposed communication (method, chosen because it needs no second, altered program):
- CUDA: torch.profiler over --profile-steps steps; the union of the NCCL kernels'
  intervals minus its intersection with the union of every other GPU activity (kernels,
  memcpy, memset) is the communication no compute hides; share = that time / the wall
  time of the same profiled steps (not the unprofiled median: the profiler slows a step
  down). The max over ranks is reported. Computed for all three methods.
- CPU: the time the main thread spends blocked in _c10d_functional::wait_tensor / the
  wall time of the profiled steps (graphfuse only: its collectives run on Gloo's threads
  while the main thread computes; the peers' waits are not visible the same way).
"""

from __future__ import annotations

import statistics

import torch
from _bench import timed
from rich.table import Table

import graphfuse as gf
from graphfuse.testing.models import GPTConfig, gpt_loss
from multigpu.common import (
    LR,
    WD,
    batches_for,
    compile_mode,
    device_of,
    exposed_comm_us,
    free_memory,
    fresh_model,
    gpt_config,
    peer_adamw,
    profile,
)


def measure(name: str, step, batches, args, device) -> dict:
    free_memory(device)
    times = timed(step, batches, args.warmup, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    exposed = None
    if device.type == "cuda" or name == "graphfuse":
        wall: list[float] = []
        events = profile(lambda: step(batches[0]), args.profile_steps, device, wall)
        got = exposed_comm_us(events, device)
        if got is not None:
            # Per step, and as a share of the profiled steps' own wall time (the profiler slows
            # a step down, so the unprofiled median is not the denominator).
            exposed = (got[0] / args.profile_steps, got[1] / args.profile_steps, got[1] / 1e6 / wall[0])
    return {
        "times": times,
        "peak_bytes": peak,
        "comm_us": exposed and exposed[0],
        "exposed_us": exposed and exposed[1],
        "exposed_share": exposed and exposed[2],
    }


def run_graphfuse(cfg: GPTConfig, batches, args, device: torch.device) -> dict:
    """bf16 model, fp32 master shards, fp32 reduce-scatter, bf16 all-gather."""
    model = fresh_model(cfg, device, torch.bfloat16)
    strategy = gf.Strategy(bucket_size_mb=args.bucket_mb, compile=compile_mode(args), master_dtype=torch.float32)
    dm = gf.compile(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), gpt_loss, batches[0], strategy
    )
    out = measure("graphfuse", dm, batches, args, device)
    out["buckets"] = len(dm.layout.buckets)
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def run_ddp_zero(cfg: GPTConfig, batches, args, device: torch.device) -> dict:
    """fp32 weights (the master copy), bf16 autocast compute, DDP + ZeroRedundancyOptimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = fresh_model(cfg, device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb)
    kw = {"fused": True} if device.type == "cuda" else {"foreach": False}
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WD, **kw)

    def step(b):
        zero.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = gpt_loss(ddp, b)
        loss.backward()
        zero.step()

    return measure("ddp_zero", step, batches, args, device)


def run_fsdp2(cfg: GPTConfig, batches, args, device: torch.device) -> dict:
    """fp32 sharded weights, bf16 unsharded params for compute, fp32 reduce-scatter."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = fresh_model(cfg, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, reshard_after_forward=False, mp_policy=policy)
    opt = peer_adamw(model.parameters(), device)

    def step(b):
        opt.zero_grad(set_to_none=True)
        gpt_loss(model, b).backward()
        opt.step()

    return measure("fsdp2", step, batches, args, device)


def step_model(args, preset: str) -> dict:
    device = device_of(args)
    cfg = gpt_config(args, preset)
    batches = batches_for(cfg, args.batch or 8, args.warmup + args.steps, device)
    out = {}
    for name, run in (("graphfuse", run_graphfuse), ("ddp_zero", run_ddp_zero), ("fsdp2", run_fsdp2)):
        out[name] = run(cfg, batches, args, device)
        free_memory(device)  # the method's model, optimizer and buckets are gone before the next
    out["params"] = out["graphfuse"]["params"]
    return out


def step(args) -> dict:
    return {preset: step_model(args, preset) for preset in args.models}


METHODS = ("graphfuse", "ddp_zero", "fsdp2")


def report_step(args, results: list[dict], where: str) -> tuple[dict, list]:
    n = args.world_size
    rows = {}
    table = Table(title=f"training step, bf16 + fp32 master, {n} ranks, {args.device} ({where})")
    for col in (
        "model",
        "params",
        "method",
        "median ms",
        "tokens/s",
        "tok/s / graphfuse",
        "peak GiB/rank",
        "mem / graphfuse",
        "comm ms/step",
        "exposed comm share",
    ):
        table.add_column(col, justify="right")
    for preset in args.models:
        cfg = gpt_config(args, preset)
        batch = args.batch or 8
        tokens = n * batch * cfg.block_size
        model_rows = {}
        for m in METHODS:
            per_rank = [r[preset][m] for r in results]
            per_step = [max(r["times"][i] for r in per_rank) for i in range(args.steps)]
            ms = 1e3 * statistics.median(per_step)
            peak = None if per_rank[0]["peak_bytes"] is None else max(r["peak_bytes"] for r in per_rank)
            exposed = [r["exposed_us"] for r in per_rank if r["exposed_us"] is not None]
            share = [r["exposed_share"] for r in per_rank if r["exposed_share"] is not None]
            comm_us = [r["comm_us"] for r in per_rank if r["comm_us"] is not None]
            model_rows[m] = {
                "median_step_ms": ms,
                "tokens_per_s": tokens / (ms / 1e3),
                "peak_bytes_per_rank": peak,
                "comm_ms_per_step": max(comm_us) / 1e3 if comm_us else None,
                "exposed_comm_ms_per_step": max(exposed) / 1e3 if exposed else None,
                "exposed_comm_share": max(share) if share else None,
            }
        g = model_rows["graphfuse"]
        for r in model_rows.values():
            r["tokens_per_s_vs_graphfuse"] = r["tokens_per_s"] / g["tokens_per_s"]
            r["peak_vs_graphfuse"] = (
                None if r["peak_bytes_per_rank"] is None else r["peak_bytes_per_rank"] / g["peak_bytes_per_rank"]
            )
        best_peer = max(model_rows[m]["tokens_per_s"] for m in METHODS[1:])
        rows[preset] = {
            "config": {
                "n_layer": cfg.n_layer,
                "n_embd": cfg.n_embd,
                "n_head": cfg.n_head,
                "vocab_size": cfg.vocab_size,
                "block_size": cfg.block_size,
                "batch_per_rank": batch,
            },
            "params": results[0][preset]["params"],
            "graphfuse_buckets": results[0][preset]["graphfuse"]["buckets"],
            "methods": model_rows,
            "graphfuse_vs_best_peer": g["tokens_per_s"] / best_peer,
            "memory": "torch.cuda.max_memory_allocated, max over ranks"
            if args.device == "cuda"
            else "not measured on CPU",
        }
        for m, r in model_rows.items():

            def fmt(x, spec):
                return "-" if x is None else format(x, spec)

            table.add_row(
                preset,
                f"{rows[preset]['params']:,}",
                m,
                f"{r['median_step_ms']:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s_vs_graphfuse']:.2f}x",
                fmt(r["peak_bytes_per_rank"] and r["peak_bytes_per_rank"] / 2**30, ".2f"),
                fmt(r["peak_vs_graphfuse"], ".2f"),
                fmt(r["comm_ms_per_step"], ".2f"),
                fmt(r["exposed_comm_share"], ".1%"),
            )
    notes = [
        f"{preset}: graphfuse tokens/s / best peer = {r['graphfuse_vs_best_peer']:.2f}x (target >= 1.1x)"
        for preset, r in rows.items()
    ]
    if args.device == "cpu":
        notes.append(
            "peak memory: not measured on CPU; exposed communication on CPU: graphfuse only (blocked wait_tensor time)"
        )
    return rows, [table, *notes]
