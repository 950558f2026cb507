"""Training-step time of graphfuse (fused ZeRO-1) against eager DDP + ZeroRedundancyOptimizer
and FSDP2 (fully_shard) on the same GPT and batch, with the collectives each issues per step.

    python tools/bench_step.py --device cpu --world-size 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from graphfuse.passes._graph import count_targets

import graphfuse as gf
from graphfuse.launch import run_ranks
from graphfuse.models import GPT, GPTConfig, gpt_loss, synthetic_tokens


def adamw(params, device: torch.device):
    # On CUDA the peers get torch's fastest AdamW (fused); on CPU the single-tensor one that
    # graphfuse matches bit for bit.
    kw = {"fused": True} if device.type == "cuda" else {"foreach": False}
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kw)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, batches, warmup: int, device) -> list[float]:
    times = []
    for i, b in enumerate(batches):
        dist.barrier()
        sync(device)
        t = time.perf_counter()
        step(b)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def profiled_collectives(step, batch) -> int:
    """c10d collectives one step issues, counted from the profiler's dispatcher events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(batch)
    names = ("allreduce", "broadcast", "allgather", "reduce_scatter", "_reduce_scatter", "all_gather")
    return sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::") and any(n in e.key for n in names))


def eager_step(model, optimizer):
    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        gpt_loss(model, batch).backward()
        optimizer.step()

    return step


def worker(rank: int, world: int, args) -> dict:
    """One rank's timings (graphfuse.launch has set up the process group and the device)."""
    torch.backends.cuda.matmul.allow_tf32 = True  # the same matmul precision for every method
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    n = args.warmup + args.steps
    batches = [tuple(x.to(device) for x in b) for b in synthetic_tokens(cfg, args.batch, n, seed=rank)]
    out = {}

    model = copy.deepcopy(base)
    strategy = gf.Strategy(bucket_size_mb=args.bucket_mb, compile=args.compile)
    dm = gf.compile(model, adamw(model.parameters(), device), gpt_loss, batches[0], strategy)
    counts = count_targets(dm.program)
    out["graphfuse"] = (timed(dm, batches, args.warmup, device),
                        sum(v for k, v in counts.items() if k.startswith("_c10d_functional") and "wait" not in k), "graph")

    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    zero_kw = {"fused": True} if device.type == "cuda" else {"foreach": False}
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.1, **zero_kw)
    step = eager_step(ddp, zero)
    out["ddp_zero"] = (timed(step, batches, args.warmup, device), profiled_collectives(step, batches[0]), "profiler")

    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    step = eager_step(model, adamw(model.parameters(), device))
    out["fsdp2"] = (timed(step, batches, args.warmup, device), profiled_collectives(step, batches[0]), "profiler")
    return out


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()} {os.cpu_count()} cores, {platform.system()}, torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--compile", choices=["eager", "inductor"], default="eager", help="how graphfuse runs its program")
    args = ap.parse_args()

    backend = "nccl" if args.device == "cuda" else "gloo"
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    results = dict(enumerate(run_ranks(worker, args.world_size, args, backend=backend, threads=threads, timeout=1800)))

    rows = {}
    for name in ("graphfuse", "ddp_zero", "fsdp2"):
        # A step takes as long as its slowest rank: median over steps of the max over ranks.
        per_step = [max(r[name][0][i] for r in results.values()) for i in range(args.steps)]
        rows[name] = {"ms": 1e3 * statistics.median(per_step), "collectives": results[0][name][1], "counted_by": results[0][name][2]}
    for name in rows:
        rows[name]["vs_graphfuse"] = rows[name]["ms"] / rows["graphfuse"]["ms"]

    from rich.console import Console
    from rich.table import Table

    where = machine(args.device)
    table = Table(title=f"training step, GPT {args.layers}x{args.embd}, batch {args.batch}x{args.block}, {args.world_size} ranks, {args.device} ({where})")
    for col in ("method", "median step ms", "time / graphfuse", "collectives/step", "counted by"):
        table.add_column(col)
    for name, r in rows.items():
        table.add_row(name, f"{r['ms']:.1f}", f"{r['vs_graphfuse']:.2f}x", str(r["collectives"]), r["counted_by"])
    Console().print(table)
    print(json.dumps({"bench": "step", "device": args.device, "world_size": args.world_size, "machine": where, "config": vars(args), "results": rows}))


if __name__ == "__main__":
    main()
