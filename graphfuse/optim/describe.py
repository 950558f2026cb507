"""The optimizers graphfuse compiles: validation and description of a torch.optim optimizer
(`describe_optimizer`), the checks between steps, and the update of one group (the rules
themselves, one per optimizer, are in graphfuse.optim.rules).

Every elementwise update reads only per-element values and per-group scalars, so the same
function updates one parameter or a whole flat bucket shard. An update that reads a whole
parameter (Muon's, Adafactor's; graphfuse.capture.tracing.reads_whole tells from its trace)
would see another tensor on a shard that ends inside one parameter; such parameters are laid
out whole in one rank's shard (graphfuse.ir.ownership) and updated one by one. The others
(LBFGS, SparseAdam) are refused.
"""

from __future__ import annotations

import logging

import torch

from graphfuse.errors import UnsupportedError
from graphfuse.optim.rules import CLASSES
from graphfuse.optim.several import Optimizers
from graphfuse.optim.sharded_state import ShardedState
from graphfuse.optim.spec import RULES, GroupSpec, OptimSpec

log = logging.getLogger("graphfuse")

SUPPORTED = ", ".join(f"torch.optim.{name}" for name in CLASSES)
# Optimizers refused with the reason they cannot be compiled as a sharded elementwise update.
NOT_ELEMENTWISE = {
    "LBFGS": "its step re-evaluates a closure and searches along a direction over all parameters",
    "SparseAdam": "it updates sparse gradients",
}


