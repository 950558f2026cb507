"""The elementwise torch.optim updates as plain aten ops, one function per optimizer, mirroring
torch's `_single_tensor_*` code (foreach=False) op for op, and the per-step scalars each host
function computes as torch does in Python doubles. The table that names them is rules.py."""

from __future__ import annotations

import torch

from graphfuse.optim.spec import GroupSpec

T = torch.Tensor


def decay(spec: GroupSpec) -> tuple[str, ...]:
    """AdamW-style decoupled weight decay multiplies by 1 - lr * wd, a per-step scalar."""
    return ("decay",) if spec.decoupled and spec.weight_decay != 0 else ()


def _with_decay(spec: GroupSpec, lr: float, wd: float, out: dict) -> dict:
    if decay(spec):
        out["decay"] = 1 - lr * wd
    return out


def _coupled_decay(spec: GroupSpec, param: T, grad: T, scalars: dict) -> tuple[T, T]:
    """torch's weight decay: param.mul_(1 - lr*wd) when decoupled, else grad + wd*param."""
    if spec.weight_decay != 0:
        if spec.decoupled:
            param = torch.mul(param, scalars["decay"])
        else:
            grad = torch.add(grad, param, alpha=spec.weight_decay)
    return param, grad


def _sub_lr(param: T, x: T, lr: T) -> T:
    """`param.add_(x, alpha=-lr)`: written as `addcmul(value=-1)`, which rounds once, as the
    fused multiply-add behind `add(alpha=...)` does (lr is a per-step tensor, not a constant)."""
    return torch.addcmul(param, x, lr, value=-1)


def _addcdiv(param: T, t1: T, t2: T, value: T) -> T:
    """`param.addcdiv_(t1, t2, value=v)` with a per-step v: the kernel computes param + v*t1/t2."""
    return torch.add(param, torch.div(torch.mul(t1, value), t2))


# ---- Adam, AdamW ----------------------------------------------------------------------------
def adam_states(spec):
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if spec.amsgrad else ())


def adam_host(spec, lr, wd, step, carried):
    s = float(step)
    return _with_decay(
        spec, lr, wd, {"neg_step_size": -(lr / (1 - spec.beta1**s)), "bc2_sqrt": (1 - spec.beta2**s) ** 0.5}
    )


def adam(spec, param, grad, states, scalars):
    param, grad = _coupled_decay(spec, param, grad, scalars)
    exp_avg = torch.lerp(states["exp_avg"], grad, 1 - spec.beta1)
    exp_avg_sq = torch.addcmul(torch.mul(states["exp_avg_sq"], spec.beta2), grad, grad, value=1 - spec.beta2)
    new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if spec.amsgrad:
        second = new["max_exp_avg_sq"] = torch.maximum(states["max_exp_avg_sq"], exp_avg_sq)
    denom = torch.add(torch.div(torch.sqrt(second), scalars["bc2_sqrt"]), spec.eps)
    return torch.add(param, torch.div(torch.mul(exp_avg, scalars["neg_step_size"]), denom)), new


# ---- SGD ------------------------------------------------------------------------------------
def sgd_host(spec, lr, wd, step, carried):
    return {"lr": lr} | ({"first": step == 1} if spec.momentum != 0 and spec.dampening != 0 else {})


def sgd(spec, param, grad, states, scalars):
    new = {}
    if spec.weight_decay != 0:
        grad = torch.add(grad, param, alpha=spec.weight_decay)
    if spec.momentum != 0:
        # The buffer starts at zero, so step 1 gives 0*m + 1*grad = grad, as torch's clone does;
        # with dampening, step 1 must take grad itself, selected by the host flag `first`.
        buf = torch.add(torch.mul(states["momentum_buffer"], spec.momentum), grad, alpha=1 - spec.dampening)
        if "first" in scalars:
            buf = torch.where(scalars["first"], grad, buf)
        new["momentum_buffer"] = buf
        grad = torch.add(grad, buf, alpha=spec.momentum) if spec.nesterov else buf
    return _sub_lr(param, grad, scalars["lr"]), new


# ---- RMSprop --------------------------------------------------------------------------------
def rmsprop_states(spec):
    return (
        ("square_avg",) + (("momentum_buffer",) if spec.momentum > 0 else ()) + (("grad_avg",) if spec.centered else ())
    )


def rmsprop(spec, param, grad, states, scalars):
    if spec.weight_decay != 0:
        grad = torch.add(grad, param, alpha=spec.weight_decay)
    square_avg = torch.addcmul(torch.mul(states["square_avg"], spec.alpha), grad, grad, value=1 - spec.alpha)
    new = {"square_avg": square_avg}
    if spec.centered:
        grad_avg = new["grad_avg"] = torch.lerp(states["grad_avg"], grad, 1 - spec.alpha)
        avg = torch.sqrt(torch.addcmul(square_avg, grad_avg, grad_avg, value=-1))
    else:
        avg = torch.sqrt(square_avg)
    avg = torch.add(avg, spec.eps)
    if spec.momentum > 0:
        buf = new["momentum_buffer"] = torch.addcdiv(torch.mul(states["momentum_buffer"], spec.momentum), grad, avg)
        return _sub_lr(param, buf, scalars["lr"]), new
    return _addcdiv(param, grad, avg, scalars["neg_lr"]), new


