"""Start-up of a GPT step: gf.compile's phases and the first step (inductor compile and run),
then a restart from the saved program file in a fresh process with the same inductor cache
directory, and, for comparison, torch.compile(model) + fused AdamW to its first step (with an
empty inductor cache of its own). Each start also reports torch's own compile phases
(`dynamo_timed`: scheduler, code generation, kernel compiles awaited).

    python tools/bench_startup.py --device cpu --layers 2 --embd 64 --heads 4 --block 32 --vocab 256 --batch 2
    python tools/bench_startup.py --device cuda --layers 12 --embd 768 --heads 12 --block 1024 --vocab 50304 --batch 8
    python tools/bench_startup.py --device cuda ... --precision bf16master   # the precisions of tools/bench_step.py

`--compile-workers N` compiles graphfuse's step in N + 1 pieces by as many processes
(Strategy.compile_workers; default "auto", as the Strategy's: by the machine's cores). Each
start's graphfuse log (its phases, and which process compiled which piece) is printed under it.

Run where torch has its bytecode (a normal install does): where Python writes none and torch
came without it, every process compiles torch's sources again, and compile workers, whose
imports are timed, start seconds late. The script says so when it sees it; `--pycache DIR`
writes the bytecode once into DIR first and lets every start use it.

`--at-once R` runs R copies of each start at the same time, each with an inductor cache of its
own: as R ranks of one host compile their steps at once, sharing its cores (each copy at world
size 1, so their graphs hold no collectives, and here they share the one GPU too).

`--profile DIR` writes each start's costliest calls (cProfile: 60 by cumulative time, 30 by own
time) to DIR/<start>.txt and the whole profile to DIR/<start>.prof (pstats, snakeviz).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import subprocess
import sys
import tempfile
import time

import torch
from _bench import sync  # tools/_bench.py: what the benches share


def setup(args):
    from graphfuse.testing.models import GPT, GPTConfig, synthetic_tokens

    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd
    )
    torch.manual_seed(0)
    model = GPT(cfg).to(args.device, torch.bfloat16 if args.precision == "bf16master" else torch.float32)
    kw = {"fused": True} if args.device == "cuda" else {"foreach": False}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **kw)
    batch = tuple(x.to(args.device) for x in synthetic_tokens(cfg, args.batch, 1, seed=0)[0])
    return model, opt, batch


def workers_arg(text: str) -> int | str:
    """--compile-workers: an int, or "auto" (Strategy.compile_workers)."""
    return text if text == "auto" else int(text)


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    """--device and the GPT's shape, as `setup` reads them."""
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    for flag, default in (("layers", 2), ("embd", 64), ("heads", 4), ("block", 32), ("vocab", 256), ("batch", 2)):
        ap.add_argument(f"--{flag}", type=int, default=default)


def profiled(args) -> dict:
    """`run(args)`, under cProfile when --profile is given."""
    if not args.profile:
        return run(args)
    prof = cProfile.Profile()
    result = prof.runcall(run, args)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(30)
    os.makedirs(args.profile, exist_ok=True)
    prof.dump_stats(os.path.join(args.profile, f"{args.start}.prof"))  # for snakeviz / pstats
    with open(os.path.join(args.profile, f"{args.start}.txt"), "w") as f:
        f.write(text.getvalue())
    return result


def run(args) -> dict:
    """One start in this process: `fresh` (gf.compile, saves the program), `restart` (from the
    program file) or `torch_compile`."""
    from bench_step import compiled_step, loss_for  # the step benchmark's precisions, and its torch.compile peer

    import graphfuse as gf

    model, opt, batch = setup(args)
    loss_fn = loss_for(args.precision, torch.device(args.device))
    t = time.perf_counter()
    if args.start == "torch_compile":
        compiled_step(model, torch.device(args.device), args.precision == "bf16master", loss_fn)(batch)
        sync(args.device)
        return {"start": args.start, "total_s": time.perf_counter() - t, "inductor_s": inductor_times()}
    if args.start == "fresh":
        dm = gf.compile(model, opt, loss_fn, batch, strategy(args))
        gf.save_program(dm.program, args.program)
    else:
        dm = gf.DistModel.from_program(gf.load_program(args.program), model, opt)
    dm(batch)
    sync(args.device)
    return {
        "start": args.start,
        "total_s": time.perf_counter() - t,
        "phases_s": dict(dm.startup),
        "inductor_s": inductor_times(),
    }


