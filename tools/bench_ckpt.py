"""Checkpoint save/load time and peak extra memory: graphfuse's two modes (and how long an
async save blocks the training loop) vs torch.save of the same tensors and vs DCP on an FSDP2
model of the same shape, as ratios, in one run.

    python tools/bench_ckpt.py [--world-size 2] [--layers 12] [--width 2048] [--dir /tmp/bench_ckpt]

Spawns Gloo ranks (CPU); prints a rich table and one JSON line; states the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _bench import machine as bench_machine  # tools/_bench.py: what the benches share
from _bench import print_report

from graphfuse.testing.launch import run_ranks


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(fn) -> tuple[float, int]:
    """(seconds, peak resident bytes above the start) of fn(), sampled every millisecond."""
    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    seconds = time.perf_counter() - start
    done.set()
    t.join()
    return seconds, max(0, max(peak[0], rss()) - base)


def mlp(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def loss_fn(model, x):
    return model(x).square().mean()


def bench_graphfuse(rank: int, root: str, args, x: torch.Tensor, drop_cache) -> dict:
    import graphfuse as gf

    out = {}
    model = mlp(args.layers, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dm = gf.compile(model, opt, loss_fn, x, strategy=gf.Strategy(bucket_size_mb=64))
    dm(x)
    for mode in ("unbalanced", "balanced"):
        path = os.path.join(root, mode)
        out[f"graphfuse {mode} save"] = measure(lambda path=path, mode=mode: gf.save(dm, path, mode=mode))
        out[f"graphfuse {mode} load"] = measure(lambda path=path: gf.load(dm, path))
        drop_cache(path)
        # The training loop is blocked only for the host copy and the first exchange; the
        # rest runs in a background thread until wait().
        handle = []
        path = os.path.join(root, f"{mode}_async")
        out[f"graphfuse {mode} async, loop blocked save"] = measure(
            lambda path=path, mode=mode, handle=handle: handle.append(gf.save(dm, path, mode=mode, async_=True))
        )
        out[f"graphfuse {mode} async, rest until wait() save"] = measure(lambda handle=handle: handle[0].wait())
        drop_cache(path)
    mine = {k: v for k, v in dm.tensors.items() if k.startswith("bucket")}  # what this rank holds
    path = os.path.join(root, f"torch_save_{rank}.pt")
    out["torch.save save"] = measure(lambda: torch.save(mine, path))
    out["torch.save load"] = measure(lambda: torch.load(path, weights_only=True))
    os.remove(path)
    return out


def worker(rank: int, world: int, args) -> dict:
    """One rank's measurements (graphfuse.testing.launch.run_ranks made its Gloo group)."""
    root, out = args.dir, {}
    x = torch.randn(8, args.width)

    def drop_cache(path):
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    out.update(bench_graphfuse(rank, root, args, x, drop_cache))

    try:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.fsdp import fully_shard

        model = mlp(args.layers, args.width)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_fn(model, x).backward()
        opt.step()
        path = os.path.join(root, "fsdp2")

        def save():
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def load():
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

        out["DCP FSDP2 save"] = measure(save)
        out["DCP FSDP2 load"] = measure(load)
        drop_cache(path)
    except Exception as e:  # FSDP2 on CPU/Gloo may be unavailable in some builds
        out["DCP FSDP2 error"] = f"{type(e).__name__}: {e}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--dir", default="/tmp/bench_ckpt")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    results = dict(enumerate(run_ranks(worker, args.world_size, args, threads=threads, timeout=3600)))
    shutil.rmtree(args.dir, ignore_errors=True)

    params = args.layers * (args.width * args.width + args.width)
    machine = f"{bench_machine('cpu')}, {args.world_size} Gloo ranks on one host"
    rows = {}
    for name in results[0]:
        if name.endswith("error"):
            continue
        seconds = max(results[r][name][0] for r in results)  # the slowest rank finishes the operation
        peak = max(results[r][name][1] for r in results)
        rows[name] = (seconds, peak)
    from rich.table import Table

    table = Table(title=f"checkpoint of {params * 4 / 2**20:.0f} MiB of fp32 weights + AdamW state ({machine})")
    for col in ("operation", "seconds", "peak extra MiB / rank", "time vs torch.save", "time vs DCP FSDP2"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    summary = {"machine": machine, "params": params, "world_size": args.world_size, "results": {}}
    for name, (seconds, peak) in rows.items():
        kind = name.rsplit(" ", 1)[1]
        vs_torch = seconds / rows[f"torch.save {kind}"][0]
        fsdp = rows.get(f"DCP FSDP2 {kind}")
        vs_fsdp = seconds / fsdp[0] if fsdp else float("nan")
        table.add_row(name, f"{seconds:.3f}", f"{peak / 2**20:.0f}", f"{vs_torch:.2f}x", f"{vs_fsdp:.2f}x")
        summary["results"][name] = {
            "seconds": round(seconds, 4),
            "peak_extra_mib": round(peak / 2**20, 1),
            "vs_torch_save": round(vs_torch, 3),
            "vs_dcp_fsdp2": round(vs_fsdp, 3),
        }
    for r in results:
        if "DCP FSDP2 error" in results[r]:
            summary["fsdp2_error"] = results[r]["DCP FSDP2 error"]
    notes = [f"DCP on FSDP2 not measured: {summary['fsdp2_error']}"] if "fsdp2_error" in summary else []
    print_report([table, *notes], summary)


if __name__ == "__main__":
    main()
