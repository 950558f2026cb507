"""Several ranks (issue 6): NCCL correctness, in-step collective bandwidth, and the training
step of graphfuse against DDP + ZeroRedundancyOptimizer and FSDP2. Spawns its own ranks.

    python tools/bench_multigpu.py correctness --device cuda --world-size 2
    python tools/bench_multigpu.py comm        --device cuda --world-size 4
    python tools/bench_multigpu.py step        --device cuda --world-size 4

`--device cuda --backend gloo` runs every rank on GPU 0 over Gloo (collectives staged through the
host: Strategy.stage_collectives_on_host), for machines with fewer GPUs than ranks.
`--device cuda` runs one rank per GPU over NCCL (NCCL_NVLS_ENABLE=0 is kept set: NVLink
multicast stays off) and graphfuse with compile="inductor"; `--device cpu` runs Gloo ranks and
graphfuse with compile="eager" (for smoke runs; its times say nothing about GPUs). Every
subcommand prints a rich table, the machine, and one JSON line (the last line of stdout).

correctness
    graphfuse vs an eager data-parallel reference on the same model, initial weights and
    per-rank batches over --steps steps, in two variants:
    - fp32: the reference is DDP + torch.optim.AdamW(foreach=False);
    - bf16 params + Strategy(master_dtype=torch.float32): the reference keeps the model in
      bf16 and fp32 master copies that AdamW updates; its bf16 gradients are cast to fp32 and
      all-reduced (AVG) per parameter, and the masters are copied back into the bf16 model
      (DDP would all-reduce in bf16, which is not what graphfuse does).
    Reports the max |loss diff| per step (max over ranks), the parameters' max |diff| after
    the last step, and the optimizer state bytes per rank (graphfuse's shard tensors: AdamW's
    exp_avg/exp_avg_sq and, with a master dtype, the fp32 master shard) against the
    reference's unsharded state (its exp_avg/exp_avg_sq, plus the fp32 masters; the 0-d
    `step` counters are left out). The ratio should be about 1/N (plus alignment padding).

comm
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

step
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

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import graphfuse as gf
from graphfuse.testing import launch
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

PRESETS = {
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, block_size=1024),
    "1b": dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=1024),
    "small": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=512, block_size=128),
}
LR, WD = 1e-3, 0.1


# ---- process management ------------------------------------------------------------------
def _rank_main(rank: int, world: int, args: argparse.Namespace):
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the same matmul precision for every method
        torch.backends.cudnn.allow_tf32 = True
    return COMMANDS[args.cmd](args)


def run_ranks(args: argparse.Namespace) -> list:
    """Every rank's result of the subcommand (graphfuse.testing.launch spawns the process group; it
    keeps NCCL_NVLS_ENABLE=0 and gives each rank its own GPU)."""
    backend = backend_of(args)
    if backend == "nccl" and torch.cuda.device_count() < args.world_size:
        sys.exit(f"--device cuda --world-size {args.world_size} needs one GPU per rank over NCCL; {torch.cuda.device_count()} "
                 "visible (--backend gloo shares one GPU between ranks)")
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    try:
        return launch.run_ranks(_rank_main, args.world_size, args, backend=backend, threads=threads, timeout=args.timeout)
    except AssertionError as e:
        sys.exit(str(e))


def machine(device: str) -> str:
    if device == "cuda":
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        return (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}, NCCL {nccl}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    return f"{platform.processor() or platform.machine()} {os.cpu_count()} cores, {platform.system()}, torch {torch.__version__}, Gloo"


# ---- shared helpers ------------------------------------------------------------------------
def device_of(args) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpt_config(args, preset: str) -> GPTConfig:
    cfg = dict(PRESETS[preset])
    for key, attr in (("n_layer", "layers"), ("n_embd", "embd"), ("n_head", "heads"), ("vocab_size", "vocab"), ("block_size", "block")):
        if getattr(args, attr) is not None:
            cfg[key] = getattr(args, attr)
    return GPTConfig(**cfg)


def batches_for(cfg: GPTConfig, batch: int, n: int, device: torch.device) -> list:
    return [tuple(x.to(device) for x in b) for b in synthetic_tokens(cfg, batch, n, seed=1000 + dist.get_rank())]


def fresh_model(cfg: GPTConfig, device: torch.device, dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg).to(device=device, dtype=dtype)


def peer_adamw(params, device: torch.device) -> torch.optim.AdamW:
    kw = {"fused": True} if device.type == "cuda" else {"foreach": False}
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, **kw)


def compile_mode(args) -> str:
    if args.compile != "auto":
        return args.compile
    return "inductor" if args.device == "cuda" else "eager"


def backend_of(args) -> str:
    """NCCL on CUDA, Gloo on the CPU; `--backend gloo --device cuda` puts every rank on GPU 0
    (NCCL refuses two ranks on one GPU; Gloo stages CUDA tensors through the host)."""
    if args.backend != "auto":
        return args.backend
    return "nccl" if args.device == "cuda" else "gloo"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def trace_events(prof) -> list[dict]:
    """The profiler's Chrome-trace events (name, cat, ts, dur in µs, tid)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def profile(fn, steps: int, device: torch.device, wall: list | None = None) -> list[dict]:
    """Trace events of `steps` calls of fn; appends the calls' wall seconds to `wall`."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    dist.barrier()
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        sync(device)
        if wall is not None:
            wall.append(time.perf_counter() - t)
    return trace_events(prof)


def collective_kind(event: dict, device: torch.device) -> str | None:
    """'reduce_scatter', 'all_gather', 'other' for a collective's device-side event, else None."""
    name = event["name"]
    if device.type == "cuda":
        if event.get("cat") != "kernel" or "nccl" not in name.lower():
            return None
        return "reduce_scatter" if "ReduceScatter" in name else "all_gather" if "AllGather" in name else "other"
    if not name.startswith("gloo:"):
        return None
    # Gloo runs reduce_scatter_tensor as an all-reduce of the whole buffer.
    if "all_gather" in name or "allgather" in name:
        return "all_gather"
    return "reduce_scatter" if ("reduce_scatter" in name or "all_reduce" in name) else "other"


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def overlap(xs, ys) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_comm_us(events: list[dict], device: torch.device) -> tuple[float, float] | None:
    """(communication time, exposed communication time) in µs over the profiled window."""
    if device.type == "cuda":
        comm = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if collective_kind(e, device)])
        work = merged([(e["ts"], e["ts"] + e["dur"]) for e in events
                       if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and not collective_kind(e, device)])
        return length(comm), length(comm) - overlap(comm, work)
    waits = [e for e in events if e["name"] == "_c10d_functional::wait_tensor"]
    if not waits:
        return None
    comm = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if collective_kind(e, device)])
    return length(comm), sum(e["dur"] for e in waits)


def gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- correctness ---------------------------------------------------------------------------
def shard_bytes(dm: gf.DistModel) -> int:
    shards = {s.name for s in dm.program.signature.inputs if s.role == "shard"}
    return nbytes(t for n, t in dm.tensors.items() if n in shards)


def correctness_variant(args, master: bool) -> dict:
    device = device_of(args)
    cfg = gpt_config(args, "small")
    dtype = torch.bfloat16 if master else torch.float32
    batches = batches_for(cfg, args.batch or 8, args.steps, device)
    base = fresh_model(cfg, device, dtype)
    ref_model = copy.deepcopy(base)

    if master:
        masters = [p.detach().float().requires_grad_() for p in ref_model.parameters()]
        ref_opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, foreach=False)

        def ref_step(batch):
            ref_opt.zero_grad(set_to_none=True)
            ref_model.zero_grad(set_to_none=True)
            loss = gpt_loss(ref_model, batch)
            loss.backward()
            for p, m in zip(ref_model.parameters(), masters):
                m.grad = p.grad.float()
                dist.all_reduce(m.grad, op=dist.ReduceOp.AVG)
            ref_opt.step()
            with torch.no_grad():
                for p, m in zip(ref_model.parameters(), masters):
                    p.copy_(m)
            return loss.detach()

        ref_params = ref_model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        masters = []
        ddp = DDP(ref_model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb)
        ref_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD, foreach=False)

        def ref_step(batch):
            ref_opt.zero_grad(set_to_none=True)
            loss = gpt_loss(ddp, batch)
            loss.backward()
            ref_opt.step()
            return loss.detach()

        ref_params = ddp.module

    model = base
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    strategy = gf.Strategy(bucket_size_mb=args.bucket_mb, compile=compile_mode(args), master_dtype=torch.float32 if master else None)
    dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=strategy)

    diffs = []
    for batch in batches:
        ref_loss = ref_step(batch)
        loss = dm(batch)
        diffs.append((loss.double() - ref_loss.double()).abs().item())
    ref_named = dict(ref_params.named_parameters())
    param_diff = max((p.double() - ref_named[n].double()).abs().max().item() for n, p in model.named_parameters())

    state = [t for s in ref_opt.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)]
    unsharded = nbytes(state) + nbytes(masters)
    return {
        "loss_diffs": diffs,
        "param_diff": param_diff,
        "state_bytes": shard_bytes(dm),
        "unsharded_state_bytes": unsharded,
        "params": sum(p.numel() for p in model.parameters()),
        "buckets": len(dm.layout.buckets),
    }