# ---- Adagrad --------------------------------------------------------------------------------
def adagrad(spec, param, grad, states, scalars):
    if spec.weight_decay != 0:
        grad = torch.add(grad, param, alpha=spec.weight_decay)
    state_sum = torch.addcmul(states["sum"], grad, grad, value=1)
    std = torch.add(torch.sqrt(state_sum), spec.eps)
    return _addcdiv(param, grad, std, scalars["neg_clr"]), {"sum": state_sum}


# ---- Adamax ---------------------------------------------------------------------------------
def adamax(spec, param, grad, states, scalars):
    if spec.weight_decay != 0:
        grad = torch.add(grad, param, alpha=spec.weight_decay)
    exp_avg = torch.lerp(states["exp_avg"], grad, 1 - spec.beta1)
    exp_inf = torch.maximum(torch.mul(states["exp_inf"], spec.beta2), torch.add(torch.abs(grad), spec.eps))
    return _addcdiv(param, exp_avg, exp_inf, scalars["neg_clr"]), {"exp_avg": exp_avg, "exp_inf": exp_inf}


# ---- NAdam ----------------------------------------------------------------------------------
_MU_PRODUCTS: dict[tuple, list[float]] = {}


def _mu_product(spec: GroupSpec, step: int) -> float:
    """NAdam's `mu_product` after step `step`: torch keeps it as a 0-d tensor of the default
    scalar dtype (float32) and multiplies it by each step's mu in place, rounding every time,
    so the host repeats those multiplications (memoised per group's betas)."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    values = _MU_PRODUCTS.setdefault((spec.beta1, spec.momentum_decay, dtype), [1.0])
    while len(values) <= step:
        mu = spec.beta1 * (1.0 - 0.5 * (0.96 ** (float(len(values)) * spec.momentum_decay)))
        values.append(float(torch.tensor(values[-1], dtype=dtype).mul_(mu)))
    return values[step]


def nadam_host(spec, lr, wd, step, carried):
    s = float(step)
    mu = spec.beta1 * (1.0 - 0.5 * (0.96 ** (s * spec.momentum_decay)))
    mu_next = spec.beta1 * (1.0 - 0.5 * (0.96 ** ((s + 1) * spec.momentum_decay)))
    mu_product = _mu_product(spec, step)
    out = {
        "bc2": 1 - spec.beta2**s,
        "grad_coef": -lr * (1.0 - mu) / (1.0 - mu_product),
        "avg_coef": (-lr * mu_next) / (1.0 - mu_product * mu_next),
    }
    return _with_decay(spec, lr, wd, out)


def nadam(spec, param, grad, states, scalars):
    param, grad = _coupled_decay(spec, param, grad, scalars)
    exp_avg = torch.lerp(states["exp_avg"], grad, 1 - spec.beta1)
    exp_avg_sq = torch.addcmul(torch.mul(states["exp_avg_sq"], spec.beta2), grad, grad, value=1 - spec.beta2)
    denom = torch.add(torch.sqrt(torch.div(exp_avg_sq, scalars["bc2"])), spec.eps)
    param = _addcdiv(param, grad, denom, scalars["grad_coef"])
    param = _addcdiv(param, exp_avg, denom, scalars["avg_coef"])
    return param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


# ---- RAdam ----------------------------------------------------------------------------------
def radam_host(spec, lr, wd, step, carried):
    s = float(step)
    bc1, bc2 = 1 - spec.beta1**s, 1 - spec.beta2**s
    rho_inf = 2 / (1 - spec.beta2) - 1
    rho_t = rho_inf - 2 * s * (spec.beta2**s) / bc2
    rectified = rho_t > 5.0  # the branch torch takes on the host; both are traced, this selects
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5 if rectified else 0.0
    out = {"lr": lr, "bc1": bc1, "bc2_sqrt": bc2**0.5, "rect": rect, "rectified": rectified}
    return _with_decay(spec, lr, wd, out)


def radam(spec, param, grad, states, scalars):
    param, grad = _coupled_decay(spec, param, grad, scalars)
    exp_avg = torch.lerp(states["exp_avg"], grad, 1 - spec.beta1)
    exp_avg_sq = torch.addcmul(torch.mul(states["exp_avg_sq"], spec.beta2), grad, grad, value=1 - spec.beta2)
    scaled = torch.mul(torch.div(exp_avg, scalars["bc1"]), scalars["lr"])
    # `float / tensor` is Tensor.__rtruediv__: reciprocal, then multiply.
    adaptive = torch.mul(torch.reciprocal(torch.add(torch.sqrt(exp_avg_sq), spec.eps)), scalars["bc2_sqrt"])
    rectified = torch.add(param, torch.mul(torch.mul(scaled, adaptive), scalars["rect"]), alpha=-1.0)
    plain = torch.add(param, scaled, alpha=-1.0)
    return torch.where(scalars["rectified"], rectified, plain), {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


# ---- Adadelta -------------------------------------------------------------------------------
def adadelta(spec, param, grad, states, scalars):
    if spec.weight_decay != 0:
        grad = torch.add(grad, param, alpha=spec.weight_decay)
    square_avg = torch.addcmul(torch.mul(states["square_avg"], spec.rho), grad, grad, value=1 - spec.rho)
    std = torch.sqrt(torch.add(square_avg, spec.eps))
    delta = torch.mul(torch.div(torch.sqrt(torch.add(states["acc_delta"], spec.eps)), std), grad)
    acc_delta = torch.addcmul(torch.mul(states["acc_delta"], spec.rho), delta, delta, value=1 - spec.rho)
    return _sub_lr(param, delta, scalars["lr"]), {"square_avg": square_avg, "acc_delta": acc_delta}


# ---- Rprop ----------------------------------------------------------------------------------
def rprop(spec, param, grad, states, scalars):
    # torch's step-size state starts at lr (the first step's), graphfuse's at zero: `first` selects.
    step_size = torch.where(scalars["first"], scalars["lr"], states["step_size"])
    sign = torch.sign(torch.mul(grad, states["prev"]))
    # torch's `sign[sign.gt(0)] = etaplus`...: a filled tensor, as where(mask, scalar) traces a 0-d one.
    sign = torch.where(torch.gt(sign, 0), torch.full_like(sign, spec.etaplus), sign)
    sign = torch.where(torch.lt(sign, 0), torch.full_like(sign, spec.etaminus), sign)
    sign = torch.where(torch.eq(sign, 0), torch.full_like(sign, 1.0), sign)
    step_size = torch.clamp(torch.mul(step_size, sign), spec.step_size_min, spec.step_size_max)
    grad = torch.where(torch.eq(sign, spec.etaminus), torch.zeros_like(grad), grad)
    param = torch.addcmul(param, torch.sign(grad), step_size, value=-1)
    return param, {"prev": grad, "step_size": step_size}


# ---- ASGD -----------------------------------------------------------------------------------
def _scalar_dtype_round(value: float) -> float:
    """torch.optim keeps its 0-d states in the default scalar dtype (float32 unless float64)."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return float(torch.tensor(value, dtype=dtype))


