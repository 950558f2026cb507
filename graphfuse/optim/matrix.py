"""The updates that read a whole parameter (torch.optim.Muon's orthogonalisation), mirroring
torch's `_single_tensor_*` code op for op; each runs on one whole parameter, never on a shard
(or, on CUDA, on a stack of same-shape ones: `BATCHED`)."""

from __future__ import annotations

import math

import torch

from graphfuse.optim.spec import GroupSpec

T = torch.Tensor


# ---- Muon -----------------------------------------------------------------------------------
def muon_host(spec: GroupSpec, lr: float, wd: float, step: int, carried: dict) -> dict:
    """torch multiplies by 1 - lr * wd and takes lr itself, adjusted per shape in the graph."""
    return {"lr": lr, "decay": 1 - lr * wd}


def adjusted_ratio(spec: GroupSpec, shape: tuple[int, ...]) -> float:
    """torch.optim._muon._adjust_lr's factor for a matrix of `shape`, in Python doubles."""
    a, b = shape[:2]
    if spec.adjust_lr_fn in ("", "original"):
        return math.sqrt(max(1, a / b))
    if spec.adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return 1.0


def newton_schulz(grad: T, spec: GroupSpec) -> T:
    """torch's `_zeropower_via_newtonschulz`: the quintic iteration in bfloat16. A 3-D `grad` is a
    stack of same-shape matrices, iterated together (batched products, a norm per matrix)."""
    if grad.dim() == 3:
        return _newton_schulz_batched(grad, spec)
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = torch.div(x, x.norm().clamp(min=spec.eps))
    for _ in range(spec.ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=spec.ns_b, alpha=spec.ns_c)
        x = torch.addmm(x, gram_update, x, beta=spec.ns_a)
    return x.T if tall else x


def _newton_schulz_batched(grads: T, spec: GroupSpec) -> T:
    """`newton_schulz` of each matrix of a (k, m, n) stack, with bmm-shaped products (what the
    sharded update runs on CUDA for the same-shape matrices a rank owns): the same math, other
    kernels, so not bitwise with the one-matrix form."""
    x = grads.bfloat16()
    tall = grads.size(1) > grads.size(2)
    if tall:
        x = x.mT
    x = torch.div(x, torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=spec.eps))
    for _ in range(spec.ns_steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=spec.ns_b, alpha=spec.ns_c)
        x = torch.baddbmm(x, gram_update, x, beta=spec.ns_a)
    return x.mT if tall else x


def muon(spec: GroupSpec, param: T, grad: T, states: dict, scalars: dict) -> tuple[T, dict]:
    """One matrix (or a (k, m, n) stack of same-shape ones): momentum (lerp), Nesterov,
    Newton-Schulz, decoupled decay, the shape's lr."""
    if param.dim() not in (2, 3):
        raise ValueError(f"Muon updates 2-D parameters, got one of shape {tuple(param.shape)}")
    buf = torch.lerp(states["momentum_buffer"], grad, 1 - spec.momentum)
    update = torch.lerp(grad, buf, spec.momentum) if spec.nesterov else buf
    update = newton_schulz(update, spec)
    adjusted = torch.mul(scalars["lr"], adjusted_ratio(spec, tuple(param.shape[-2:])))
    param = torch.mul(param, scalars["decay"])
    # `param.add_(update, alpha=-adjusted_lr)`, written as in graphfuse.optim.updates._sub_lr.
    return torch.addcmul(param, update, adjusted, value=-1), {"momentum_buffer": buf}


# Kinds whose update also takes a (k, m, n) stack of same-shape matrices (batched on CUDA).
BATCHED = ("muon",)