def _float(value, what: str, cls_name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedError(f"{cls_name}: {what} must be a number, got a tensor of shape {tuple(value.shape)}")
        return float(value.item())
    return float(value)


# Hyper-parameters torch.optim takes as tuples, and the GroupSpec fields they fill.
PAIRS = {
    "betas": ("beta1", "beta2"),
    "etas": ("etaminus", "etaplus"),
    "step_sizes": ("step_size_min", "step_size_max"),
    "ns_coefficients": ("ns_a", "ns_b", "ns_c"),
}


def _hyper(kind: str, cls_name: str, group: dict, g: int) -> dict:
    """The group's baked-in hyper-parameters as GroupSpec fields."""
    out: dict = {}
    for key in RULES[kind].hyper:
        if key in PAIRS:
            values = tuple(group[key])
            if any(isinstance(v, torch.Tensor) for v in values):
                raise UnsupportedError(f"{cls_name} param group {g}: tensor {key} are not supported; pass floats")
            if len(values) != len(PAIRS[key]):
                raise UnsupportedError(
                    f"{cls_name} param group {g}: {key} must be {len(PAIRS[key])} floats, got {values}"
                )
            out.update(zip(PAIRS[key], map(float, values)))
        elif key == "eps" and kind == "adafactor":  # (eps1 or None, eps2)
            eps1, eps2 = group[key]
            out["eps1"] = None if eps1 is None else _float(eps1, "eps[0]", cls_name)
            out["eps2"] = _float(eps2, "eps[1]", cls_name)
        elif key == "adjust_lr_fn":
            out[key] = group[key] or ""
        elif key == "ns_steps":
            out[key] = int(group[key])
        elif key == "decoupled":
            out[key] = bool(group.get("decoupled_weight_decay", cls_name == "AdamW"))
        elif isinstance(GroupSpec.__dataclass_fields__[key].default, bool):
            out[key] = bool(group.get(key, False))
        else:
            out[key] = _float(group[key], key, cls_name)
    return out


def _check_class(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    name = cls.__name__
    if name in NOT_ELEMENTWISE:
        raise UnsupportedError(
            f"optimizer {cls.__module__}.{cls.__qualname__} is not supported: {NOT_ELEMENTWISE[name]}, while "
            "graphfuse updates flat shards that may cross parameter boundaries, so only elementwise updates "
            "(and those of torch.optim.Muon and Adafactor, whose parameters graphfuse keeps whole) are exact. "
            f"Supported: {SUPPORTED}"
        )
    if name not in CLASSES or cls is not getattr(torch.optim, name, None):
        raise UnsupportedError(
            f"optimizer {cls.__module__}.{cls.__qualname__} is not supported; supported: {SUPPORTED} "
            "(exact classes, not subclasses, since a subclass may change the update; graphfuse updates flat "
            "shards that may cross parameter boundaries, so only elementwise updates, and the whole-matrix updates "
            "graphfuse knows (torch.optim.Muon, Adafactor), can be compiled)"
        )
    return name


def _check_fresh(optimizer: torch.optim.Optimizer, cls_name: str) -> None:
    """No state yet; Adagrad creates its state in __init__, which is accepted while it is
    untouched and its accumulator starts at zero (graphfuse's states start at zero)."""
    for group in optimizer.param_groups:
        if (
            cls_name == "Adagrad"
            and _float(group["initial_accumulator_value"], "initial_accumulator_value", cls_name) != 0
        ):
            raise UnsupportedError(
                "Adagrad(initial_accumulator_value != 0) is not supported: graphfuse's optimizer states start "
                "at zero; use initial_accumulator_value=0"
            )
    if isinstance(optimizer.state, ShardedState):  # its owner's shards hold the state (re-captured by it)
        return
    for state in optimizer.state.values():
        fresh = (
            cls_name == "Adagrad" and float(state.get("step", 0)) == 0 and not state.get("sum", torch.zeros(())).any()
        )
        if len(state) and not fresh:
            raise UnsupportedError(
                f"{cls_name} already has state (it has stepped); pass a fresh optimizer to gf.compile "
                "and restore state with DistModel.load_state_dict or gf.load"
            )


def describe_optimizer(optimizer: torch.optim.Optimizer | Optimizers, names: dict[int, str]) -> OptimSpec:
    """Validate `optimizer` and describe it; `names` maps id(parameter) to its canonical FQN.
    Several optimizers (`Optimizers`) give one spec: their groups in order, their class names
    joined by "+"; a parameter may be in only one of them.

    Raises UnsupportedError naming the class or option, before any state is touched.
    """
    if isinstance(optimizer, Optimizers):
        specs = [describe_optimizer(o, names) for o in optimizer.optimizers]
        fqns = [f for spec in specs for g in spec.groups for f in g.params]
        twice = sorted({f for f in fqns if fqns.count(f) > 1})
        if twice:
            raise UnsupportedError(
                f"parameter(s) {', '.join(twice)} are in more than one of the optimizers; give each to one"
            )
        return OptimSpec("+".join(s.cls_name for s in specs), tuple(g for s in specs for g in s.groups))
    cls_name = _check_class(optimizer)
    _check_fresh(optimizer, cls_name)
    if any(group.get("fused") or group.get("foreach") for group in optimizer.param_groups):
        log.info(
            "graphfuse: %s(fused=/foreach=) only chooses torch's kernels; graphfuse runs its own fused "
            "update, with the numerics of foreach=False",
            cls_name,
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
        kind = CLASSES[cls_name]
        groups.append(GroupSpec(kind=kind, params=tuple(fqns), **_hyper(kind, cls_name, group, g)))
    return OptimSpec(cls_name=cls_name, groups=tuple(groups))


def check_group_unchanged(spec: GroupSpec, group: dict, g: int) -> None:
    """Hyper-parameters other than lr (and a decoupled weight decay) are baked into the graph:
    refuse a step after a scheduler changed one, rather than silently ignore it."""
    current = _hyper(spec.kind, "", group, g)
    traced = {k: getattr(spec, k) for k in current}
    if "decay" in spec.scalar_names:
        current.pop("weight_decay", None)
    if "decoupled_weight_decay" not in group:  # AdamW of a torch without the key: the class decides
        current.pop("decoupled", None)
    for key in current:
        if current[key] != traced[key]:
            pair = next((p for p, fields in PAIRS.items() if key in fields), None)
            if pair:
                key, old, new = pair, tuple(traced[f] for f in PAIRS[pair]), tuple(current[f] for f in PAIRS[pair])
            else:
                old, new = traced[key], current[key]
            may = (
                "only lr" + (" and weight_decay" if "decay" in spec.scalar_names else "") + " may change between steps"
            )
            raise UnsupportedError(
                f"param group {g}: {key} changed from {old} to {new} after gf.compile; {may}. "
                "Re-run gf.compile to use the new value"
            )


def update(
    spec: GroupSpec,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: dict[str, torch.Tensor],
    scalars: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step as pure elementwise ops; returns (new param, new states).

    Mirrors torch.optim's `_single_tensor_*` code op for op (graphfuse.optim.rules). Scalars
    that change per step are 0-d float64 tensors, which the CPU kernels read exactly as
    they read a Python float (cast to the parameter's dtype).
    """
    if spec.maximize:
        grad = torch.neg(grad)
    return RULES[spec.kind].update(spec, param, grad, states, scalars)
