"""The updates that read a whole parameter (torch.optim.Muon's orthogonalisation, torch.optim.
Adafactor's factored second moment and its norms), mirroring torch's `_single_tensor_*` code op
for op; each runs on one whole parameter, never on a shard (or, on CUDA, Muon's on a stack of
same-shape ones: `takes_stacks`)."""

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
    sharded update runs on CUDA for the same-shape matrices a rank owns). The same math, written
    as one product with x per step, x <- (a·I + b·G + c·G²)·x: it equals torch's a·x + (b·G +
    c·G²)·x, and takes no biased products (aten copies a biased product's input before cuBLAS
    runs; here only the small m x m factor is summed, in float32). Other kernels and roundings (G²
    and the factor are rounded to bfloat16), so not bitwise with the one-matrix form. A tall stack's
    last product is taken transposed, xᵀ·factorᵀ, so that it comes out in the tall shape."""
    x = grads.bfloat16()
    tall = grads.size(1) > grads.size(2)
    if tall:
        x = x.mT
    x = torch.div(x, torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=spec.eps))
    for i in range(spec.ns_steps):
        gram = x @ x.mT
        factor = spec.ns_c * (gram @ gram).float() + spec.ns_b * gram.float()
        # + a·I, made from the factor (a factory would fix the device at trace time)
        factor = torch.diagonal_scatter(factor, factor.diagonal(dim1=-2, dim2=-1) + spec.ns_a, dim1=-2, dim2=-1)
        factor = factor.bfloat16()
        if tall and i == spec.ns_steps - 1:
            return x.mT @ factor.mT
        x = factor @ x
    return x.mT if tall else x


def muon(spec: GroupSpec, param: T, grad: T, states: dict, scalars: dict) -> tuple[T, dict]:
    """One matrix (or a (k, m, n) stack of same-shape ones): momentum (lerp), Nesterov,
    Newton-Schulz, decoupled decay, the shape's lr."""
    if param.dim() not in (2, 3):
        raise ValueError(f"Muon updates 2-D parameters, got one of shape {tuple(param.shape)}")
    buf = muon_momentum(spec, states["momentum_buffer"], grad)
    update = muon_orthogonal(spec, grad, buf)
    return muon_apply(param, update, muon_lr(spec, scalars, tuple(param.shape[-2:])), scalars), {"momentum_buffer": buf}


def muon_momentum(spec: GroupSpec, buf: T, grad: T) -> T:
    """Muon's new momentum buffer: per element, so it runs on any run of elements."""
    return torch.lerp(buf, grad, 1 - spec.momentum)


def muon_orthogonal(spec: GroupSpec, grad: T, buf: T) -> T:
    """Muon's update direction of one matrix (or a stack) from its new momentum buffer `buf`:
    Nesterov, then Newton-Schulz (bfloat16)."""
    update = torch.lerp(grad, buf, spec.momentum) if spec.nesterov else buf
    return newton_schulz(update, spec)


def muon_lr(spec: GroupSpec, scalars: dict, shape: tuple[int, ...]) -> T:
    """The lr of a matrix of `shape`, adjusted as torch's `adjust_lr_fn` says."""
    return torch.mul(scalars["lr"], adjusted_ratio(spec, shape))


def muon_apply(param: T, update: T, lr: T, scalars: dict) -> T:
    """Decoupled decay, then `param.add_(update, alpha=-lr)` (written as in
    graphfuse.optim.updates._sub_lr); `lr` is one value or one per element."""
    return torch.addcmul(torch.mul(param, scalars["decay"]), update, lr, value=-1)


# ---- Adafactor ------------------------------------------------------------------------------
def adafactor_states(spec: GroupSpec, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """torch's Adafactor state of a parameter of `shape`: a matrix (or more dimensions) keeps the
    row factor (the last dimension reduced to 1) and the column factor (the one before it
    reduced) of its second moment; a vector (or a scalar) keeps its whole second moment."""
    if len(shape) > 1:
        return {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1])}
    return {"variance": shape}


