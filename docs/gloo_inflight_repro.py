"""Torch-only repro: many async functional collectives in flight on one Gloo group (the pattern
of a ZeRO-1 step with every bucket's reduce-scatter and all-gather issued early, waited late).

    python docs/gloo_inflight_repro.py --ranks 3 --inflight 7 --numel 65536 --steps 400 --runs 5

Each run spawns `--ranks` processes; a run fails if any rank raises, dies (SIGSEGV, abort) or
passes `--run-timeout`. Prints one line per run and a JSON summary. Needs torch only."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

c10d = torch.ops._c10d_functional


def rank_main(
    rank: int,
    world: int,
    store: str,
    inflight: int,
    numel: int,
    steps: int,
    threads: int,
    ops: str,
    keep: bool,
    barrier: bool,
) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    name = dist.group.WORLD.group_name
    n = numel - numel % world
    buckets = [torch.randn(n) for _ in range(inflight)]
    for _ in range(steps):
        # "backward": every bucket's gradients are reduce-scattered as soon as they exist
        if "rs" in ops:
            inputs = [b * 0.5 for b in buckets]
            issued = [c10d.reduce_scatter_tensor(x, "avg", world, name) for x in inputs]
            if not keep:  # as FX-generated code does: an input is dropped after its last use
                del inputs
            shards = [c10d.wait_tensor(x).add(1e-3) for x in issued]  # "update": waits in bucket order
        else:
            shards = [b[rank * (n // world) : (rank + 1) * (n // world)].add(1e-3) for b in buckets]
        if "ag" in ops:
            gathered = [c10d.all_gather_into_tensor(s, world, name) for s in shards]
            for b, g in zip(buckets, gathered):  # waited only where the result is used
                b.copy_(c10d.wait_tensor(g))
        if barrier:  # no rank starts the next step's collectives while another is in this step's
            dist.barrier()
    dist.destroy_process_group()


def one_run(args) -> str:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(
                target=rank_main,
                args=(
                    r,
                    args.ranks,
                    os.path.join(d, "store"),
                    args.inflight,
                    args.numel,
                    args.steps,
                    args.threads,
                    args.ops,
                    args.keep_inputs,
                    args.barrier,
                ),
            )
            for r in range(args.ranks)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.run_timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(1.0)
                break
            time.sleep(0.2)
        hung = any(p.is_alive() for p in procs)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    if hung and all(c in (0, -9) for c in codes):
        return f"hang (> {args.run_timeout}s), exit codes {codes}"
    return "ok" if all(c == 0 for c in codes) else f"failed, exit codes {codes}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--inflight", type=int, default=7, help="collectives of each kind in flight at once")
    p.add_argument("--numel", type=int, default=65536, help="elements per bucket (float32)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ops", choices=("rs+ag", "rs", "ag"), default="rs+ag", help="which collectives to keep in flight")
    p.add_argument("--keep-inputs", action="store_true", help="hold each reduce-scatter's input until its wait")
    p.add_argument("--barrier", action="store_true", help="a barrier after every step")
    p.add_argument("--run-timeout", type=float, default=600.0)
    args = p.parse_args()
    outcomes = []
    for i in range(args.runs):
        t0 = time.monotonic()
        outcomes.append(one_run(args))
        print(f"run {i}: {outcomes[-1]} ({time.monotonic() - t0:.1f}s)", flush=True)
    failed = sum(o != "ok" for o in outcomes)
    print(json.dumps({"torch": torch.__version__, **vars(args), "failed": failed, "outcomes": outcomes}))


if __name__ == "__main__":
    main()
