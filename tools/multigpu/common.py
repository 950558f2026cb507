"""What the three measurements of tools/bench_multigpu.py share: the model and its batches, the
peers' optimizer, the executor and backend chosen, freeing memory between methods, and reading
collectives and their exposed time out of torch.profiler's trace."""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from _bench import sync

from graphfuse.testing.models import GPT, GPTConfig, synthetic_tokens

PRESETS = {
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, block_size=1024),
    "1b": dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=1024),
    "small": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=512, block_size=128),
}
LR, WD = 1e-3, 0.1


def device_of(args) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def gpt_config(args, preset: str) -> GPTConfig:
    cfg = dict(PRESETS[preset])
    for key, attr in (
        ("n_layer", "layers"),
        ("n_embd", "embd"),
        ("n_head", "heads"),
        ("vocab_size", "vocab"),
        ("block_size", "block"),
    ):
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
        work = merged(
            [
                (e["ts"], e["ts"] + e["dur"])
                for e in events
                if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and not collective_kind(e, device)
            ]
        )
        return length(comm), length(comm) - overlap(comm, work)
    waits = [e for e in events if e["name"] == "_c10d_functional::wait_tensor"]
    if not waits:
        return None
    comm = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if collective_kind(e, device)])
    return length(comm), sum(e["dur"] for e in waits)
