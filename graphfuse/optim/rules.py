"""The table of the torch.optim updates graphfuse compiles (elementwise, and the whole-matrix
ones of Muon and Adafactor), one rule per optimizer: the hyper-parameters it bakes in, its states, the per-step scalars
the host computes, and its update (graphfuse/optim/updates.py); and the torch.optim class each
rule stands for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphfuse.optim import matrix as m
from graphfuse.optim import updates as u
from graphfuse.optim.spec import RULES, GroupSpec

T = torch.Tensor


@dataclass(frozen=True)
class Rule:
    """One optimizer: `hyper` are the param-group keys baked into the traced update
    ("betas" fills beta1 and beta2); `states(spec)` and `scalars(spec)` name the update's
    per-element states and per-step host scalars, `host(spec, lr, wd, step, carried)` computes
    the scalars of step `step` (1-based) as torch does in Python doubles, `update` is the step.
    `state_shapes(spec, shape)`, where states are not all shaped like their parameter, gives the
    states a parameter of `shape` has and their shapes (GroupSpec.state_shapes).
    `carry(spec, lr, wd, step)` gives the values named `carried` that step `step` leaves for the
    next one and that depend on its lr (ASGD's eta; torch keeps them as 0-d states): the runtime
    hands them to the next step's `host`, and checkpoints save and restore them under their names.
    Whether an update reads each parameter whole (Muon's, graphfuse.optim.matrix) is decided
    from its trace (graphfuse.capture.tracing.reads_whole), not declared here."""

    kind: str
    hyper: tuple[str, ...]
    states: Callable[[GroupSpec], tuple[str, ...]]
    scalars: Callable[[GroupSpec], tuple[str, ...]]
    host: Callable[[GroupSpec, float, float, int, dict], dict]
    update: Callable[[GroupSpec, T, T, dict, dict], tuple[T, dict]]
    carried: tuple[str, ...] = ()
    carry: Callable[[GroupSpec, float, float, int], dict[str, float]] = lambda spec, lr, wd, step: {}
    state_shapes: Callable[[GroupSpec, tuple[int, ...]], dict[str, tuple[int, ...]]] | None = None


def _fixed(*names: str) -> Callable:
    return lambda spec: names


_BASE = ("eps", "weight_decay", "maximize")
RULES.update(
    {
        rule.kind: rule
        for rule in (
            Rule(
                "adam",
                ("betas", *_BASE, "amsgrad", "decoupled"),
                u.adam_states,
                lambda s: u.decay(s) + ("neg_step_size", "bc2_sqrt"),
                u.adam_host,
                u.adam,
            ),
            Rule(
                "sgd",
                ("weight_decay", "maximize", "momentum", "dampening", "nesterov"),
                lambda s: ("momentum_buffer",) if s.momentum != 0 else (),
                lambda s: ("lr",) + (("first",) if s.momentum != 0 and s.dampening != 0 else ()),
                u.sgd_host,
                u.sgd,
            ),
            Rule(
                "rmsprop",
                ("alpha", *_BASE, "momentum", "centered"),
                u.rmsprop_states,
                lambda s: ("lr",) if s.momentum > 0 else ("neg_lr",),
                lambda s, lr, wd, step, carried: {"lr": lr} if s.momentum > 0 else {"neg_lr": -lr},
                u.rmsprop,
            ),
            Rule(
                "adagrad",
                ("lr_decay", *_BASE),
                _fixed("sum"),
                _fixed("neg_clr"),
                lambda s, lr, wd, step, carried: {"neg_clr": -(lr / (1 + (float(step) - 1) * s.lr_decay))},
                u.adagrad,
            ),
            Rule(
                "adamax",
                ("betas", *_BASE),
                _fixed("exp_avg", "exp_inf"),
                _fixed("neg_clr"),
                lambda s, lr, wd, step, carried: {"neg_clr": -(lr / (1 - s.beta1 ** float(step)))},
                u.adamax,
            ),
            Rule(
                "nadam",
                ("betas", *_BASE, "momentum_decay", "decoupled"),
                _fixed("exp_avg", "exp_avg_sq"),
                lambda s: u.decay(s) + ("bc2", "grad_coef", "avg_coef"),
                u.nadam_host,
                u.nadam,
            ),
            Rule(
                "radam",
                ("betas", *_BASE, "decoupled"),
                _fixed("exp_avg", "exp_avg_sq"),
                lambda s: u.decay(s) + ("lr", "bc1", "bc2_sqrt", "rect", "rectified"),
                u.radam_host,
                u.radam,
            ),
            Rule(
                "adadelta",
                ("rho", *_BASE),
                _fixed("square_avg", "acc_delta"),
                _fixed("lr"),
                lambda s, lr, wd, step, carried: {"lr": lr},
                u.adadelta,
            ),
            Rule(
                "rprop",
                ("etas", "step_sizes", "maximize"),
                _fixed("prev", "step_size"),
                _fixed("lr", "first"),
                lambda s, lr, wd, step, carried: {"lr": lr, "first": step == 1},
                u.rprop,
            ),
            Rule(
                "asgd",
                ("lambd", "alpha", "t0", "weight_decay", "maximize"),
                _fixed("ax"),
                _fixed("shrink", "eta", "mu", "average"),
                u.asgd_host,
                u.asgd,
                ("eta",),
                lambda s, lr, wd, step: {"eta": u.asgd_eta(s, lr, step)},
            ),
            Rule(
                "muon",
                ("weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"),
                _fixed("momentum_buffer"),
                _fixed("lr", "decay"),
                m.muon_host,
                m.muon,
            ),
            Rule(
                "adafactor",
                ("beta2_decay", "eps", "d", "weight_decay", "maximize"),
                _fixed("row_var", "col_var", "variance"),
                _fixed("beta2_weight", "rho", "decay"),
                m.adafactor_host,
                m.adafactor,
                state_shapes=m.adafactor_states,
            ),
        )
    }
)

# The torch.optim class of each rule (exact classes: a subclass may change the update).
CLASSES: dict[str, str] = {
    "AdamW": "adam",
    "Adam": "adam",
    "SGD": "sgd",
    "RMSprop": "rmsprop",
    "Adagrad": "adagrad",
    "Adamax": "adamax",
    "NAdam": "nadam",
    "RAdam": "radam",
    "Adadelta": "adadelta",
    "Rprop": "rprop",
    "ASGD": "asgd",
    "Muon": "muon",
    "Adafactor": "adafactor",
}
BOOL_SCALARS = ("first", "rectified", "average")  # host flags that select between traced branches
