"""Training-step time of graphfuse (fused ZeRO-1; with `graphfuse_deferred`, the parameter
all-gather deferred to the next step; with `graphfuse_cudagraphs`, the compiled step replayed from
a CUDA graph; with `graphfuse_aligned` / `graphfuse_unaligned`, Strategy.align_buckets_to_blocks
True / False instead of its default; with `graphfuse_workers`, the step compiled in
--compile-workers + 1 pieces by as many processes, Strategy.compile_workers) against eager DDP +
ZeroRedundancyOptimizer, FSDP2
(fully_shard) and, at one rank, torch.compile + fused AdamW (`torch_compile_cudagraphs`: mode="reduce-overhead", its
CUDA graphs
around forward and backward), on the same GPT and batch: median step time, peak CUDA memory, setup
+ first step seconds (for the CUDA-graph methods, + the second step, which captures), and the
collectives each issues per step. The methods share one process and one inductor cache, so a
later method's setup may reuse kernels an earlier one compiled: compare cold starts with
tools/bench_startup.py.

    python tools/bench_step.py --device cpu --world-size 2
    python tools/bench_step.py --device cuda --world-size 1 --compile inductor --methods graphfuse torch_compile
    python tools/bench_step.py --device cuda --world-size 1 --compile inductor --layers 2 --embd 128 --heads 4 \
        --block 128 --batch 4 --vocab 50304 --steps 50 --methods graphfuse graphfuse_cudagraphs torch_compile
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from _bench import machine, print_report, sync, timed, torch_step  # tools/_bench.py: what the benches share

import graphfuse as gf
from graphfuse.passes import count_targets
from graphfuse.testing.launch import run_ranks
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

METHODS = [
    "graphfuse",
    "graphfuse_workers",
    "graphfuse_deferred",
    "graphfuse_cudagraphs",
    "graphfuse_aligned",
    "graphfuse_unaligned",
    "ddp_zero",
    "fsdp2",
    "torch_compile",
    "torch_compile_cudagraphs",
]
CAPTURED_AT_SECOND_STEP = ("graphfuse_cudagraphs", "torch_compile_cudagraphs")


def adamw(params, device: torch.device):
    # On CUDA the peers get torch's fastest AdamW (fused); on CPU the single-tensor one that
    # graphfuse matches bit for bit.
    kw = {"fused": True} if device.type == "cuda" else {"foreach": False}
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kw)


def profiled_collectives(step, batch) -> int:
    """c10d collectives one step issues, counted from the profiler's dispatcher events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(batch)
    names = ("allreduce", "broadcast", "allgather", "reduce_scatter", "_reduce_scatter", "all_gather")
    return sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::") and any(n in e.key for n in names))


def eager_step(model, optimizer, loss_fn=gpt_loss):
    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()

    return step


def loss_for(precision: str, device: torch.device):
    """gpt_loss, with the forward under bf16 autocast for "amp"."""
    if precision != "amp":
        return gpt_loss

    def loss_fn(model, batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return gpt_loss(model, batch)

    return loss_fn


def compiled_step(model, device, master: bool, loss_fn, mode: str | None = None):
    """torch.compile(model, mode=mode) + fused AdamW (on fp32 master copies for bf16 parameters)."""
    masters = [p.detach().float().requires_grad_() for p in model.parameters()] if master else None
    opt = adamw(masters if master else model.parameters(), device)
    return torch_step(model, torch.compile(model, mode=mode), opt, loss_fn, masters)


def build(method: str, base, device, args, batch0):
    """(step function, collectives per step, how they were counted) of one method."""
    model = copy.deepcopy(base)
    master, loss_fn = args.precision == "bf16master", loss_for(args.precision, device)
    if method.startswith("graphfuse"):
        align = {
            "graphfuse_aligned": {"align_buckets_to_blocks": True},
            "graphfuse_unaligned": {"align_buckets_to_blocks": False},
        }
        strategy = gf.Strategy(
            bucket_size_mb=args.bucket_mb,
            compile=args.compile,
            master_dtype=torch.float32 if master else None,
            overlap_param_gather=method == "graphfuse_deferred",
            cuda_graphs=method == "graphfuse_cudagraphs",
            compile_workers=args.compile_workers if method == "graphfuse_workers" else 0,
            **align.get(method, {}),
        )
        dm = gf.compile(model, adamw(model.parameters(), device), loss_fn, batch0, strategy)
        counts = count_targets(dm.program)
        return dm, sum(v for k, v in counts.items() if k.startswith("_c10d_functional") and "wait" not in k), "graph"
    if method.startswith("torch_compile"):
        mode = "reduce-overhead" if method == "torch_compile_cudagraphs" else None
        return compiled_step(model, device, master, loss_fn, mode), 0, "none (one process)"
    if master:
        raise SystemExit(f"--precision bf16master is measured for graphfuse and torch_compile only, not {method}")
    if method == "ddp_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
        zero_kw = {"fused": True} if device.type == "cuda" else {"foreach": False}
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.1, **zero_kw
        )
        step = eager_step(ddp, zero, loss_fn)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        step = eager_step(model, adamw(model.parameters(), device), loss_fn)
    return step, profiled_collectives(step, batch0), "profiler"


