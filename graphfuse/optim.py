"""The optimizers graphfuse compiles: validation, state names, host scalars, and the
elementwise update written as plain aten ops (bitwise equal to torch.optim, foreach=False).

The update reads only per-element values and per-group scalars, so the same function
updates one parameter or a whole flat bucket shard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from graphfuse.errors import UnsupportedError

log = logging.getLogger("graphfuse")

SUPPORTED = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD"


@dataclass(frozen=True)
class GroupSpec:
    """Everything about one param group the traced update depends on, apart from lr."""

    kind: str  # "adam" (Adam and AdamW) or "sgd"
    params: tuple[str, ...]  # canonical FQNs of the group's trainable parameters
    decoupled: bool = False  # AdamW's decoupled weight decay
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:
        if self.kind == "adam":
            return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())
        return ("momentum_buffer",) if self.momentum != 0 else ()

    @property
    def scalar_names(self) -> tuple[str, ...]:
        """Per-step scalars the host computes (as torch.optim does, in Python doubles)."""
        if self.kind == "adam":
            decay = ("decay",) if self.decoupled and self.weight_decay != 0 else ()
            return decay + ("neg_step_size", "bc2_sqrt")
        return ("lr",) + (("first",) if self.momentum != 0 and self.dampening != 0 else ())

    @property
    def has_step(self) -> bool:
        return self.kind == "adam"

    def host_scalars(self, lr: float, weight_decay: float, step: int) -> dict[str, float | bool]:
        """The scalars of step number `step` (1-based), computed exactly as torch.optim does."""
        if self.kind == "adam":
            s = float(step)
            bias_correction1 = 1 - self.beta1**s
            bias_correction2 = 1 - self.beta2**s
            out: dict[str, float | bool] = {
                "neg_step_size": -(lr / bias_correction1),
                "bc2_sqrt": bias_correction2**0.5,
            }
            if "decay" in self.scalar_names:
                out["decay"] = 1 - lr * weight_decay
            return out
        out = {"lr": lr}
        if "first" in self.scalar_names:
            out["first"] = step == 1
        return out


@dataclass(frozen=True)
class OptimSpec:
    cls_name: str
    groups: tuple[GroupSpec, ...]

    def group_of(self) -> dict[str, int]:
        return {fqn: g for g, spec in enumerate(self.groups) for fqn in spec.params}


def _float(value, what: str, cls_name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedError(f"{cls_name}: {what} must be a number, got a tensor of shape {tuple(value.shape)}")
        return float(value.item())
    return float(value)


def describe_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> OptimSpec:
    """Validate `optimizer` and describe it; `names` maps id(parameter) to its canonical FQN.

    Raises UnsupportedError naming the class or option, before any state is touched.
    """
    cls = type(optimizer)
    cls_name = cls.__name__
    if cls not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        raise UnsupportedError(
            f"optimizer {cls.__module__}.{cls.__qualname__} is not supported; supported: {SUPPORTED} "
            "(exact classes, not subclasses, since a subclass may change the update)"
        )
    if any(len(s) for s in optimizer.state.values()):
        raise UnsupportedError(
            f"{cls_name} already has state (it has stepped); pass a fresh optimizer to gf.compile "
            "and restore state with DistModel.load_state_dict or gf.load"
        )
    if any(group.get("fused") or group.get("foreach") for group in optimizer.param_groups):
        log.info(
            "graphfuse: %s(fused=/foreach=) only chooses torch's kernels; graphfuse runs its own fused "
            "update, with the numerics of foreach=False", cls_name
        )
    groups = []
    seen: set[int] = set()
    for g, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise UnsupportedError(f"{cls_name} param group {g}: differentiable=True is not supported")
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise UnsupportedError(
                    f"{cls_name} param group {g} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model; optimize only the model's parameters"
                )
            if id(p) in seen:
                raise UnsupportedError(f"{cls_name}: parameter {names[id(p)]} is in more than one param group")
            seen.add(id(p))
            if p.requires_grad:
                fqns.append(names[id(p)])
        if cls_name == "SGD":
            spec = GroupSpec(
                kind="sgd",
                params=tuple(fqns),
                weight_decay=_float(group["weight_decay"], "weight_decay", cls_name),
                maximize=bool(group["maximize"]),
                momentum=_float(group["momentum"], "momentum", cls_name),
                dampening=_float(group["dampening"], "dampening", cls_name),
                nesterov=bool(group["nesterov"]),
            )
        else:
            b1, b2 = group["betas"]
            if isinstance(b1, torch.Tensor) or isinstance(b2, torch.Tensor):
                raise UnsupportedError(f"{cls_name} param group {g}: tensor betas are not supported; pass floats")
            spec = GroupSpec(
                kind="adam",
                params=tuple(fqns),
                decoupled=bool(group.get("decoupled_weight_decay", cls is torch.optim.AdamW)),
                beta1=float(b1),
                beta2=float(b2),
                eps=_float(group["eps"], "eps", cls_name),
                weight_decay=_float(group["weight_decay"], "weight_decay", cls_name),
                amsgrad=bool(group["amsgrad"]),
                maximize=bool(group["maximize"]),
            )
        groups.append(spec)
    return OptimSpec(cls_name=cls_name, groups=tuple(groups))


def check_group_unchanged(spec: GroupSpec, group: dict, g: int) -> None:
    """Hyper-parameters other than lr (and AdamW's weight decay) are baked into the graph:
    refuse a step after a scheduler changed one, rather than silently ignore it."""
    if spec.kind == "adam":
        current = {
            "betas": tuple(float(b) for b in group["betas"]),
            "eps": float(group["eps"]),
            "amsgrad": bool(group["amsgrad"]),
            "maximize": bool(group["maximize"]),
        }
        traced = {"betas": (spec.beta1, spec.beta2), "eps": spec.eps, "amsgrad": spec.amsgrad, "maximize": spec.maximize}
        if "decay" not in spec.scalar_names:
            current["weight_decay"], traced["weight_decay"] = float(group["weight_decay"]), spec.weight_decay
    else:
        keys = ("momentum", "dampening", "weight_decay")
        current = {k: float(group[k]) for k in keys} | {k: bool(group[k]) for k in ("nesterov", "maximize")}
        traced = {k: getattr(spec, k) for k in (*keys, "nesterov", "maximize")}
    for k, v in traced.items():
        if current[k] != v:
            raise UnsupportedError(
                f"param group {g}: {k} changed from {v} to {current[k]} after gf.compile; only lr"
                + (" and weight_decay" if "decay" in spec.scalar_names else "")
                + " may change between steps. Re-run gf.compile to use the new value"
            )


def update(
    spec: GroupSpec,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: dict[str, torch.Tensor],
    scalars: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step as pure elementwise ops; returns (new param, new states).

    Mirrors torch.optim's `_single_tensor_adam` / `_single_tensor_sgd` op for op. Scalars
    that change per step are 0-d float64 tensors, which the CPU kernels read exactly as
    they read a Python float; `add(alpha=-lr)` is written as `addcmul(value=-1)`, which
    rounds once, as the fused multiply-add behind `add(alpha=...)` does.
    """
    if spec.maximize:
        grad = torch.neg(grad)
    if spec.kind == "adam":
        if spec.weight_decay != 0:
            if spec.decoupled:
                param = torch.mul(param, scalars["decay"])
            else:
                grad = torch.add(grad, param, alpha=spec.weight_decay)
        exp_avg = torch.lerp(states["exp_avg"], grad, 1 - spec.beta1)
        exp_avg_sq = torch.addcmul(torch.mul(states["exp_avg_sq"], spec.beta2), grad, grad, value=1 - spec.beta2)
        new_states = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        second = exp_avg_sq
        if spec.amsgrad:
            second = new_states["max_exp_avg_sq"] = torch.maximum(states["max_exp_avg_sq"], exp_avg_sq)
        denom = torch.add(torch.div(torch.sqrt(second), scalars["bc2_sqrt"]), spec.eps)
        param = torch.add(param, torch.div(torch.mul(exp_avg, scalars["neg_step_size"]), denom))
        return param, new_states
    new_states = {}
    if spec.weight_decay != 0:
        grad = torch.add(grad, param, alpha=spec.weight_decay)
    if spec.momentum != 0:
        # The buffer starts at zero, so step 1 gives 0*m + 1*grad = grad, as torch's clone does;
        # with dampening, step 1 must take grad itself, selected by the host flag `first`.
        buf = torch.add(torch.mul(states["momentum_buffer"], spec.momentum), grad, alpha=1 - spec.dampening)
        if "first" in scalars:
            buf = torch.where(scalars["first"], grad, buf)
        new_states["momentum_buffer"] = buf
        grad = torch.add(grad, buf, alpha=spec.momentum) if spec.nesterov else buf
    param = torch.addcmul(param, grad, scalars["lr"], value=-1)
    return param, new_states