def correctness(args) -> dict:
    return {"fp32": correctness_variant(args, master=False), "bf16_master": correctness_variant(args, master=True)}


def report_correctness(args, results: list[dict], where: str) -> dict:
    from rich.console import Console
    from rich.table import Table

    n = args.world_size
    rows = {}
    for variant in ("fp32", "bf16_master"):
        per_rank = [r[variant] for r in results]
        per_step = [max(r["loss_diffs"][i] for r in per_rank) for i in range(args.steps)]
        state = [r["state_bytes"] for r in per_rank]
        unsharded = per_rank[0]["unsharded_state_bytes"]
        rows[variant] = {
            "max_loss_diff": max(per_step),
            "loss_diff_per_step": per_step,
            "param_diff": max(r["param_diff"] for r in per_rank),
            "state_bytes_per_rank": state,
            "unsharded_state_bytes": unsharded,
            "state_ratio": max(state) / unsharded,
            "one_over_n": 1 / n,
            "params": per_rank[0]["params"],
            "buckets": per_rank[0]["buckets"],
        }
    table = Table(title=f"correctness: graphfuse vs eager data parallel, {args.steps} steps, {n} ranks, {args.device} ({where})")
    for col in ("variant", "params", "buckets", "max |loss diff|", "params max |diff|", "state B / rank", "unsharded B", "ratio", "1/N"):
        table.add_column(col, justify="right")
    for variant, r in rows.items():
        table.add_row(variant, f"{r['params']:,}", str(r["buckets"]), f"{r['max_loss_diff']:.2e}", f"{r['param_diff']:.2e}",
                      f"{max(r['state_bytes_per_rank']):,}", f"{r['unsharded_state_bytes']:,}", f"{r['state_ratio']:.4f}", f"{1 / n:.4f}")
    Console(width=200).print(table)
    return rows


# ---- comm ----------------------------------------------------------------------------------
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
    strategy = gf.Strategy(bucket_size_mb=mb, compile=compile_mode(args), master_dtype=torch.float32 if master else None)
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


def report_comm(args, results: list[dict], where: str) -> dict:
    from rich.console import Console
    from rich.table import Table

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
    for col in ("bucket MB", "collective", "count", "MB each (max)", "dtype", "µs/step in step", "µs alone",
                "busbw in step GB/s", "busbw alone GB/s", "ratio"):
        table.add_column(col, justify="right")
    for mb, r in rows.items():
        for kind in ("reduce_scatter", "all_gather"):
            k = r[kind]
            table.add_row(mb, kind, str(k["collectives_per_step"]), f"{max(k['bytes']) / 2**20:.2f}", k["dtype"], f"{k['in_step_us']:.1f}",
                          f"{k['alone_us']:.1f}", f"{k['busbw_in_step_GBps']:.2f}", f"{k['busbw_alone_GBps']:.2f}", f"{k['ratio']:.2f}")
    Console(width=200).print(table)
    return rows


# ---- step ----------------------------------------------------------------------------------
def timed(step, batches, warmup: int, device: torch.device) -> list[float]:
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
    return {"times": times, "peak_bytes": peak, "comm_us": exposed and exposed[0], "exposed_us": exposed and exposed[1],
            "exposed_share": exposed and exposed[2]}


def run_graphfuse(cfg: GPTConfig, batches, args, device: torch.device) -> dict:
    """bf16 model, fp32 master shards, fp32 reduce-scatter, bf16 all-gather."""
    model = fresh_model(cfg, device, torch.bfloat16)
    strategy = gf.Strategy(bucket_size_mb=args.bucket_mb, compile=compile_mode(args), master_dtype=torch.float32)
    dm = gf.compile(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), gpt_loss, batches[0], strategy)
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