def worker(rank: int, world: int, args) -> dict:
    """One rank's timings (graphfuse.testing.launch has set up the process group and the device): per
    method, step times, collectives, peak memory and setup + first step seconds."""
    torch.backends.cuda.matmul.allow_tf32 = True  # the same matmul precision for every method
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd
    )
    torch.manual_seed(0)
    base = GPT(cfg).to(device, torch.bfloat16 if args.precision == "bf16master" else torch.float32)
    n = args.warmup + args.steps
    batches = [tuple(x.to(device) for x in b) for b in synthetic_tokens(cfg, args.batch, n, seed=rank)]
    out = {}
    for method in args.methods:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t = time.perf_counter()
        step, collectives, counted_by = build(method, base, device, args, batches[0])
        step(batches[0])
        if method in CAPTURED_AT_SECOND_STEP:
            step(batches[1])
        sync(device)
        setup_s = time.perf_counter() - t
        times = timed(step, batches, args.warmup, device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        out[method] = {
            "times": times,
            "collectives": collectives,
            "counted_by": counted_by,
            "setup_s": setup_s,
            "peak_gib": peak,
        }
        del step
    return out


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
    ap.add_argument(
        "--compile-workers", type=int, default=3, help="Strategy.compile_workers of method graphfuse_workers"
    )
    ap.add_argument(
        "--precision",
        choices=["fp32", "amp", "bf16master"],
        default="fp32",
        help="fp32 (TF32 matmuls), amp (bf16 autocast forward), bf16master (bf16 parameters, fp32 master weights)",
    )
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=["graphfuse", "ddp_zero", "fsdp2"])
    args = ap.parse_args()
    if any(m.startswith("torch_compile") for m in args.methods) and args.world_size > 1:
        ap.error("torch_compile is measured at --world-size 1 only (no data parallelism around it)")
    if "graphfuse_cudagraphs" in args.methods and (args.device, args.compile) != ("cuda", "inductor"):
        ap.error("graphfuse_cudagraphs replays the inductor-compiled step: use --device cuda --compile inductor")
    if "graphfuse_deferred" in args.methods and args.world_size == 1:
        ap.error(
            "graphfuse_deferred is the graphfuse program itself at world size 1 (nothing to gather); "
            "use tools/overlap_report.py for its schedule"
        )

    backend = "nccl" if args.device == "cuda" else "gloo"
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    results = dict(enumerate(run_ranks(worker, args.world_size, args, backend=backend, threads=threads, timeout=1800)))

    rows = {}
    for name in args.methods:
        # A step takes as long as its slowest rank: median over steps of the max over ranks.
        per_step = [max(r[name]["times"][i] for r in results.values()) for i in range(args.steps)]
        first = results[0][name]
        peaks = [r[name]["peak_gib"] for r in results.values()]
        rows[name] = {
            "ms": 1e3 * statistics.median(per_step),
            "collectives": first["collectives"],
            "counted_by": first["counted_by"],
            "setup_s": max(r[name]["setup_s"] for r in results.values()),
            "peak_gib": None if peaks[0] is None else max(peaks),
        }
    ref = rows[args.methods[0]]["ms"]
    for name in rows:
        rows[name]["vs_first"] = rows[name]["ms"] / ref

    from rich.table import Table

    where = machine(args.device)
    table = Table(
        title=f"training step, GPT {args.layers}x{args.embd}, batch {args.batch}x{args.block}, {args.precision}, "
        f"{args.world_size} ranks, {args.device} ({where})"
    )
    for col in (
        "method",
        "median step ms",
        f"time / {args.methods[0]}",
        "peak GiB",
        "setup + first step s",
        "collectives/step",
        "counted by",
    ):
        table.add_column(col)
    for name, r in rows.items():
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        table.add_row(
            name,
            f"{r['ms']:.1f}",
            f"{r['vs_first']:.2f}x",
            peak,
            f"{r['setup_s']:.1f}",
            str(r["collectives"]),
            r["counted_by"],
        )
    print_report(
        [table],
        {
            "bench": "step",
            "device": args.device,
            "world_size": args.world_size,
            "machine": where,
            "config": vars(args),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
