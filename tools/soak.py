"""Soak test (issue 11): a tiny GPT with several buckets trains for many steps on real Gloo
ranks, again and again; every run that crashes, hangs or raises is reported with its root cause.

    python tools/soak.py --runs 20 --steps 2400            # the issue's check (3 ranks)
    python tools/soak.py --runs 3 --steps 300 --max-inflight none   # unbounded, as before

Prints one line per run, a table, and a JSON line. Runs on CPU (Gloo) only."""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from _bench import machine as bench_machine  # tools/_bench.py: what the benches share

import graphfuse as gf
from graphfuse.testing.launch import RankFailure, run_ranks
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens
from graphfuse.testing.progress import heartbeat, reached

CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32)


def _rank_main(rank: int, world: int, steps: int, strategy: gf.Strategy, progress: str) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = synthetic_tokens(CFG, 4, 16, seed=rank)
    dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=strategy)
    t0 = time.perf_counter()
    for i in range(steps):
        loss = dm(batches[i % len(batches)])
        if i % 50 == 0 or i == steps - 1:
            heartbeat(progress, rank, i + 1)
    return {
        "buckets": len(dm.layout.buckets),
        "max_inflight": dm.strategy.max_inflight_collectives,
        "loss": loss.item(),
        "step_ms": 1e3 * (time.perf_counter() - t0) / steps,
    }


def one_run(args, strategy: gf.Strategy) -> dict:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gf-soak-") as progress:
        try:
            results = run_ranks(
                _rank_main, args.ranks, args.steps, strategy, progress, threads=args.threads, timeout=args.run_timeout
            )
        except RankFailure as e:  # a rank failed, or hung past the timeout
            cause = getattr(e, "traceback", str(e)).strip().splitlines() or [""]
            return {
                "ok": False,
                "rank": getattr(e, "rank", None),
                "error": cause[-1],
                "seconds": time.monotonic() - t0,
                "progress": reached(progress, args.ranks),
            }
    return {"ok": True, "seconds": time.monotonic() - t0, **results[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-size-mb", type=float, default=0.02, help="small, for several buckets")
    p.add_argument("--max-inflight", default="auto", help="'auto' (the default strategy), 'none', or an int")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--run-timeout", type=float, default=900.0)
    args = p.parse_args()
    k = {"auto": "auto", "none": None}.get(args.max_inflight.lower(), None)
    if args.max_inflight.lower() not in ("auto", "none"):
        k = int(args.max_inflight)
    strategy = gf.Strategy(bucket_size_mb=args.bucket_size_mb, overlap=not args.no_overlap, max_inflight_collectives=k)
    runs = []
    for i in range(args.runs):
        runs.append(one_run(args, strategy))
        r = runs[-1]
        what = (
            f"ok, {r['buckets']} buckets, max in flight {r['max_inflight']}, {r['step_ms']:.1f} ms/step"
            if r["ok"]
            else (f"FAILED (rank {r['rank']}): {r['error']}; reached: {r['progress']}")
        )
        print(f"run {i}: {what} ({r['seconds']:.0f}s)", flush=True)
    failed = [r for r in runs if not r["ok"]]
    machine = bench_machine("cpu")
    print(
        f"\n| ranks | runs | steps | max_inflight | overlap | failed |\n|---|---|---|---|---|---|\n"
        f"| {args.ranks} | {args.runs} | {args.steps} | {args.max_inflight} | {not args.no_overlap} | {len(failed)} |"
    )
    print(json.dumps({"tool": "soak", "machine": machine, **vars(args), "failed": len(failed), "results": runs}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