def asgd_eta(spec: GroupSpec, lr: float, step: int) -> float:
    """The eta torch stores after step `step` from that step's lr (at step 0, when it creates
    the state at the first step: the lr itself), rounded as its 0-d state is."""
    return _scalar_dtype_round(lr if step == 0 else lr / ((1 + spec.lambd * lr * float(step)) ** spec.alpha))


def asgd_host(spec, lr, wd, step, carried):
    """eta and mu of step `step`: eta is what step - 1 left (computed from that step's lr,
    `carried`); before the first step there is none and torch starts from this step's lr.
    mu depends on the step alone."""
    prev = float(step - 1)
    eta = carried["eta"] if "eta" in carried else asgd_eta(spec, lr, 0)
    mu = 1.0 if step == 1 else _scalar_dtype_round(1 / max(1, prev - spec.t0))
    return {"shrink": 1 - spec.lambd * eta, "eta": eta, "mu": mu, "average": mu != 1}


def asgd(spec, param, grad, states, scalars):
    if spec.weight_decay != 0:
        grad = torch.add(grad, param, alpha=spec.weight_decay)
    param = _sub_lr(torch.mul(param, scalars["shrink"]), grad, scalars["eta"])
    # torch copies the parameter while mu is 1, else moves ax towards it by mu.
    averaged = torch.add(states["ax"], torch.mul(torch.sub(param, states["ax"]), scalars["mu"]))
    return param, {"ax": torch.where(scalars["average"], averaged, param)}


def torch_host_states(spec: GroupSpec, step: int, carried: dict[str, float], lr: float) -> dict[str, T]:
    """The per-parameter 0-d states torch.optim keeps after `step` steps besides `step` that
    graphfuse computes on the host (the same for every parameter of a group), from what the
    last step `carried` and the group's `lr`: written into checkpoints so that plain torch.optim
    resumes from them exactly."""
    if spec.kind == "nadam":
        values = {"mu_product": _mu_product(spec, step)}
    elif spec.kind == "asgd":  # after step k torch holds the eta and mu that step k + 1 uses
        host = asgd_host(spec, lr, spec.weight_decay, step + 1, carried)
        values = {"eta": host["eta"], "mu": host["mu"]}
    else:
        values = {}
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return {name: torch.tensor(value, dtype=dtype) for name, value in values.items()}
