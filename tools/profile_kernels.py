"""Where one GPU's step time goes, by kernel kind (issue 33): matmul, attention, Triton, NCCL,
memcpy/memset and other kernels, and the idle gap between them, for graphfuse (inductor; with
`graphfuse_fused_loss`, Strategy.fuse_loss; with `graphfuse_cudagraphs`, Strategy.cuda_graphs) and its
peers at their best settings: torch.compile of model + loss with fused AdamW (`torch_compile`), and
the same with mode="reduce-overhead" (`torch_compile_cudagraphs`). CUDA only.

    python tools/profile_kernels.py                       # GPT-2 small, batch 8 x 1024, bf16 autocast
    python tools/profile_kernels.py --precision bf16master --methods graphfuse graphfuse_fused_loss torch_compile
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from _bench import gpt2_small_args, machine, print_report, timed  # tools/_bench.py: what the benches share

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, synthetic_tokens

METHODS = ["graphfuse", "graphfuse_fused_loss", "graphfuse_cudagraphs", "torch_compile", "torch_compile_cudagraphs"]
KINDS = ["matmul", "attention", "triton", "nccl", "memcpy/set", "other"]
MATMUL = ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")


def kind_of(kernel: str) -> str:
    """The kind of a CUDA kernel, from its name."""
    n = kernel.lower()
    if any(k in n for k in MATMUL):
        return "matmul"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "triton" in n:
        return "triton"
    if "nccl" in n:
        return "nccl"
    if "memcpy" in n or "memset" in n:
        return "memcpy/set"
    return "other"


def loss_fn_for(precision: str):
    def loss_fn(model, batch):
        idx, tgt = batch
        if precision == "amp":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(idx)
        else:
            logits = model(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    return loss_fn


def make_step(method: str, model: torch.nn.Module, loss_fn, example, precision: str):
    """The method's training step, `step(batch) -> loss` (AdamW, lr 1e-3, weight decay 0.1)."""
    if method.startswith("graphfuse"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        st = gf.Strategy(
            compile="inductor",
            fuse_loss=method == "graphfuse_fused_loss",
            cuda_graphs=method == "graphfuse_cudagraphs",
            master_dtype=torch.float32 if precision == "bf16master" else None,
        )
        return gf.compile(model, opt, loss_fn, example, strategy=st)
    # The loss inside the compiled region, as nanoGPT computes it: torch.compile's best case.
    closs = torch.compile(
        lambda b: loss_fn(model, b), mode="reduce-overhead" if method == "torch_compile_cudagraphs" else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)

    def step(b):
        loss = closs(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def kernel_ms(step, batches: list) -> tuple[dict, dict]:
    """GPU milliseconds per step by kernel kind, and by kernel name, over `batches` profiled."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for b in batches:
            step(b)
        torch.cuda.synchronize()
    kinds, names = defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        ms = (e.device_time if hasattr(e, "device_time") else e.cuda_time) / 1e3 / len(batches)
        kinds[kind_of(e.name)] += ms
        names[e.name[:90]] += ms
    return dict(kinds), dict(names)


def profile_method(method: str, args, cfg: GPTConfig) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    if args.precision == "bf16master":
        model = model.to(torch.bfloat16)
    n = args.warmup + args.steps + args.profile_steps
    batches = [tuple(x.cuda() for x in b) for b in synthetic_tokens(cfg, args.batch, n, seed=0)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step = make_step(method, model, loss_fn_for(args.precision), batches[0], args.precision)
    times = timed(step, batches[: args.warmup + args.steps], args.warmup, "cuda")
    kinds, names = kernel_ms(step, batches[args.warmup + args.steps :])
    ms, busy = 1e3 * statistics.median(times), sum(kinds.values())
    params = sum(p.numel() for p in model.parameters())
    flops = (6 * params + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd) * args.batch * cfg.block_size
    return {
        "step_ms": ms,
        "gpu_busy_ms": busy,
        "idle_ms": ms - busy,
        "kinds_ms": {k: kinds.get(k, 0.0) for k in KINDS},
        "model_tflops": flops / ms / 1e9,
        "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "fuse_loss_ran": "fuse_loss" in getattr(getattr(step, "program", None), "pass_names", ()),
        "top": sorted(names.items(), key=lambda kv: -kv[1])[: args.top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=["graphfuse", "graphfuse_fused_loss", "torch_compile", "torch_compile_cudagraphs"],
    )
    ap.add_argument(
        "--precision",
        choices=["amp", "bf16master", "fp32"],
        default="amp",
        help="amp: fp32 parameters, bf16 autocast; bf16master: bf16 parameters (graphfuse keeps fp32 masters); "
        "fp32: TF32 matmuls",
    )
    gpt2_small_args(ap)
    ap.add_argument("--warmup", type=int, default=8, help="steps before timing (compiling, CUDA graph capture)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (median)")
    ap.add_argument("--profile-steps", type=int, default=4, help="steps under torch.profiler, averaged")
    ap.add_argument("--top", type=int, default=12, help="kernels by GPU time in the JSON record")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "tools/profile_kernels.py profiles CUDA kernels, and this machine has no CUDA device "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False): run it on a machine with an NVIDIA GPU"
        )
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd
    )
    rows = {}
    for method in args.methods:
        rows[method] = profile_method(method, args, cfg)
        gc.collect()
        torch.cuda.empty_cache()

    from rich.table import Table

    where = machine("cuda")
    table = Table(
        title=f"GPU time by kernel kind, GPT {args.layers}x{args.embd}, vocab {args.vocab}, batch "
        f"{args.batch}x{args.block}, "
        f"{args.precision}, ms per step ({where})"
    )
    for col in ("method", "step ms", "busy ms", "idle ms", *KINDS, "model TFLOP/s", "peak GiB"):
        table.add_column(col)
    for name, r in rows.items():
        table.add_row(
            name,
            f"{r['step_ms']:.2f}",
            f"{r['gpu_busy_ms']:.2f}",
            f"{r['idle_ms']:.2f}",
            *(f"{r['kinds_ms'][k]:.2f}" for k in KINDS),
            f"{r['model_tflops']:.1f}",
            f"{r['peak_gib']:.2f}",
        )
    print_report(
        [table], {"bench": "profile_kernels", "device": "cuda", "machine": where, "config": vars(args), "results": rows}
    )


if __name__ == "__main__":
    main()