def strategy(args):
    import graphfuse as gf

    align = (
        {}
        if args.align_blocks is None
        else {"align_buckets_to_blocks": {"true": True, "false": False}.get(args.align_blocks, "auto")}
    )
    master = {"master_dtype": torch.float32} if args.precision == "bf16master" else {}
    return gf.Strategy(
        compile="inductor", bucket_size_mb=args.bucket_mb, compile_workers=args.compile_workers, **align, **master
    )


def inductor_times() -> dict[str, float]:
    """Seconds in each of torch's `dynamo_timed` compile phases (scheduler, code generation,
    waiting for kernel compiles, ...), summed over the graphs compiled in this process."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: round(sum(values), 3) for name, values in compilation_time_metrics.items()}


def child_argv(argv: list[str]) -> list[str]:
    """This command line without --start/--starts and their values: each child gets its own."""
    out, skipping = [], False
    for a in argv:
        if a.startswith("--start"):
            skipping = "=" not in a
            continue
        if skipping and not a.startswith("-"):
            continue
        skipping = False
        out.append(a)
    return out


def bytecode_note() -> str | None:
    """Why starts may be slower here than on a normal install: Python may not write bytecode
    and torch came without it, so every process compiles torch's sources again (seconds per
    process; measured on the GPU machine, docs/benchmarks.md)."""
    from pathlib import Path

    if (
        not sys.flags.dont_write_bytecode
        or sys.pycache_prefix
        or (Path(torch.__file__).parent / "__pycache__").is_dir()
    ):
        return None
    return (
        "note: Python writes no bytecode here (PYTHONDONTWRITEBYTECODE) and torch is installed without it, so every "
        "process compiles torch's sources again: compile workers start seconds later than on a normal install, and "
        "modules imported during a start are compiled in it. For numbers like a normal install's, run again "
        "with --pycache /tmp/pyc"
    )


def with_bytecode(where: str) -> dict:
    """The environment for starts that read and write bytecode under `where`, after writing it
    there for torch, triton (where installed) and graphfuse, so that no start pays for it."""
    import importlib.util

    import graphfuse.passes

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = os.path.abspath(where)
    roots = [os.path.dirname(m.__file__) for m in (torch, graphfuse, graphfuse.passes)]  # passes/ lives apart
    if (spec := importlib.util.find_spec("triton")) and spec.origin:
        roots.append(os.path.dirname(spec.origin))
    t = time.perf_counter()
    print(f"writing bytecode into {env['PYTHONPYCACHEPREFIX']} for {', '.join(roots)} ...", flush=True)
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *roots], env=env, check=False, stdout=subprocess.DEVNULL
    )
    print(f"bytecode written in {time.perf_counter() - t:.1f} s", flush=True)
    return env


def print_row(r: dict) -> None:
    from graphfuse.compiler import PHASES  # torch's compile phases that do not contain one another

    phases = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phases_s", {}).items())
    print(f"{r['start']:14} {r['total_s']:7.2f} s   {phases}")
    leaves = ", ".join(f"{k} {r['inductor_s'][k]:.2f}" for k in PHASES if k in r["inductor_s"])
    print(f"{'':14} of which in torch: {leaves}")
    for line in r.get("log", []):
        print(f"{'':14} {line}")
    sys.stdout.flush()


def launch(args, base_env: dict, work: str, start: str, copy: int) -> tuple[subprocess.Popen, str]:
    """Start `start` in a new process: copy `copy` of --at-once, with an inductor cache and a
    program file of its own (a copy's restart reads what its fresh start wrote). Its output goes
    to files (pipes left unread while another copy is waited for could fill and stall it)."""
    cache = (args.cache_dir or os.path.join(work, "cache")) + (f"-{copy}" if args.at_once > 1 else "")
    # torch.compile gets an empty cache of its own: in graphfuse's it would find the Triton
    # kernels the fresh start compiled for the same shapes, and start faster than it can.
    env = {**base_env, "TORCHINDUCTOR_CACHE_DIR": cache + ("-torch-compile" if start == "torch_compile" else "")}
    program = os.path.join(work, f"program-{copy}")
    cmd = [sys.executable, __file__, *child_argv(sys.argv[1:]), f"--start={start}", f"--program={program}"]
    out = os.path.join(work, f"{start}-{copy}")
    with open(out + ".out", "w") as stdout, open(out + ".err", "w") as stderr:
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=True), out


def collect(child: subprocess.Popen, out: str, start: str, deadline: float | None) -> dict | None:
    """The row a start printed, with its graphfuse log; None (said, with its last output) when
    it failed or ran past the `deadline` (time.monotonic()), so that the other starts still report."""
    try:
        child.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    with open(out + ".out") as f_out, open(out + ".err") as f_err:
        stdout, stderr = f_out.read(), f_err.read()
    if child.returncode != 0:
        why = "ran past --timeout" if child.returncode < 0 else f"exit status {child.returncode}"
        print(f"{start:14} FAILED: {why}; its last output:\n{stderr[-4000:]}", flush=True)
        return None
    row = json.loads(stdout.strip().splitlines()[-1])
    row["log"] = [line for line in stderr.splitlines() if line.startswith("graphfuse")]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(ap)
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="Strategy.bucket_size_mb (its default: 256)")
    ap.add_argument(
        "--align-blocks",
        nargs="?",
        choices=["true", "false", "auto"],
        const="true",
        default=None,
        help="Strategy.align_buckets_to_blocks (the flag alone: true; absent: the Strategy default)",
    )
    ap.add_argument(
        "--precision",
        choices=["fp32", "amp", "bf16master"],
        default="fp32",
        help="as tools/bench_step.py: fp32 (TF32 matmuls), amp (bf16 autocast forward), bf16master (bf16 "
        "parameters, fp32 master weights)",
    )
    ap.add_argument(
        "--compile-workers",
        type=workers_arg,
        default="auto",
        help="Strategy.compile_workers: processes besides the main one, or 'auto' (the default: by the cores)",
    )
    ap.add_argument("--start", choices=["all", "fresh", "restart", "torch_compile"], default="all")
    ap.add_argument(
        "--starts",
        nargs="+",
        choices=["fresh", "restart", "torch_compile"],
        default=["fresh", "restart", "torch_compile"],
        help="which starts to run (restart needs fresh)",
    )
    ap.add_argument("--program", help="program file (internal)")
    ap.add_argument("--cache-dir", help="inductor cache directory (default: a new empty one)")
    ap.add_argument("--profile", help="directory for each start's cProfile summary")
    ap.add_argument("--timeout", type=float, default=None, help="seconds each start may take (default: no limit)")
    ap.add_argument(
        "--at-once",
        type=int,
        default=1,
        help="run this many copies of each start at the same time, each "
        "with its own cache and program (as the ranks of one host compile at once, sharing its cores)",
    )
    ap.add_argument(
        "--pycache",
        help="write Python bytecode for torch, triton and graphfuse into this directory first, "
        "and let every start use it (PYTHONPYCACHEPREFIX), as on a normal install (see bytecode_note)",
    )
    args = ap.parse_args()
    if args.start in ("fresh", "restart") and not args.program:
        ap.error(
            f"--start {args.start} needs --program PATH: the program file the fresh start writes and a restart reads"
        )
    if args.start != "all":
        logging.basicConfig(format="%(message)s")  # graphfuse's start-up log, shown by the parent
        logging.getLogger("graphfuse").setLevel(logging.INFO)
        print(json.dumps(profiled(args)))
        return
    if "restart" in args.starts and "fresh" not in args.starts:
        ap.error("--starts restart needs fresh too: a restart reads the program file the fresh start writes")
    if args.at_once < 1:
        ap.error(f"--at-once takes a number of copies >= 1, got {args.at_once}")
    base_env = with_bytecode(args.pycache) if args.pycache else dict(os.environ)
    if not args.pycache and (note := bytecode_note()):
        print(note, flush=True)
    work = tempfile.mkdtemp(prefix="graphfuse-startup-")
    rows = []
    for start in args.starts:  # each in a fresh process: imports and caches as at a real start
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        children = [launch(args, base_env, work, start, i) for i in range(args.at_once)]
        for i, (child, out) in enumerate(children):
            if (row := collect(child, out, start, deadline)) is not None:
                rows.append({**row, "copy": i})
                print_row(rows[-1])  # at once: a later start that hangs does not hide this one
        if args.at_once > 1 and (done := [r["total_s"] for r in rows if r["start"] == start]):
            print(f"{start:14} {max(done):7.2f} s   the slowest of {len(done)} copies at once", flush=True)
    print(
        json.dumps(
            {"bench": "startup", "device": args.device, "torch": torch.__version__, "config": vars(args), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
