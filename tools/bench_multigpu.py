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

Each subcommand's method is in tools/multigpu/<subcommand>.py's docstring; what they share is in
tools/multigpu/common.py and tools/_bench.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from _bench import machine, print_report  # tools/_bench.py: what the benches share
from multigpu import comm, correctness, step
from multigpu.common import backend_of, compile_mode

from graphfuse.testing import launch

COMMANDS = {"correctness": correctness.correctness, "comm": comm.comm, "step": step.step}
REPORTS = {"correctness": correctness.report_correctness, "comm": comm.report_comm, "step": step.report_step}


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
        sys.exit(
            f"--device cuda --world-size {args.world_size} needs one GPU per rank over NCCL; "
            f"{torch.cuda.device_count()} "
            "visible (--backend gloo shares one GPU between ranks)"
        )
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    try:
        return launch.run_ranks(
            _rank_main, args.world_size, args, backend=backend, threads=threads, timeout=args.timeout
        )
    except launch.RankFailure as e:
        sys.exit(str(e))


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
        p.add_argument(
            "--backend",
            choices=["auto", "nccl", "gloo"],
            default="auto",
            help="auto: NCCL on cuda, Gloo on cpu; gloo with --device cuda runs every rank on GPU 0",
        )
        p.add_argument(
            "--compile",
            choices=["auto", "eager", "inductor"],
            default="auto",
            help="graphfuse's executor; auto: inductor on cuda, eager on cpu",
        )

    p = sub.add_parser("correctness", help="graphfuse vs eager DDP + AdamW: losses and optimizer state per rank")
    common(p, steps=50, warmup=0)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p = sub.add_parser("comm", help="busbw of the in-step reduce-scatters/all-gathers vs the same collectives alone")
    common(p, steps=5, warmup=3)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 64.0, 256.0])
    p.add_argument("--iters", type=int, default=20, help="collectives issued alone per size")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: bf16 params + fp32 master (fp32 reduce-scatter)",
    )
    p = sub.add_parser("step", help="tokens/s, peak memory and exposed communication vs DDP+ZeRO and FSDP2")
    common(p, steps=20, warmup=3)
    p.add_argument("--models", nargs="+", choices=["gpt2-small", "1b"], default=["gpt2-small", "1b"])
    p.add_argument("--bucket-mb", type=float, default=64.0, help="graphfuse's bucket size and DDP's bucket_cap_mb")
    p.add_argument("--profile-steps", type=int, default=3)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (inherited by the ranks)
    args = parse(argv)
    where = machine(args.device, collectives=True)
    t0 = time.perf_counter()
    results = run_ranks(args)
    rows, tables = REPORTS[args.cmd](args, results, where)
    record = {
        "bench": f"multigpu.{args.cmd}",
        "device": args.device,
        "world_size": args.world_size,
        "machine": where,
        "backend": backend_of(args),
        "compile": compile_mode(args),
        "wall_s": time.perf_counter() - t0,
        "config": vars(args),
        "results": rows,
    }
    print_report(tables, record, width=200)


if __name__ == "__main__":
    main()
