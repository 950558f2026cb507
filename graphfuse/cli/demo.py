"""`graphfuse demo`: train a small GPT on several ranks with graphfuse, check it against an
eager data-parallel run, save and reload both checkpoint modes, and print a short report;
it says what it is doing as it goes, and removes its temporary directory at the end."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import graphfuse as gf
from graphfuse.cli.args import CliFailure
from graphfuse.passes.graph import count_targets
from graphfuse.testing.launch import RankFailure, run_ranks
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens


def _optimizer(model: torch.nn.Module, **kw) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), **kw)


def _scheduler(opt: torch.optim.Optimizer, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))


def _fresh(cfg: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).to(device)


def _eager_reference(cfg, batches, device, warmup) -> list[float]:
    """Replicated model, gradients averaged with all_reduce, torch.optim.AdamW(foreach=False)."""
    model = _fresh(cfg, device)
    opt = _optimizer(model, foreach=False)
    sched = _scheduler(opt, warmup)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = gpt_loss(model, batch)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:  # every parameter of the demo's GPT has one, on every rank alike
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _graphfuse_run(cfg, batches, device, warmup, strategy, progress=None):
    model = _fresh(cfg, device)
    opt = _optimizer(model)
    sched = _scheduler(opt, warmup)
    dm = gf.compile(model, opt, gpt_loss, batches[0], strategy=strategy)
    return dm, opt, sched


def _say(rank: int, text: str) -> None:
    """Rank 0 says what it is doing, at once (the other ranks do the same work in step)."""
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _train(dm, sched, batches, on_step=None) -> tuple[list[float], list[float]]:
    """(losses, seconds of each step)."""
    losses, seconds = [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        losses.append(dm(batch).item())
        seconds.append(time.perf_counter() - t0)
        sched.step()
        if on_step:
            on_step(i, losses[-1])
    return losses, seconds


def _train_with_bar(rank: int, dm, sched, batches) -> tuple[list[float], list[float]]:
    if rank != 0:
        return _train(dm, sched, batches)
    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, refresh_per_second=10) as bar:
        task = bar.add_task("train", total=len(batches), loss=float("nan"))
        return _train(dm, sched, batches, lambda i, loss: bar.update(task, advance=1, loss=loss))


def _checkpoint_round_trips(rank, cfg, batches, device, warmup, strategy, losses, out_dir) -> dict[str, bool]:
    """For both modes: train half the steps, save, reload into a freshly built (differently
    initialised) model, replay the second half; whether the losses equal the first run's bit for bit."""
    half = len(batches) // 2
    results = {}
    for mode in ("unbalanced", "balanced"):
        path = os.path.join(out_dir, f"ckpt-{mode}")
        _say(rank, f"checkpoint {mode}: training {half} steps, saving to {path}")
        dm1, _, s1 = _graphfuse_run(cfg, batches, device, warmup, strategy)
        _train(dm1, s1, batches[:half])
        gf.save(dm1, path, mode=mode, extra={"scheduler": s1.state_dict()})
        _say(rank, f"checkpoint {mode}: loading into a freshly built model, resuming {len(batches) - half} steps")
        model2 = _fresh(cfg, device, seed=1)
        opt2 = _optimizer(model2)
        s2 = _scheduler(opt2, warmup)
        dm2 = gf.compile(model2, opt2, gpt_loss, batches[0], strategy=strategy)
        extra = gf.load(dm2, path)
        s2.load_state_dict(extra["scheduler"])
        resumed, _ = _train(dm2, s2, batches[half:])
        results[mode] = resumed == losses[half:]
    return results


