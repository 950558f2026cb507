"""graphfuse (eager executor and inductor) beside eager PyTorch (foreach=False and fused AdamW)
and torch.compile, trained in lockstep on the same GPT, batches and initial weights.

    python tools/numerics.py --device cuda --size small --precisions fp32 tf32 amp bf16master \\
        --batch 8 --seeds 0 1 2 --steps 50
    python tools/numerics.py --device cpu --size tiny --steps 10      # a smoke run

The reference is eager PyTorch with AdamW(foreach=False). Per configuration it prints the
max |loss - reference| of every method (over the first --check-step steps and over all), the
parameters with the largest differences after step --check-step, and how many elements lie more
than 1.5 * lr away from the reference (Adam moves an element by about lr per step, so such
elements moved the wrong way: the signature of a wrong gradient, or of rounding where a
gradient is near zero). The verdict compares graphfuse's divergence with torch.compile's in
the same run. The last line of stdout is one JSON object.

Precisions: fp32 (TF32 off), tf32 (TF32 matmuls), amp (fp32 parameters, bf16 autocast in the
loss), bf16master (bf16 parameters; graphfuse keeps fp32 master shards; every peer keeps fp32
master copies updated by AdamW from fp32 gradients and copied back into the bf16 model).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from _bench import machine, torch_step  # tools/_bench.py: what the benches share
from rich.console import Console
from rich.table import Table

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, synthetic_tokens

LR, WD = 3e-4, 0.1
SIZES = {  # n_layer, n_head, n_embd, vocab, block
    "tiny": (2, 2, 64, 256, 32),
    "small": (12, 12, 768, 50304, 1024),
}
METHODS = ["gf_eager", "gf_inductor", "torch_fused", "torch_compile"]


@dataclass
class Runner:
    """One way of training: `step(batch) -> loss`, and the model whose parameters it trains."""

    name: str
    model: torch.nn.Module
    step: Callable
    losses: list[float] = field(default_factory=list)


def loss_fn_for(precision: str, device: str) -> Callable:
    def loss_fn(model, batch):
        idx, tgt = batch
        if precision == "amp":
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = model(idx)
        else:
            logits = model(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    return loss_fn


def torch_runner(
    name: str, base: torch.nn.Module, loss_fn: Callable, master: bool, fused: bool, compiled: bool
) -> Runner:
    model = copy.deepcopy(base)
    kw = {"fused": True} if fused else {"foreach": False}
    masters = [p.detach().float().requires_grad_() for p in model.parameters()] if master else None
    opt = torch.optim.AdamW(masters if master else model.parameters(), lr=LR, weight_decay=WD, **kw)
    forward = torch.compile(model) if compiled else model
    return Runner(name, model, torch_step(model, forward, opt, loss_fn, masters))


def graphfuse_runner(
    name: str, base: torch.nn.Module, loss_fn: Callable, master: bool, compile_mode: str, batch
) -> Runner:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    strategy = gf.Strategy(compile=compile_mode, master_dtype=torch.float32 if master else None)
    dm = gf.compile(model, opt, loss_fn, batch, strategy=strategy)
    return Runner(name, model, dm)


def make_runners(methods: list[str], base, loss_fn, master: bool, batch) -> list[Runner]:
    made = {
        "gf_eager": lambda: graphfuse_runner("gf_eager", base, loss_fn, master, "eager", batch),
        "gf_inductor": lambda: graphfuse_runner("gf_inductor", base, loss_fn, master, "inductor", batch),
        "torch_fused": lambda: torch_runner("torch_fused", base, loss_fn, master, fused=True, compiled=False),
        "torch_compile": lambda: torch_runner("torch_compile", base, loss_fn, master, fused=True, compiled=True),
    }
    return [torch_runner("eager", base, loss_fn, master, fused=False, compiled=False)] + [made[m]() for m in methods]


def param_report(runner: Runner, ref: Runner, top: int) -> dict:
    ref_params = dict(ref.model.named_parameters())
    rows = []
    for n, p in runner.model.named_parameters():
        d = (p.detach().double() - ref_params[n].detach().double()).abs()
        rows.append({"param": n, "max": d.max().item(), "wrong_way": int((d > 1.5 * LR).sum()), "numel": p.numel()})
    rows.sort(key=lambda r: -r["max"])
    return {"max": rows[0]["max"], "wrong_way": sum(r["wrong_way"] for r in rows), "top": rows[:top]}


def run_config(args, precision: str, seed: int) -> dict:
    device = args.device
    tf32 = precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch._dynamo.reset()
    layers, heads, embd, vocab, block = SIZES[args.size]
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=layers, n_head=heads, n_embd=embd)
    torch.manual_seed(seed)
    base = GPT(cfg).to(device)
    master = precision == "bf16master"
    if master:
        base = base.to(torch.bfloat16)
    batches = [tuple(t.to(device) for t in b) for b in synthetic_tokens(cfg, args.batch, args.steps, seed=seed)]
    loss_fn = loss_fn_for(precision, "cuda" if device == "cuda" else "cpu")
    runners = make_runners(args.methods, base, loss_fn, master, batches[0])
    ref, early = runners[0], {}
    for i, b in enumerate(batches):
        for r in runners:
            r.losses.append(float(r.step(b)))
        if i + 1 == args.check_step:
            early = {r.name: param_report(r, ref, args.top) for r in runners[1:]}
    result = {
        "precision": precision,
        "seed": seed,
        "batch": args.batch,
        "steps": args.steps,
        "check_step": args.check_step,
        "methods": {},
    }
    for r in runners[1:]:
        diffs = [a - b for a, b in zip(r.losses, ref.losses)]
        result["methods"][r.name] = {
            "max_loss_diff": max(abs(d) for d in diffs),
            "max_loss_diff_early": max(abs(d) for d in diffs[: args.check_step]),
            "loss_diffs": diffs,
            "early": early.get(r.name),
            **param_report(r, ref, args.top),
        }
    peer = result["methods"].get("torch_compile")
    for name in ("gf_eager", "gf_inductor"):
        m = result["methods"].get(name)
        if m is not None and peer is not None:
            m["verdict"] = verdict(m, peer)
    return result


def verdict(m: dict, peer: dict) -> str:
    """ "ok" when graphfuse is no further from eager than torch.compile: in max |dloss| over all
    steps, and in elements moved the wrong way at the check step (before trajectories decorrelate)."""
    early_ok = m["early"] is None or peer["early"] is None or m["early"]["wrong_way"] <= peer["early"]["wrong_way"]
    return "ok" if m["max_loss_diff"] <= peer["max_loss_diff"] and early_ok else "WORSE"


def print_config(console: Console, result: dict) -> None:
    t = Table(
        title=f"{result['precision']}, seed {result['seed']}, batch {result['batch']}, {result['steps']} steps "
        f"(vs eager AdamW foreach=False)"
    )
    k = result["check_step"]
    for col in (
        "method",
        f"max |dloss| steps 1-{k}",
        "max |dloss| all",
        f"elems > 1.5 lr at step {k}",
        f"largest at step {k}: param max (wrong-way/numel)",
        "elems > 1.5 lr at end",
        "verdict vs torch.compile",
    ):
        t.add_column(col)
    for name, m in result["methods"].items():
        early = m["early"] or {"wrong_way": "", "top": []}
        top = ", ".join(f"{r['param']} {r['max']:.1e} ({r['wrong_way']}/{r['numel']})" for r in early["top"])
        t.add_row(
            name,
            f"{m['max_loss_diff_early']:.2e}",
            f"{m['max_loss_diff']:.2e}",
            str(early["wrong_way"]),
            top,
            str(m["wrong_way"]),
            m.get("verdict", ""),
        )
    console.print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--precisions", nargs="+", choices=["fp32", "tf32", "amp", "bf16master"], default=["fp32"])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=3, help="parameters listed per method")
    ap.add_argument(
        "--check-step",
        type=int,
        default=4,
        help="step after which parameters are compared element by element (a wrong gradient shows within a few "
        "steps; after a few dozen, every method's trajectory has decorrelated from eager's)",
    )
    ap.add_argument("--det", action="store_true", help="deterministic algorithms (uninitialised memory reads as NaN)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible")
    if args.det:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    console = Console(width=max(Console().width, 180))
    console.print(f"machine: {machine(args.device)}")
    results = []
    for precision in args.precisions:
        for seed in args.seeds:
            result = run_config(args, precision, seed)
            print_config(console, result)
            results.append(result)
    verdicts = [m["verdict"] for r in results for m in r["methods"].values() if "verdict" in m]
    summary = {
        "machine": machine(args.device),
        "args": vars(args),
        "results": results,
        "verdict": "ok" if all(v == "ok" for v in verdicts) else "WORSE",
    }
    console.print(
        f"verdict: {summary['verdict']} ({verdicts.count('ok')} of {len(verdicts)} graphfuse runs no further "
        f"from eager than torch.compile)"
    )
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
