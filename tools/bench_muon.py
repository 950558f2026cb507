"""Muon under ZeRO-1 (issue 32): graphfuse's step with Muon on the block matrices and AdamW on the
rest, against graphfuse's own AdamW step and torch's rows in one run (GPT-2 small, bf16
autocast, batch 8 x 1024): torch.compile(model + loss) with fused AdamW, the same with
torch.optim.Muon + fused AdamW, the same with torch.compile(muon.step), and that with CUDA graphs
(mode="reduce-overhead"). torch's steps are timed twice: as a user's loop
runs them (no synchronize inside: the host queues the optimizer's kernels while the GPU runs the
backward), and, in steps of their own, with a synchronize before the optimizer, as
../shared/repro/gpu_muon_baseline.py (the issue's table) times them; those give the optimizer's
own ms. Then the plan at
`--plan-world` ranks, traced without a process group: each rank's update work (the
FLOPs flop_counter counts in its traced update, plus its elements; the busiest against the mean)
and the padding whole-matrix ownership adds, as a share of bucket bytes; with
`--plan-optimizer adafactor` or `adafactor_all`, the plan of Adafactor on the block matrices or
on every parameter instead of Muon. Each method's row is also printed as a JSON line as soon as
it is done (`{"partial": "bench_muon", ...}`), so that a run cut off keeps what it measured.

    python tools/bench_muon.py                      # CUDA: all methods, then the plan at 8 ranks
    python tools/bench_muon.py --plan-only          # any machine: the plan only
    python tools/bench_muon.py --plan-only --plan-world 64 --plan-optimizer adafactor_all
    python tools/bench_muon.py --layers 2 --embd 128 --heads 4 --block 128 --batch 2 --vocab 512 --steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.nn.functional as F
from _bench import gpt2_small_args, machine, print_report, sync  # tools/_bench.py: what the benches share

import graphfuse as gf
from graphfuse.cli.facts import ownership_facts
from graphfuse.passes import run_pipeline
from graphfuse.testing.models import GPT, GPTConfig, synthetic_tokens

METHODS = [
    "graphfuse_adamw",
    "graphfuse_muon",
    "graphfuse_adamw_cudagraphs",
    "graphfuse_muon_cudagraphs",
    "torch_compile_adamw",
    "torch_compile_muon",
    "torch_compile_muon_compiled",
    "torch_compile_muon_compiled_cudagraphs",
]


def is_matrix(name: str, p: torch.Tensor) -> bool:
    """The baseline's split: the blocks' 2-D weights under Muon, everything else under AdamW."""
    return p.ndim == 2 and name.startswith("blocks.")


PLANS = ("muon", "adafactor", "adafactor_all")  # --plan-optimizer: what is updated whole in the plan


def optimizers(model: torch.nn.Module, method: str, fused: bool) -> list[torch.optim.Optimizer]:
    kw = {"fused": True} if fused else {"foreach": False}
    if "adamw" in method:
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **kw)]
    mats = [p for n, p in model.named_parameters() if is_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if not is_matrix(n, p)]
    if method == "adafactor_all":  # every parameter, the embeddings too
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    if method == "adafactor":
        return [torch.optim.Adafactor(mats, lr=1e-2), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1, **kw)]
    return [
        torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1, **kw),
    ]


def loss_fn(model, batch):
    idx, tgt = batch
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=idx.is_cuda):
        logits = model(idx)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def make_step(method: str, model: torch.nn.Module, example, device: torch.device):
    """`(step(batch) -> loss, optimizer seconds of the last step or None)` for the method."""
    opts = optimizers(model, method, fused=device.type == "cuda")
    if method.startswith("graphfuse"):
        dm = gf.compile(
            model,
            opts if len(opts) > 1 else opts[0],
            loss_fn,
            example,
            strategy=gf.Strategy(
                compile="inductor" if device.type == "cuda" else "eager", cuda_graphs=method.endswith("cudagraphs")
            ),
        )
        return dm, lambda: None
    # The loss inside the compiled region: the peer's best case; "_cudagraphs": CUDA graphs too (mode="reduce-overhead"
    # for model + loss and for Muon's compiled step), as graphfuse's cuda_graphs rows.
    graphs = method.endswith("_cudagraphs")
    mode = "reduce-overhead" if graphs else None
    closs = torch.compile(lambda b: loss_fn(model, b), mode=mode)
    steps = [o.step for o in opts]
    if method.startswith("torch_compile_muon_compiled"):
        steps[0] = torch.compile(opts[0].step, mode=mode)
    last = {}

    def step(b, time_optimizer: bool = False):
        # The timed steps run as a user's loop does, with no synchronize in them: the host queues the
        # optimizer's kernels while the GPU still runs the backward. Only the steps that time the
        # optimizer apart (`time_optimizer`) wait for the backward first.
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = closs(b)
        loss.backward()
        if time_optimizer:
            sync(device)
            t = time.perf_counter()
        for s in steps:
            s()
        if time_optimizer:
            sync(device)
            last["opt"] = time.perf_counter() - t
        for o in opts:
            o.zero_grad(set_to_none=True)
        return loss

    return step, lambda: last.get("opt")


def time_method(method: str, cfg: GPTConfig, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    batches = [
        tuple(x.to(device) for x in b) for b in synthetic_tokens(cfg, args.batch, args.warmup + args.steps, seed=0)
    ]
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step, opt_s = make_step(method, model, batches[0], device)
    times, opt_times, first = [], [], None
    for i, b in enumerate(batches):
        sync(device)
        t = time.perf_counter()
        loss = step(b)
        sync(device)
        if i == 0:
            first = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    loss_last = loss.item()  # before the steps below: a CUDA graph's replay writes its loss into the same memory
    # torch's rows again, with a synchronize before the optimizer (as ../shared/repro's baseline times its steps):
    # the optimizer's own time, and the step timed that way
    synced = []
    if not method.startswith("graphfuse"):
        for b in batches[args.warmup :]:
            sync(device)
            t = time.perf_counter()
            step(b, time_optimizer=True)
            sync(device)
            synced.append(time.perf_counter() - t)
            opt_times.append(opt_s())
    top = kernels(step, batches[-3:]) if args.profile and device.type == "cuda" else None
    return {
        "top_kernels_ms": top,
        "step_ms": 1e3 * statistics.median(times),
        "optimizer_ms": 1e3 * statistics.median(opt_times) if opt_times else None,
        "step_ms_synchronized_before_optimizer": 1e3 * statistics.median(synced) if synced else None,
        "first_step_s": first,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "loss_last": loss_last,
    }


def kernels(step, batches: list, top: int = 15) -> list:
    """The `top` CUDA kernels by GPU milliseconds per step over `batches`, and the step's total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches:
            step(b)
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.device_time / 1e3 / len(batches)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
    return [("all kernels", sum(by_name.values()))] + ranked[:top]


