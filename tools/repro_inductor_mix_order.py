"""Minimal torch-only repro of an inductor miscompile (CUDA, torch 2.11-2.13 seen): a
"mix-order reduction" whose column sums feed `torch.cat` leaves its slice of the cat unwritten.

    python tools/repro_inductor_mix_order.py              # mix-order reduction on (inductor's default)
    python tools/repro_inductor_mix_order.py --off        # TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 behaviour

Prints one line per run and exits 1 when the compiled result differs from eager beyond
rounding. No graphfuse code is involved: LayerNorm forward and backward of `rows x cols`
values, then `cat([grad_weight, grad_bias, *others])` of more pieces than inductor concatenates
pointwise (`max_pointwise_cat_inputs`), so that each piece's kernel writes straight into its
slice of the result, as in a packed-gradient buffer.
"""

from __future__ import annotations

import argparse
import sys

import torch


def step(x, w, b, dy, others):
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])
    return out, dx, torch.cat([dw, db, *(o * 2 for o in others)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--off", action="store_true", help="compile with triton.mix_order_reduction=False")
    ap.add_argument("--rows", type=int, default=8192, help="mix-order reduction needs rows*cols >= 5*2**20 and rows >= 4096")
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--det", action="store_true", help="torch.use_deterministic_algorithms(True): unwritten memory reads as NaN")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the miscompiled kernel is Triton's)")
        return 2
    if a.det:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(a.rows, a.cols, device=dev)
    w, b = torch.randn(a.cols, device=dev), torch.randn(a.cols, device=dev)
    dy = torch.randn(a.rows, a.cols, device=dev)
    others = [torch.randn(1000, device=dev) for _ in range(16)]
    expected = step(x, w, b, dy, others)[2]
    torch._dynamo.reset()
    with torch._inductor.config.patch({"triton.mix_order_reduction": not a.off}):
        got = torch.compile(step, fullgraph=True)(x, w, b, dy, others)[2]
    err = (got - expected).abs()
    scale = expected.abs().max().item()
    bad = int((err > 1e-3 * scale).sum()) + int((~torch.isfinite(got)).sum())
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()} rows={a.rows} cols={a.cols} "
          f"mix_order_reduction={'off' if a.off else 'on'} det={a.det}: {bad} of {got.numel()} elements of the cat "
          f"wrong (max |err| {err.nan_to_num(float('inf')).max().item():.3g}, scale {scale:.3g})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
