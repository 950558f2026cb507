"""The torch.compile path (issue 14) against gf.compile and against DDP + fused AdamW under
torch.compile: step time, collectives per step, and where each collective is issued. Spawns its
own ranks (Gloo on CPU, NCCL on CUDA).

    python tools/bench_compile_path.py --device cpu  --world-size 2 --steps 6
    python tools/bench_compile_path.py --device cuda --world-size 2 --model gpt2-small

Methods, all on the same GPT-2-shaped graphfuse.testing.models.GPT, initial weights and per-rank batches:
- compile_path: torch.compile(model, backend="graphfuse") + gf.shard_optimizer(AdamW): each
  bucket reduce-scattered inside the compiled backward, all-gathers in step();
- gf_compile: gf.compile (one traced step; compile="inductor" on CUDA, "eager" on CPU);
- ddp: torch.compile(DDP(model), backend="inductor") + AdamW(fused=True), DDP buckets of
  max(--bucket-mb, 1) MB (dynamo's DDPOptimizer refuses buckets below DDP's first, 1 MB).
Step time: the median over --steps timed steps (after --warmup) of the slowest rank. Collectives
are read from a torch.profiler trace of one step: the dispatcher events that issue one
(functional collectives, or c10d ops when none is nested in another), each with its issue time
as a fraction of the backward (`loss.backward()`; for gf_compile, whose backward is inside
one program, of the whole step). CPU numbers only prove the code path. Prints a table, the
machine and one JSON line (the last line of stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _bench import machine as bench_machine  # tools/_bench.py: what the benches share
from _bench import sync

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import graphfuse as gf  # noqa: E402
from graphfuse.testing.launch import run_ranks  # noqa: E402
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens  # noqa: E402

MODELS = {
    "tiny": GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128),
    "gpt2-small": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}
ISSUE = ("_c10d_functional::", "c10d::")
KINDS = ("reduce_scatter", "all_gather", "allgather", "all_reduce", "allreduce")


def _issued(events, window: tuple[float, float]) -> list[tuple[str, float]]:
    """(name, issue time as a fraction of `window`) of every collective issued, outermost only."""
    found = sorted(
        (e for e in events if e.name.startswith(ISSUE) and any(k in e.name for k in KINDS) and "wait" not in e.name),
        key=lambda e: e.time_range.start,
    )
    out, last_end = [], {}
    lo, hi = window
    for e in found:
        if e.time_range.start < last_end.get(e.thread, -1.0):
            continue  # nested in a collective already counted (a c10d op under a functional one)
        last_end[e.thread] = e.time_range.end
        out.append((e.name.split("::", 1)[1], round((e.time_range.start - lo) / max(hi - lo, 1e-9), 3)))
    return out


def _window(events, name: str) -> tuple[float, float]:
    spans = [e.time_range for e in events if e.name == name]
    return (spans[0].start, spans[0].end) if spans else (0.0, 1.0)


def _setup(method: str, cfg: GPTConfig, device: str, bucket_mb: float, example):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        # dynamo's DDPOptimizer needs buckets of at least DDP's first bucket (1 MB)
        ids = [torch.cuda.current_device()] if device == "cuda" else None
        ddp = DDP(model, device_ids=ids, bucket_cap_mb=max(bucket_mb, 1.0))
        return torch.compile(ddp, backend="inductor"), opt
    strategy = gf.Strategy(bucket_size_mb=bucket_mb, compile="inductor" if device == "cuda" else "eager")
    if method == "gf_compile":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        return gf.compile(model, opt, gpt_loss, example, strategy), None  # traced for the timed batches' shape
    opt = gf.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), strategy, model=model)
    return torch.compile(model, backend="graphfuse"), opt


def _step(method: str, model, opt, batch) -> None:
    if method == "gf_compile":
        with torch.profiler.record_function("bench.step"):
            model(batch)
        return
    with torch.profiler.record_function("bench.step"):
        loss = gpt_loss(model, batch)
        with torch.profiler.record_function("bench.backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()


def _sync(device: str) -> None:
    sync(device)
    dist.barrier()


def _run(rank: int, world: int, args: dict) -> dict:
    device = args["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    cfg = MODELS[args["model"]]
    data = [
        tuple(t.to(device) for t in b)
        for b in synthetic_tokens(cfg, args["batch"], args["warmup"] + args["steps"] + 1, seed=rank)
    ]
    out = {}
    for method in args["methods"]:
        torch._dynamo.reset()
        model, opt = _setup(method, cfg, device, args["bucket_mb"], data[0])
        for b in data[: args["warmup"]]:
            _step(method, model, opt, b)
        times = []
        for b in data[args["warmup"] : -1]:
            _sync(device)
            t0 = time.perf_counter()
            _step(method, model, opt, b)
            _sync(device)
            times.append(time.perf_counter() - t0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _step(method, model, opt, data[-1])
            _sync(device)
        events = prof.events()
        window = "bench.step" if method == "gf_compile" else "bench.backward"
        issued = _issued(events, _window(events, window))
        out[method] = {"times": times, "issued": issued, "window": window.removeprefix("bench.")}
    return out


def _report(results: list[dict], args: dict) -> dict:
    rows = {}
    for method in args["methods"]:
        per_rank = [r[method] for r in results]
        slowest = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
        positions: dict[str, list[float]] = {}
        for name, at in per_rank[0]["issued"]:
            positions.setdefault(name, []).append(at)
        rows[method] = {
            "step_ms": round(statistics.median(slowest) * 1e3, 2),
            "collectives": {k: len(v) for k, v in positions.items()},
            "positions": positions,  # > 1: issued after the window (the all-gathers in step())
            "window": per_rank[0]["window"],
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=0.05)
    p.add_argument("--methods", nargs="+", default=["compile_path", "gf_compile", "ddp"])
    a = p.parse_args(argv)
    args = {k: getattr(a, k) for k in ("device", "model", "batch", "steps", "warmup", "bucket_mb", "methods")}
    backend = "nccl" if a.device == "cuda" else "gloo"
    results = run_ranks(_run, a.world_size, args, backend=backend, timeout=3600)
    rows = _report(results, args)
    machine = bench_machine(a.device)
    print(
        f"{'method':14} {'step ms':>9}  {'collective':24} {'per step':>8}  issued at (fraction of the window; > "
        f"1: after it)"
    )
    for method, r in rows.items():
        for i, (kind, at) in enumerate(r["positions"].items() or [("none", [])]):
            head = f"{method:14} {r['step_ms']:>9}" if i == 0 else " " * 24
            print(f"{head}  {kind:24} {len(at):>8}  {r['window']}: {', '.join(f'{x:.2f}' for x in at)}")
    print(f"machine: {machine}; world size {a.world_size}, model {a.model}, bucket {a.bucket_mb} MB")
    print(
        json.dumps(
            {"tool": "bench_compile_path", "machine": machine, "world_size": a.world_size, **args, "results": rows}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