def plan(cfg: GPTConfig, world: int, batch: int, updated_whole: str = "muon") -> dict:
    """The layout at `world` ranks (planning needs no group): per bucket laid out whole and rank,
    the owned parameters' update cost (tracing.whole_cost: FLOPs counted plus elements); busiest / mean;
    padding over all buckets' bytes, and the buckets' elements over the parameters'.
    `updated_whole` (PLANS): Muon on the block matrices, Adafactor on them, or on every parameter."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight  # to_empty made each its own Parameter: tie them again, as GPT does
    example = synthetic_tokens(cfg, batch, 1, seed=0)[0]
    program = gf.capture(model, optimizers(model, updated_whole, fused=False), loss_fn, example, gf.Strategy())
    program = run_pipeline(program.with_(world_size=world, rank=0, group_name="plan"))
    facts = ownership_facts(program)
    cost = [0] * world
    for f in facts:
        cost[f["rank"]] += f["cost"]
    buckets = program.bucket_layout.buckets
    muon = {f["bucket"] for f in facts}
    padding = sum(f["padding"] for f in facts)
    total = sum(b.shard_size * b.world_size for b in buckets)
    muon_total = sum(b.shard_size * b.world_size for b in buckets if b.name in muon)
    return {
        "world_size": world,
        "updated_whole": updated_whole,
        "matrices": sum(len(f["params"]) for f in facts),
        "buckets_over_parameters": total / sum(p.numel() for p in model.parameters()),
        "cost_per_rank": cost,
        "busiest_over_mean": max(cost) / (sum(cost) / world),
        "padding_elements": padding,
        "padding_share_of_all_buckets": padding / total,
        "padding_share_of_muon_buckets": padding / muon_total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    ap.add_argument("--plan-only", action="store_true", help="only the plan at --plan-world ranks (no timing)")
    ap.add_argument("--plan-world", type=int, default=8)
    ap.add_argument("--plan-optimizer", choices=PLANS, default="muon", help="what the plan updates whole")
    ap.add_argument(
        "--profile", action="store_true", help="CUDA: each method's top kernels over 3 steps, in the record"
    )
    gpt2_small_args(ap)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="timed steps (median)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd
    )
    rows = {}
    for method in [] if args.plan_only else args.methods:
        try:
            rows[method] = time_method(method, cfg, args, device)
        except Exception as e:  # one method failing (a peer's mode on this torch) keeps the others' rows
            rows[method] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        # each row as it is done, so that a run cut off (a device's time limit) keeps the rows before
        print(json.dumps({"partial": "bench_muon", "method": method, "result": rows[method]}), flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    layout = plan(cfg, args.plan_world, args.batch, args.plan_optimizer)

    from rich.table import Table

    where = machine(device.type)
    shape = f"GPT {args.layers}x{args.embd}, vocab {args.vocab}, batch {args.batch}x{args.block}"
    table = Table(title=f"Muon + AdamW vs AdamW, {shape}, bf16 autocast ({where})")
    for col in (
        "method",
        "step ms",
        "step ms, sync before opt.",
        "optimizer ms",
        "first step s",
        "peak GiB",
        "last loss",
    ):
        table.add_column(col)
    for name, r in rows.items():
        if "error" in r:
            table.add_row(name, "failed: " + r["error"][:60], "-", "-", "-", "-", "-")
            continue
        table.add_row(
            name,
            f"{r['step_ms']:.2f}",
            "-"
            if r["step_ms_synchronized_before_optimizer"] is None
            else f"{r['step_ms_synchronized_before_optimizer']:.2f}",
            "-" if r["optimizer_ms"] is None else f"{r['optimizer_ms']:.2f}",
            f"{r['first_step_s']:.1f}",
            "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
            f"{r['loss_last']:.4f}",
        )
    ratios = {}
    rows_ok = {m: r for m, r in rows.items() if "error" not in r}
    if {"graphfuse_muon", "graphfuse_adamw"} <= rows_ok.keys():
        ratios["muon_over_adamw_graphfuse"] = rows["graphfuse_muon"]["step_ms"] / rows["graphfuse_adamw"]["step_ms"]
    if {"graphfuse_muon_cudagraphs", "graphfuse_adamw_cudagraphs"} <= rows_ok.keys():
        ratios["muon_over_adamw_graphfuse_cudagraphs"] = (
            rows["graphfuse_muon_cudagraphs"]["step_ms"] / rows["graphfuse_adamw_cudagraphs"]["step_ms"]
        )
    for ours, theirs in (
        ("graphfuse_muon", "torch_compile_muon_compiled"),
        ("graphfuse_muon", "torch_compile_muon_compiled_cudagraphs"),
        ("graphfuse_muon_cudagraphs", "torch_compile_muon_compiled"),
        ("graphfuse_muon_cudagraphs", "torch_compile_muon_compiled_cudagraphs"),
    ):
        if {ours, theirs} <= rows_ok.keys():
            ratios[f"{ours}_speedup_vs_{theirs}"] = rows[theirs]["step_ms"] / rows[ours]["step_ms"]
            # against the peer's steps timed as the baseline times them (a synchronize before its optimizer)
            ratios[f"{ours}_speedup_vs_{theirs}_synchronized"] = (
                rows[theirs]["step_ms_synchronized_before_optimizer"] / rows[ours]["step_ms"]
            )
    owned = Table(
        title=f"Whole-matrix ownership at {layout['world_size']} ranks, {args.plan_optimizer} (traced, no group)"
    )
    for col in ("updated whole", "busiest / mean update cost", "padding, share of bucket bytes", "buckets / params"):
        owned.add_column(col)
    owned.add_row(
        str(layout["matrices"]),
        f"{layout['busiest_over_mean']:.3f}",
        f"{100 * layout['padding_share_of_all_buckets']:.2f}%",
        f"{layout['buckets_over_parameters']:.3f}",
    )
    record = {"bench": "bench_muon", "device": device.type, "machine": where, "config": vars(args)}
    print_report([table, owned] if rows else [owned], record | {"results": rows, "ratios": ratios, "plan": layout})


if __name__ == "__main__":
    main()
