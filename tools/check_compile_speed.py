"""Check graphfuse.compiler.inductor.COMPILE_SPEED on a GPT step: compile the step once with inductor's
defaults for those settings and once with graphfuse's, each in a fresh process with an empty
cache, and print the scheduler's time and whether the generated code is the same.

    python tools/check_compile_speed.py --device cuda --layers 12 --embd 768 --heads 12 --block 1024 --vocab 50304
    --batch 8
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
from pathlib import Path

import torch
from bench_startup import add_model_flags, setup  # the same GPT, optimizer and batch as the start-up bench

from graphfuse.analysis import output_modules


def one(args) -> dict:
    """One compile in this process, with COMPILE_SPEED as graphfuse has it or emptied."""
    import graphfuse as gf
    from graphfuse.compiler import use_inductor_defaults
    from graphfuse.testing.models import gpt_loss

    if args.variant == "default":
        use_inductor_defaults("COMPILE_SPEED")
    model, opt, batch = setup(args)
    t = time.perf_counter()
    dm = gf.compile(model, opt, gpt_loss, batch, gf.Strategy(compile="inductor"))
    dm(batch)
    if args.device == "cuda":
        torch.cuda.synchronize()
    from torch._dynamo.utils import compilation_time_metrics as m

    modules = output_modules(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    code = re.sub(r"#.*", "", modules[-1].read_text()) if modules else ""  # comments name source nodes and cache paths
    return {
        "variant": args.variant,
        "total_s": time.perf_counter() - t,
        "scheduler_s": sum(m.get("Scheduler.__init__", [0.0])),
        "code_sha1": hashlib.sha1(code.encode()).hexdigest() if code else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(ap)
    ap.add_argument("--variant", choices=["default", "graphfuse"], help="(internal) one compile in this process")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(one(args)))
        return
    rows = []
    for variant in ("default", "graphfuse"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="graphfuse-compile-speed-")}
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], f"--variant={variant}"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for r in rows:
        print(
            f"{r['variant']:10} to the first step {r['total_s']:6.2f} s, Scheduler.__init__ "
            f"{r['scheduler_s']:5.2f} s, code {r['code_sha1']}"
        )
    same = rows[0]["code_sha1"] is not None and rows[0]["code_sha1"] == rows[1]["code_sha1"]
    print("same generated code" if same else "the generated code DIFFERS")
    print(
        json.dumps(
            {
                "bench": "compile_speed",
                "device": args.device,
                "torch": torch.__version__,
                "rows": rows,
                "same_code": same,
            }
        )
    )
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
