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


def joint_step(x, y, w1, b1, w2, b2, w3, b3, ln_w, ln_b, head_w, head_b):
    """A whole training step's forward and backward as make_fx traces it: the gradients of
    two linear layers, a LayerNorm and a head, packed into one flat buffer with `cat`."""
    params = [w1, b1, w2, b2, w3, b3, ln_w, ln_b, head_w, head_b]
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
    h = torch.nn.functional.linear(h, w2, b2) + x
    h = torch.nn.functional.linear(torch.nn.functional.layer_norm(h, [h.shape[-1]], ln_w, ln_b), w3, b3) + h
    logits = torch.nn.functional.linear(h, head_w, head_b)
    loss = torch.nn.functional.cross_entropy(logits.float(), y)
    grads = torch.autograd.grad(loss, params)
    return loss, torch.cat([g.reshape(-1) for g in grads])


def run_joint(rows: int, cols: int, off: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    dev = "cuda"
    x, y = torch.randn(rows, cols, device=dev), torch.randint(0, 256, (rows,), device=dev)
    params = []
    for shape in [
        (cols, cols),
        (cols,),
        (cols, cols),
        (cols,),
        (cols, cols),
        (cols,),
        (cols,),
        (cols,),
        (256, cols),
        (256,),
    ]:
        params.append((torch.randn(shape, device=dev) * 0.02).requires_grad_())
    params[6].data.fill_(1.0)
    expected = joint_step(x, y, *params)[1]
    gm = make_fx(joint_step)(x, y, *params)
    with torch._inductor.config.patch({"triton.mix_order_reduction": not off}):
        got = compile_fx(gm, [x, y, *params])(x, y, *params)[1]
    return expected, got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--off", action="store_true", help="compile with triton.mix_order_reduction=False")
    ap.add_argument(
        "--rows", type=int, default=8192, help="mix-order reduction needs rows*cols >= 5*2**20 and rows >= 4096"
    )
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument(
        "--det", action="store_true", help="torch.use_deterministic_algorithms(True): unwritten memory reads as NaN"
    )
    ap.add_argument(
        "--joint", action="store_true", help="a make_fx-traced forward+backward whose gradients are packed by cat"
    )
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the miscompiled kernel is Triton's)")
        return 2
    if a.det:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    if a.joint:
        expected, got = run_joint(a.rows, a.cols, a.off)
        return report(a, expected, got)
    dev = "cuda"
    x = torch.randn(a.rows, a.cols, device=dev)
    w, b = torch.randn(a.cols, device=dev), torch.randn(a.cols, device=dev)
    dy = torch.randn(a.rows, a.cols, device=dev)
    others = [torch.randn(1000, device=dev) for _ in range(16)]
    expected = step(x, w, b, dy, others)[2]
    torch._dynamo.reset()
    with torch._inductor.config.patch({"triton.mix_order_reduction": not a.off}):
        got = torch.compile(step, fullgraph=True)(x, w, b, dy, others)[2]
    return report(a, expected, got)


def report(a, expected: torch.Tensor, got: torch.Tensor) -> int:
    err = (got - expected).abs()
    scale = expected.abs().max().item()
    bad = int((err > 1e-3 * scale).sum()) + int((~torch.isfinite(got)).sum())
    print(
        f"torch {torch.__version__} {torch.cuda.get_device_name()} rows={a.rows} cols={a.cols} "
        f"mix_order_reduction={'off' if a.off else 'on'} det={a.det} joint={a.joint}: {bad} of {got.numel()} "
        f"elements of the cat "
        f"wrong (max |err| {err.nan_to_num(float('inf')).max().item():.3g}, scale {scale:.3g})"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
