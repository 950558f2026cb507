"""Changes to the model or optimizer after `gf.compile` that the compiled step would silently
ignore, found at the next step by comparing identities and lengths (never tensor values)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphfuse.errors import UnsupportedError

REBUILD = (
    "build a new DistModel with gf.compile on the changed model and optimizer (to carry the "
    "training state over, gf.save(dm, path, mode='balanced') before the change and gf.load after)"
)


@dataclass(frozen=True)
class _Slot:
    """One registered parameter: where it lives, and what the compiled step bound to it."""

    fqn: str
    module: torch.nn.Module
    name: str
    param: torch.nn.Parameter
    data_ptr: int
    dtype: torch.dtype
    requires_grad: bool


class Snapshot:
    """What the compiled step assumes about the model and optimizer; `check` raises
    UnsupportedError naming the first difference and the way out."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.slots = [
            _Slot(f"{prefix}.{name}" if prefix else name, module, name, p, p.data_ptr(), p.dtype, p.requires_grad)
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name, p in module._parameters.items()
            if p is not None
        ]
        self.fqn = {id(s.param): s.fqn for s in self.slots}
        self.groups_list = optimizer.param_groups
        self.groups = list(optimizer.param_groups)
        self.params = [list(map(id, g["params"])) for g in optimizer.param_groups]
        self.optimized = {i for ids in self.params for i in ids}
        self.state = optimizer.state

    def check(self) -> None:
        self._check_optimizer()
        for s in self.slots:
            p = s.module._parameters.get(s.name)
            if p is not s.param:
                raise UnsupportedError(
                    f"parameter {s.fqn} was replaced by another tensor after gf.compile (model.load_state_dict("
                    "assign=True), or a new nn.Parameter assigned), so the compiled step no longer trains the model's "
                    f"parameter; load weights in place (model.load_state_dict without assign, or dm.load_state_dict), or {REBUILD}"
                )
            if p.dtype != s.dtype or p.data_ptr() != s.data_ptr:
                raise UnsupportedError(
                    f"parameter {s.fqn} no longer views its bucket: its data was replaced after gf.compile "
                    f"({_was(s.dtype, p.dtype)}model.double(), .to(), .half() or `p.data = ...`), so the model would stop "
                    f"showing the trained weights; convert the model before gf.compile, or {REBUILD}"
                )
            if p.requires_grad != s.requires_grad and id(p) in self.optimized:
                raise UnsupportedError(
                    f"parameter {s.fqn}: requires_grad changed from {s.requires_grad} to {p.requires_grad} after "
                    "gf.compile (freezing or unfreezing); its place in the buckets and the update were traced with "
                    f"the old value. Set requires_grad before gf.compile, or {REBUILD}"
                )

    def _check_optimizer(self) -> None:
        opt, name = self.optimizer, type(self.optimizer).__name__
        if opt.param_groups is not self.groups_list or opt.state is not self.state or any(
            a is not b for a, b in zip(opt.param_groups, self.groups)
        ):
            raise UnsupportedError(
                f"{name}.param_groups or its state were replaced after gf.compile (optimizer.load_state_dict?); "
                "graphfuse keeps the optimizer state in its own shards and would ignore it. Load optimizer state "
                f"before gf.compile, or restore it with dm.load_state_dict / gf.load; else {REBUILD}"
            )
        if len(opt.param_groups) != len(self.groups):
            what = "added (add_param_group)" if len(opt.param_groups) > len(self.groups) else "removed (param_groups.pop())"
            raise UnsupportedError(
                f"{name} has {len(opt.param_groups)} param groups, {len(self.groups)} when gf.compile traced it: "
                f"a group was {what}, which the compiled update would ignore; {REBUILD}"
            )
        for g, (group, ids) in enumerate(zip(opt.param_groups, self.params)):
            now = list(map(id, group["params"]))
            if now != ids:
                gone = [self.fqn.get(i, "?") for i in ids if i not in set(now)]
                new = [self.fqn.get(i, "a tensor not in the model") for i in now if i not in set(ids)]
                raise UnsupportedError(
                    f"{name} param group {g} changed after gf.compile (removed: {gone or 'none'}; added: "
                    f"{new or 'none'}; else reordered); the compiled update still covers the old list. {REBUILD}"
                )


def _was(old: torch.dtype, new: torch.dtype) -> str:
    return f"dtype {old} -> {new}: " if old != new else ""