def _rank_main(rank: int, world: int, args: argparse.Namespace, out_dir: str) -> dict | None:
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        # CUDA's atomic-add kernels (embedding backward) differ run to run by ~5e-7 (measured on
        # an H200); the bitwise resume check needs deterministic kernels.
        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=args.layers, n_head=4, n_embd=args.d_model)
    batches = [(x.to(device), y.to(device)) for x, y in synthetic_tokens(cfg, 8, args.steps, seed=1000 + rank)]
    warmup = max(1, args.steps // 5)
    strategy = gf.Strategy(bucket_size_mb=args.bucket_mb, compile=args.compile)

    _say(rank, f"{world} ranks up; eager data-parallel reference: {args.steps} steps")
    ref = _eager_reference(cfg, batches, device, warmup)
    _say(rank, "tracing the training step and rewriting it (gf.compile)")
    t0 = time.perf_counter()
    dm, opt, sched = _graphfuse_run(cfg, batches, device, warmup, strategy)
    trace_s = time.perf_counter() - t0
    if args.compile == "inductor":
        _say(rank, "the first step compiles the program with inductor (a minute or so on CPU)")
    losses, seconds = _train_with_bar(rank, dm, sched, batches)
    ckpt_results = _checkpoint_round_trips(rank, cfg, batches, device, warmup, strategy, losses, out_dir)

    local_state = sum(
        t.numel() * t.element_size() for n, t in dm.tensors.items() if "." in n and n.startswith("bucket")
    )
    states: list[int] = [0] * world  # all_gather_object fills in every rank's
    dist.all_gather_object(states, local_state)
    ckpt_ok: list[dict[str, bool]] = [{} for _ in range(world)]
    dist.all_gather_object(ckpt_ok, ckpt_results)
    if rank != 0:
        return None
    n_states = len(dm.program.optim.groups[0].state_names)
    counts = count_targets(dm.program)
    steady = seconds[1:] or seconds  # the first step also compiles (inductor) and warms up
    return {
        "world_size": world,
        "device": str(device),
        "params": sum(p.numel() for p in dm.model.parameters()),
        "buckets": [(b.name, len(b.slots), b.size, b.dtype, b.group) for b in dm.layout.buckets],
        "reduce_scatter": counts.get("_c10d_functional.reduce_scatter_tensor", 0),
        "all_gather": counts.get("_c10d_functional.all_gather_into_tensor", 0),
        "state_bytes": states,
        "unsharded_state_bytes": sum(p.numel() * p.element_size() for p in dm.model.parameters()) * n_states,
        "losses": losses,
        "reference": ref,
        "trace_s": trace_s,
        "first_step_s": seconds[0],
        "step_s": sum(steady) / len(steady),
        "compile": args.compile,
        "checkpoints": {m: all(r[m] for r in ckpt_ok) for m in ckpt_results},
    }


def _report(r: dict) -> bool:
    console = Console(soft_wrap=True)  # long lines stay whole in a pipe
    console.print(
        f"[bold]graphfuse demo[/bold]: GPT with {r['params']:,} parameters on {r['world_size']} ranks ({r['device']})"
    )
    first = "first step (inductor compiles in it)" if r["compile"] == "inductor" else "first step"
    console.print(
        f"trace and rewrite {r['trace_s']:.2f} s; {first} {r['first_step_s']:.2f} s; "
        f"then {r['step_s'] * 1000:.1f} ms per step (mean of the other steps, compile excluded)"
    )
    t = Table(title="buckets (in the order backward fills them)")
    for col in ("bucket", "params", "elements", "dtype", "param group"):
        t.add_column(col)
    for row in r["buckets"]:
        t.add_row(*(str(x) for x in row))
    console.print(t)
    console.print(
        f"collectives per step: {r['reduce_scatter']} reduce-scatter, {r['all_gather']} all-gather "
        f"({len(r['buckets'])} buckets)"
    )
    ratio = max(r["state_bytes"]) / r["unsharded_state_bytes"]
    console.print(
        f"optimizer state per rank: {max(r['state_bytes']):,} B vs {r['unsharded_state_bytes']:,} B unsharded "
        f"= {ratio:.3f} (1/N = {1 / r['world_size']:.3f})"
    )
    diffs = [abs(a - b) for a, b in zip(r["losses"], r["reference"])]
    bitwise = r["losses"] == r["reference"]
    t = Table(title="loss: graphfuse vs eager data parallel (rank 0)")
    for col in ("step", "graphfuse", "eager DP", "|diff|"):
        t.add_column(col, justify="right")
    steps = len(r["losses"])
    for i in sorted({0, 1, steps // 4, steps // 2, 3 * steps // 4, steps - 1}):
        t.add_row(str(i), f"{r['losses'][i]:.6f}", f"{r['reference'][i]:.6f}", f"{diffs[i]:.2e}")
    console.print(t)
    console.print(f"loss curves: {'bitwise equal' if bitwise else f'max |diff| {max(diffs):.2e}'}")
    for mode, ok in r["checkpoints"].items():
        console.print(
            f"checkpoint {mode}: save at step {steps // 2}, reload into a fresh model, resume: "
            f"{'bitwise equal' if ok else 'DIFFERS'}"
        )
    return max(diffs) < 1e-4 and all(r["checkpoints"].values())


def _out_dir(args: argparse.Namespace) -> tuple[str, bool]:
    """(where the checkpoints go, whether it is a temporary directory to remove at the end)."""
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        return args.out, False
    return tempfile.mkdtemp(prefix="graphfuse-demo-"), True


def _under_torchrun(args: argparse.Namespace) -> int:
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    made = None
    try:
        shared = [_out_dir(args) if dist.get_rank() == 0 else ("", False)]
        dist.broadcast_object_list(shared, src=0)  # every rank writes the same checkpoint
        out_dir, temporary = shared[0]
        made = out_dir if temporary and dist.get_rank() == 0 else None
        result = _rank_main(dist.get_rank(), dist.get_world_size(), args, out_dir)
        dist.barrier()  # every rank is done with the checkpoints before rank 0 removes them
    finally:
        dist.destroy_process_group()
        if made:
            shutil.rmtree(made, ignore_errors=True)
    return 0 if result is None or _finish(result, out_dir, temporary) else 1


def _finish(result: dict, out_dir: str, temporary: bool) -> bool:
    ok = _report(result)
    if temporary:
        print(f"checkpoints were written to {out_dir} and removed (keep them with --out DIR)")
    else:
        print(
            f"checkpoints written to {os.path.join(out_dir, 'ckpt-unbalanced')} and "
            f"{os.path.join(out_dir, 'ckpt-balanced')}"
        )
    return ok


def run_demo(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _under_torchrun(args)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise gf.UnsupportedError(
            f"--device cuda --world-size {args.world_size} needs one GPU per rank; {torch.cuda.device_count()} visible"
        )
    backend = "nccl" if args.device == "cuda" else "gloo"
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    out_dir, temporary = _out_dir(args)
    print(
        f"graphfuse demo: starting {args.world_size} ranks ({backend}, {args.device}); checkpoints go to {out_dir}",
        flush=True,
    )
    try:
        results = run_ranks(_rank_main, args.world_size, args, out_dir, backend=backend, threads=threads, timeout=3600)
    except RankFailure as e:
        last = e.traceback.strip().splitlines()[-1] if e.traceback.strip() else str(e)
        raise CliFailure(f"rank {e.rank} failed: {last} (rerun with --debug for its traceback)") from e
    finally:
        if temporary:
            shutil.rmtree(out_dir, ignore_errors=True)
    return 0 if _finish(results[0], out_dir, temporary) else 1