def report_step(args, results: list[dict], where: str) -> dict:
    from rich.console import Console
    from rich.table import Table

    n = args.world_size
    rows = {}
    table = Table(title=f"training step, bf16 + fp32 master, {n} ranks, {args.device} ({where})")
    for col in ("model", "params", "method", "median ms", "tokens/s", "tok/s / graphfuse", "peak GiB/rank", "mem / graphfuse",
                "comm ms/step", "exposed comm share"):
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
            r["peak_vs_graphfuse"] = None if r["peak_bytes_per_rank"] is None else r["peak_bytes_per_rank"] / g["peak_bytes_per_rank"]
        best_peer = max(model_rows[m]["tokens_per_s"] for m in METHODS[1:])
        rows[preset] = {
            "config": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "vocab_size": cfg.vocab_size,
                       "block_size": cfg.block_size, "batch_per_rank": batch},
            "params": results[0][preset]["params"],
            "graphfuse_buckets": results[0][preset]["graphfuse"]["buckets"],
            "methods": model_rows,
            "graphfuse_vs_best_peer": g["tokens_per_s"] / best_peer,
            "memory": "torch.cuda.max_memory_allocated, max over ranks" if args.device == "cuda" else "not measured on CPU",
        }
        for m, r in model_rows.items():
            def fmt(x, spec):
                return "-" if x is None else format(x, spec)

            table.add_row(preset, f"{rows[preset]['params']:,}", m, f"{r['median_step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                          f"{r['tokens_per_s_vs_graphfuse']:.2f}x", fmt(r["peak_bytes_per_rank"] and r["peak_bytes_per_rank"] / 2**30, ".2f"),
                          fmt(r["peak_vs_graphfuse"], ".2f"), fmt(r["comm_ms_per_step"], ".2f"), fmt(r["exposed_comm_share"], ".1%"))
    console = Console(width=200)
    console.print(table)
    for preset, r in rows.items():
        console.print(f"{preset}: graphfuse tokens/s / best peer = {r['graphfuse_vs_best_peer']:.2f}x (target >= 1.1x)")
    if args.device == "cpu":
        console.print("peak memory: not measured on CPU; exposed communication on CPU: graphfuse only (blocked wait_tensor time)")
    return rows


COMMANDS = {"correctness": correctness, "comm": comm, "step": step}
REPORTS = {"correctness": report_correctness, "comm": report_comm, "step": report_step}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, steps: int, warmup: int):
        p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
        p.add_argument("--world-size", type=int, default=2)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--warmup", type=int, default=warmup)
        p.add_argument("--layers", type=int, default=None, help="override the model's n_layer")
        p.add_argument("--embd", type=int, default=None, help="override n_embd")
        p.add_argument("--heads", type=int, default=None, help="override n_head")
        p.add_argument("--vocab", type=int, default=None, help="override vocab_size")
        p.add_argument("--block", type=int, default=None, help="override block_size (tokens per sequence)")
        p.add_argument("--batch", type=int, default=None, help="sequences per rank")
        p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are given up")
        p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                       help="auto: NCCL on cuda, Gloo on cpu; gloo with --device cuda runs every rank on GPU 0")
        p.add_argument("--compile", choices=["auto", "eager", "inductor"], default="auto",
                       help="graphfuse's executor; auto: inductor on cuda, eager on cpu")

    p = sub.add_parser("correctness", help="graphfuse vs eager DDP + AdamW: losses and optimizer state per rank")
    common(p, steps=50, warmup=0)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p = sub.add_parser("comm", help="busbw of the in-step reduce-scatters/all-gathers vs the same collectives alone")
    common(p, steps=5, warmup=3)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 64.0, 256.0])
    p.add_argument("--iters", type=int, default=20, help="collectives issued alone per size")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: bf16 params + fp32 master (fp32 reduce-scatter)")
    p = sub.add_parser("step", help="tokens/s, peak memory and exposed communication vs DDP+ZeRO and FSDP2")
    common(p, steps=20, warmup=3)
    p.add_argument("--models", nargs="+", choices=["gpt2-small", "1b"], default=["gpt2-small", "1b"])
    p.add_argument("--bucket-mb", type=float, default=64.0, help="graphfuse's bucket size and DDP's bucket_cap_mb")
    p.add_argument("--profile-steps", type=int, default=3)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (inherited by the ranks)
    args = parse(argv)
    where = machine(args.device)
    t0 = time.perf_counter()
    results = run_ranks(args)
    rows = REPORTS[args.cmd](args, results, where)
    record = {"bench": f"multigpu.{args.cmd}", "device": args.device, "world_size": args.world_size, "machine": where,
              "backend": backend_of(args), "compile": compile_mode(args), "wall_s": time.perf_counter() - t0,
              "config": vars(args), "results": rows}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
