"""The first step's autotuning, and the step time after it: graphfuse with its inductor settings
(graphfuse.compiler.inductor.FIRST_STEP), graphfuse with inductor's defaults for them, and
torch.compile(model) + fused AdamW, each in a fresh process with an empty inductor cache.

At a Triton kernel's first launch inductor times each of its launch configurations and keeps
the fastest; this reports how many kernels were timed and for how long (the time spent in
`CachingAutotuner.benchmark_all_configs`), how many distinct kernels that is once numeric
constants such as a parameter's offset in its bucket are set aside, then the step time over
`--steps` steps and the peak memory. CUDA only.

    python tools/bench_first_step.py --layers 12 --embd 768 --heads 12 --block 1024 --vocab 50304 --batch 8
    --precision amp
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

# the start-up bench's GPT, optimizer, batch and Strategy
from bench_startup import add_model_flags, setup, strategy, workers_arg
from bench_step import compiled_step, loss_for  # the step bench's precisions, and its torch.compile peer

VARIANTS = ("graphfuse", "graphfuse_autotuned", "torch_compile")


def timed_autotuning() -> list[dict]:
    """Record every kernel's timing of its launch configurations from now on: its name, the
    configurations timed, the seconds it took, its source with numbers set aside."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    records: list[dict] = []
    timed = CachingAutotuner.benchmark_all_configs

    def recorded(self, *args, **kwargs):
        t = time.perf_counter()
        timings = timed(self, *args, **kwargs)
        records.append(
            {
                "kernel": self.fn.__name__,
                "configs": len(timings),
                "s": time.perf_counter() - t,
                "shape": _source_shape(getattr(self, "filename", None), self.fn.__name__),
            }
        )
        return timings

    CachingAutotuner.benchmark_all_configs = recorded
    return records


def _source_shape(path: str | None, name: str) -> str | None:
    """A hash of the kernel's source with every number replaced: kernels that differ only in
    constants (a parameter's offset in its bucket) hash alike."""
    if not path or not os.path.exists(path):
        return None
    source = open(path).read()
    start = source.find(f"def {name}(")
    body = source[start:] if start >= 0 else source
    return hashlib.sha1(re.sub(r"\b\d+\b", "N", body).encode()).hexdigest()[:12]


def one(args) -> dict:
    """One variant in this process: compile, first step, then `args.steps` timed steps."""
    import graphfuse as gf
    from graphfuse.compiler import use_inductor_defaults

    if args.variant == "graphfuse_autotuned":
        use_inductor_defaults("FIRST_STEP")
    records = timed_autotuning()
    model, opt, batch = setup(args)
    device = torch.device("cuda")
    loss_fn = loss_for(args.precision, device)
    t = time.perf_counter()
    if args.variant == "torch_compile":
        step = compiled_step(model, device, args.precision == "bf16master", loss_fn)
    else:
        step = gf.compile(model, opt, loss_fn, batch, strategy(args))
    step(batch)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    for _ in range(args.warmup):
        step(batch)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        step(batch)
    end.record()
    torch.cuda.synchronize()
    return {
        "variant": args.variant,
        "to_first_step_s": round(first, 2),
        "autotune_s": round(sum(r["s"] for r in records), 2),
        "kernels_timed": len(records),
        "configs_timed": sum(r["configs"] for r in records),
        "distinct_apart_from_numbers": len({r["shape"] for r in records}),
        "ms_per_step": round(begin.elapsed_time(end) / args.steps, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "slowest": sorted(((round(r["s"], 3), r["configs"], r["kernel"]) for r in records), reverse=True)[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(ap)
    ap.add_argument("--precision", choices=["fp32", "amp", "bf16master"], default="fp32", help="as tools/bench_step.py")
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="Strategy.bucket_size_mb")
    ap.add_argument(
        "--compile-workers", type=workers_arg, default="auto", help="Strategy.compile_workers (an int, or 'auto')"
    )
    ap.add_argument("--steps", type=int, default=20, help="timed steps after the first")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps between the first and the timed ones")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="run in this order")
    ap.add_argument("--variant", choices=VARIANTS, help="(internal) one variant in this process")
    args = ap.parse_args()
    args.device, args.align_blocks = "cuda", None  # as bench_startup's setup and strategy read them
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: autotuning times Triton kernels")
    if args.variant:
        print(json.dumps(one(args)))
        return
    rows = []
    for variant in args.variants:  # each in a fresh process with an empty cache: a cold start's autotuning
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="graphfuse-first-step-")}
        done = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], f"--variant={variant}"], env=env, capture_output=True, text=True
        )
        if done.returncode:
            print(f"{variant:20} FAILED; its last output:\n{done.stderr[-3000:]}", flush=True)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{variant:20} to first step {r['to_first_step_s']:6.2f} s, autotuning {r['autotune_s']:5.2f} s "
            f"({r['kernels_timed']} kernels, {r['configs_timed']} configs, {r['distinct_apart_from_numbers']} "
            f"distinct apart "
            f"from numbers), {r['ms_per_step']:6.2f} ms/step, peak {r['peak_gib']:.2f} GiB",
            flush=True,
        )
    print(json.dumps({"bench": "first_step", "torch": torch.__version__, "config": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
