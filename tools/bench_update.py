"""Benchmark the fused optimizer update and the gradient packing as inductor compiles them.

graphfuse writes the update of a whole bucket shard as plain aten ops (graphfuse.optim.describe.update)
and the packing of gradients into a bucket as view/pad/cat; inductor should fuse each into a
few memory-bound kernels. This measures achieved memory bandwidth against a plain device copy
(the achievable peak) and against torch's own fused and foreach AdamW, side by side in one run.

    python tools/bench_update.py --device cuda --numel 268435456
    python tools/bench_update.py --device cpu --numel 16777216
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _bench import machine, print_report, timed  # tools/_bench.py: what the benches share
from torch.fx.experimental.proxy_tensor import make_fx

from graphfuse import optim as gopt


def median_s(fn, device: str, iters: int) -> float:
    """Median seconds per call of `fn`, after 3 calls of warm-up."""
    return statistics.median(timed(lambda _: fn(), range(iters + 3), 3, device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--numel", type=int, default=None, help="elements in the shard (default: 256M on cuda, 16M on cpu)")
    ap.add_argument(
        "--params", type=int, default=200, help="parameters packed into the bucket for the packing benchmark"
    )
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    from torch._inductor.compile_fx import compile_fx

    device, n = args.device, args.numel or (2**28 if args.device == "cuda" else 2**24)
    torch.manual_seed(0)
    p, g, m, v = (torch.randn(n, device=device) for _ in range(4))
    v = v.abs()
    spec = gopt.GroupSpec(
        kind="adam", params=("p",), decoupled=True, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1
    )
    scalars = {k: torch.tensor(x, dtype=torch.float64) for k, x in spec.host_scalars(1e-3, 0.1, 10).items()}
    names = list(scalars)

    def update(p, g, m, v, *s):
        new_p, st = gopt.update(spec, p, g, {"exp_avg": m, "exp_avg_sq": v}, dict(zip(names, s)))
        return new_p, st["exp_avg"], st["exp_avg_sq"]

    def update_in_place(p, g, m, v, *s):  # what graphfuse.runtime.execute.compile_in_place hands inductor
        new_p, new_m, new_v = update(p, g, m, v, *s)
        p.copy_(new_p), m.copy_(new_m), v.copy_(new_v)
        return ()

    inputs = [p, g, m, v, *scalars.values()]
    functional = compile_fx(make_fx(update)(*inputs), inputs)
    in_place = compile_fx(make_fx(update_in_place)(*[x.clone() for x in inputs]), inputs)

    def functional_then_copy():
        new_p, new_m, new_v = functional(*inputs)
        p.copy_(new_p), m.copy_(new_m), v.copy_(new_v)

    results = {}
    bytes_update = 7 * 4 * n  # read p, g, m, v; write p, m, v (fp32)
    results["copy (peak)"] = (median_s(lambda: m.copy_(v), device, args.iters), 2 * 4 * n)
    results["graphfuse update, inductor, in place"] = (
        median_s(lambda: in_place(*inputs), device, args.iters),
        bytes_update,
    )
    results["graphfuse update, inductor, functional + copy"] = (
        median_s(functional_then_copy, device, args.iters),
        bytes_update,
    )
    for label, kw in (("torch AdamW fused", {"fused": True}), ("torch AdamW foreach", {"foreach": True})):
        if label.endswith("fused") and device == "cpu" and not hasattr(torch, "_fused_adamw_"):
            continue
        param = torch.nn.Parameter(torch.randn(n, device=device))
        param.grad = torch.randn(n, device=device)
        opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1, **kw)
        results[label] = (median_s(opt.step, device, args.iters), bytes_update)
        del opt, param

    # Gradient packing: many gradients into one flat, padded bucket.
    shapes = [(int(n // args.params // 64) - 3, 64)] * args.params
    grads = [torch.randn(s, device=device) for s in shapes]

    def pack(*gs):
        return torch.cat([torch.nn.functional.pad(x.reshape(-1), (0, 192)) for x in gs])

    def pack_zero_pieces(*gs):  # padding as separate zero tensors: cat inputs stay the gradients
        pieces = []
        for x in gs:
            pieces += [x.reshape(-1), torch.zeros(192, device=x.device, dtype=x.dtype)]
        return torch.cat(pieces)

    pack_compiled = compile_fx(make_fx(pack)(*grads), grads)
    pack_zero_compiled = compile_fx(make_fx(pack_zero_pieces)(*grads), grads)
    pack_bytes = 2 * 4 * sum(x.numel() for x in grads)
    results["pack gradients, eager"] = (median_s(lambda: pack(*grads), device, args.iters), pack_bytes)
    results["pack gradients, inductor (pad + cat)"] = (
        median_s(lambda: pack_compiled(*grads), device, args.iters),
        pack_bytes,
    )
    results["pack gradients, inductor (cat with zero pieces)"] = (
        median_s(lambda: pack_zero_compiled(*grads), device, args.iters),
        pack_bytes,
    )

    peak = results["copy (peak)"][1] / results["copy (peak)"][0]
    from rich.table import Table

    t = Table(title=f"update of {n:,} fp32 elements on {machine(device)}")
    for col in ("what", "ms", "GB/s", "of copy bandwidth"):
        t.add_column(col, justify="right" if col != "what" else "left")
    row = {}
    for label, (sec, nbytes) in results.items():
        bw = nbytes / sec
        row[label] = {"ms": sec * 1e3, "GBps": bw / 1e9, "of_peak": bw / peak}
        t.add_row(label, f"{sec * 1e3:.3f}", f"{bw / 1e9:.0f}", f"{bw / peak:.0%}")
    print_report([t], {"bench": "update", "device": device, "machine": machine(device), "numel": n, "results": row})


if __name__ == "__main__":
    main()
