"""Guards of a compiled step: the ranks agree that each built its program before the first
collective; what the step was specialised on (the model's parameters and modes, the optimizer's
groups, the batch) is checked at every step by identities and lengths, never tensor values; and
the bounded cache of programs traced per batch key."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from graphfuse.errors import GraphfuseError, UnsupportedError
from graphfuse.optim import Optimizers
from graphfuse.ranks import Exchange

REBUILD = "build a new DistModel with gf.compile on the changed model and optimizer"


def agree_to_start(dm, program, error: Exception | None, timeout: float | None = None) -> None:
    """Before gf.compile's first collective (rank 0's weights broadcast into the buckets), every
    rank says whether it built its program, and with which layout: a failure or another layout
    on any rank raises on every rank (the failing rank its own error), within `timeout` seconds
    for a rank that never comes, instead of leaving the others in the broadcast until the
    process group's timeout."""
    if dm.world_size == 1:
        if error is not None:
            raise error
        return
    ex = Exchange(dm.group, dm.rank, dm.world_size, dm.group_name, timeout, error=GraphfuseError)
    try:
        layouts = ex("gf.compile (build)", error, None if error else program.layout.fingerprint)
    except GraphfuseError:
        if error is not None:
            raise error from None  # this rank's own error, with its traceback
        raise
    if len(set(layouts)) > 1:
        raise UnsupportedError(
            f"gf.compile: the ranks built different bucket layouts (fingerprint by rank: {layouts}); every rank "
            "must compile the same model, optimizer, strategy and example batch shapes"
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

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Optimizers, how: str = "gf.compile"
    ) -> None:
        self.how = how  # what bound the parameters: gf.compile, or gf.shard_optimizer (whose forward is not traced)
        self.rebuild = REBUILD if how == "gf.compile" else f"build a new optimizer with {how}(..., model=model)"
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
        self.modules = [(name, m, m.training) for name, m in model.named_modules()]
        self.warned_mode = False

    def check(self) -> None:
        self._check_optimizer()
        if self.how == "gf.compile":
            self._check_mode()
        for s in self.slots:
            p = s.module._parameters.get(s.name)
            if p is not s.param:
                raise UnsupportedError(
                    f"parameter {s.fqn} was replaced by another tensor after {self.how} (model.load_state_dict("
                    "assign=True), or a new nn.Parameter assigned), so the compiled step no longer trains the model's "
                    f"parameter; load weights in place (model.load_state_dict without assign, or "
                    f"dm.load_state_dict), or {self.rebuild}"
                )
            if p.dtype != s.dtype or p.data_ptr() != s.data_ptr:
                raise UnsupportedError(
                    f"parameter {s.fqn} no longer views its bucket: its data was replaced after {self.how} "
                    f"({_was(s.dtype, p.dtype)}model.double(), .to(), .half() or `p.data = ...`), so the model "
                    f"would stop "
                    f"showing the trained weights; move or convert the model before {self.how}, or {self.rebuild}"
                )
            if p.requires_grad != s.requires_grad and id(p) in self.optimized:
                raise UnsupportedError(
                    f"parameter {s.fqn}: requires_grad changed from {s.requires_grad} to {p.requires_grad} after "
                    f"{self.how} (freezing or unfreezing); its place in the buckets and the update were traced with "
                    f"the old value. Set requires_grad before {self.how}, or {self.rebuild}"
                )

    def _check_optimizer(self) -> None:
        opt, name = self.optimizer, type(self.optimizer).__name__
        if (
            opt.param_groups is not self.groups_list
            or opt.state is not self.state
            or any(a is not b for a, b in zip(opt.param_groups, self.groups))
        ):
            raise UnsupportedError(
                f"{name}.param_groups or its state were replaced after {self.how} (assigned a new object); "
                "graphfuse keeps the optimizer state in its own shards and would ignore it. Restore optimizer "
                f"state with optimizer.load_state_dict or gf.load, which load into the shards; else {self.rebuild}"
            )
        if len(opt.param_groups) != len(self.groups):
            what = (
                "added (add_param_group)"
                if len(opt.param_groups) > len(self.groups)
                else "removed (param_groups.pop())"
            )
            raise UnsupportedError(
                f"{name} has {len(opt.param_groups)} param groups, {len(self.groups)} when {self.how} traced it: "
                f"a group was {what}, which the compiled update would ignore; {self.rebuild}"
            )
        for g, (group, ids) in enumerate(zip(opt.param_groups, self.params)):
            now = list(map(id, group["params"]))
            if now != ids:
                gone = [self.fqn.get(i, "?") for i in ids if i not in set(now)]
                new = [self.fqn.get(i, "a tensor not in the model") for i in now if i not in set(ids)]
                raise UnsupportedError(
                    f"{name} param group {g} changed after {self.how} (removed: {gone or 'none'}; added: "
                    f"{new or 'none'}; else reordered); the compiled update still covers the old list. {self.rebuild}"
                )

    def _check_mode(self) -> None:
        """train()/eval() is Python state the trace froze (dropout, batch norm): warn once."""
        if self.warned_mode:
            return
        for name, module, training in self.modules:
            if module.training != training:
                self.warned_mode = True
                warnings.warn(
                    f"graphfuse: module {name or 'model'} was switched to {'train' if module.training else 'eval'} "
                    f"mode after gf.compile, but the compiled step runs as traced ({'train' if training else 'eval'} "
                    "mode: dropout and batch norm as then). Python state read in forward is frozen at trace time; "
                    "set the mode before gf.compile, or build a new DistModel",
                    stacklevel=4,
                )
                return


class ProgramCache(OrderedDict):
    """Traced programs by batch key, least recently used first, at most `size` of them: every
    new batch shape (or non-tensor leaf value) traces a program, and they must not pile up."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.evictions = size, 0

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
        return super().get(key, default)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
            self.evictions += 1
            if self.evictions & (self.evictions - 1) == 0:  # the 1st, 2nd, 4th, 8th...: churn, not spam
                warnings.warn(
                    f"graphfuse: the program cache (Strategy.program_cache_size={self.size}) dropped a traced program "
                    f"({self.evictions} so far): batches come in more shapes than it holds, and each new one is traced "
                    "again. Pad or bucket batch shapes to a few sizes (docs/design.md), or raise program_cache_size",
                    stacklevel=4,
                )


def _was(old: torch.dtype, new: torch.dtype) -> str:
    return f"dtype {old} -> {new}: " if old != new else ""