def adafactor_host(spec: GroupSpec, lr: float, wd: float, step: int, carried: dict) -> dict:
    """torch's per-step doubles: the lerp weight 1 - beta2_t = t^beta2_decay, the relative step
    size rho_t = min(lr, 1/sqrt(t)) and the weight decay's factor 1 - lr * wd (torch skips the
    multiplication when wd is 0; a product with 1.0 changes no value)."""
    t = float(step)
    return {"beta2_weight": t**spec.beta2_decay, "rho": min(lr, 1 / (t**0.5)), "decay": 1 - lr * wd}


def _lerp(start: T, end: T, weight: T) -> T:
    """`start.lerp_(end, w)` with a per-step double `w` (a 0-d float64 tensor): the kernel reads
    w in the dtype it computes in (float32 for float32, bfloat16 and float16; float64 for
    float64) and rounds the result once, so the same lerp in that dtype, cast back, is bitwise."""
    compute = torch.promote_types(start.dtype, torch.float32)
    out = torch.lerp(start.to(compute), end.to(compute), weight.to(compute))
    return out.to(start.dtype)


def adafactor(spec: GroupSpec, param: T, grad: T, states: dict, scalars: dict) -> tuple[T, dict]:
    """torch's `_single_tensor_adafactor` of one whole parameter. Its host reads of norms
    (`.item()` into Python doubles) are float64 tensors here, computed with the same roundings."""
    if param.dim() == 0:  # as one element: a 0-d tensor times a 0-d float64 scalar would compute in float64
        new_p, new = adafactor(
            spec, param.reshape(1), grad.reshape(1), {"variance": states["variance"].reshape(1)}, scalars
        )
        return new_p.reshape(()), {"variance": new["variance"].reshape(())}
    eps1 = torch.finfo(param.dtype).eps if spec.eps1 is None else spec.eps1
    numel = param.numel()
    rms = torch.div(torch.norm(param, 2).to(torch.float64), numel**0.5)
    alpha = torch.mul(torch.clamp(rms, min=spec.eps2), scalars["rho"])
    param = torch.mul(param, scalars["decay"])
    if grad.dim() > 1:
        row_mean = torch.div(torch.square(torch.norm(grad, dim=-1, keepdim=True)), grad.size(-1))
        row_var = _lerp(states["row_var"], row_mean, scalars["beta2_weight"])
        col_mean = torch.div(torch.square(torch.norm(grad, dim=-2, keepdim=True)), grad.size(-2))
        col_var = _lerp(states["col_var"], col_mean, scalars["beta2_weight"])
        var_estimate = torch.div(row_var @ col_var, torch.clamp(row_var.mean(dim=-2, keepdim=True), min=eps1))
        new = {"row_var": row_var, "col_var": col_var}
    else:
        var_estimate = variance = _lerp(states["variance"], torch.mul(grad, grad), scalars["beta2_weight"])
        new = {"variance": variance}
    update = torch.mul(torch.rsqrt(torch.clamp(var_estimate, min=eps1 * eps1)), grad)
    denom = torch.clamp(torch.div(torch.norm(update, 2).to(torch.float64), (numel**0.5) * spec.d), min=1.0)
    # `param.add_(update, alpha=-alpha / denom)`, written as in graphfuse.optim.updates._sub_lr.
    return torch.addcmul(param, update, torch.div(alpha, denom), value=-1), new


def takes_stacks(spec: GroupSpec) -> bool:
    """Whether the update may run on a (k, m, n) stack of same-shape matrices, one call for all
    (batched products, on CUDA): Muon's, whose Newton-Schulz is per matrix and the rest per
    element. A tall matrix stays with its own shape: its transposes lie elsewhere in the shard,
    so a stack of both would be a copy, not a view (passes/sharded_update.py)."""
    return spec.kind == "muon"
