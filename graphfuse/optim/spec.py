"""What graphfuse knows of a user's optimizer, as plain data: one GroupSpec per param group (the
hyper-parameters baked into the traced update) and the OptimSpec that holds them.

The names a GroupSpec derives (its states, host scalars, carried values) come from its rule in
`RULES`, which graphfuse/optim/rules.py fills when graphfuse.optim is imported; this module
imports nothing of the package, so that the rules can name GroupSpec without a loop."""

from __future__ import annotations

from dataclasses import dataclass

RULES: dict = {}  # kind -> graphfuse.optim.rules.Rule; filled by graphfuse.optim.rules (the package's face imports it)


@dataclass(frozen=True)
class GroupSpec:
    """Everything about one param group the traced update depends on, apart from lr."""

    kind: str  # a key of graphfuse.optim.rules.RULES: "adam" (Adam and AdamW), "sgd", "rmsprop", ...
    params: tuple[str, ...]  # canonical FQNs of the group's trainable parameters
    decoupled: bool = False  # decoupled weight decay (AdamW; NAdam, RAdam with decoupled_weight_decay)
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    alpha: float = 0.0  # RMSprop
    centered: bool = False  # RMSprop
    lr_decay: float = 0.0  # Adagrad
    momentum_decay: float = 0.0  # NAdam
    rho: float = 0.0  # Adadelta
    etaminus: float = 0.0  # Rprop's etas
    etaplus: float = 0.0
    step_size_min: float = 0.0  # Rprop's step_sizes
    step_size_max: float = 0.0
    lambd: float = 0.0  # ASGD (with alpha)
    t0: float = 0.0  # ASGD
    ns_a: float = 0.0  # Muon's Newton-Schulz coefficients (ns_coefficients), steps and lr adjustment
    ns_b: float = 0.0
    ns_c: float = 0.0
    ns_steps: int = 0
    adjust_lr_fn: str = ""  # "" for None
    beta2_decay: float = 0.0  # Adafactor: beta2_decay, eps (eps1, or None for the dtype's, and eps2) and d
    eps1: float | None = None
    eps2: float = 0.0
    d: float = 0.0

    @property
    def state_names(self) -> tuple[str, ...]:
        return RULES[self.kind].states(self)

    def state_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The states a parameter of `shape` has and the shape of each, in state_names order:
        every state shaped like its parameter, except where the rule says otherwise (Adafactor's
        row and column factors of a matrix's second moment, and the variance of a vector)."""
        own = RULES[self.kind].state_shapes
        return {s: shape for s in self.state_names} if own is None else own(self, tuple(shape))

    @property
    def scalar_names(self) -> tuple[str, ...]:
        """Per-step scalars the host computes (as torch.optim does, in Python doubles)."""
        return RULES[self.kind].scalars(self)

    @property
    def has_step(self) -> bool:
        """Whether torch.optim keeps a `step` state per parameter (all but SGD and Muon)."""
        return self.kind not in ("sgd", "muon")

    @property
    def carried_names(self) -> tuple[str, ...]:
        """What a step leaves for the next that depends on its lr (ASGD's eta), see `carried_after`."""
        return RULES[self.kind].carried

    def host_scalars(
        self, lr: float, weight_decay: float, step: int, carried: dict[str, float] | None = None
    ) -> dict[str, float | bool]:
        """The scalars of step number `step` (1-based), computed exactly as torch.optim does;
        `carried` is what step - 1 left (`carried_after`), empty before the first step."""
        return RULES[self.kind].host(self, lr, weight_decay, step, carried or {})

    def carried_after(self, lr: float, weight_decay: float, step: int) -> dict[str, float]:
        """The values step `step`, run at `lr`, leaves for the next step (torch.optim's 0-d
        states that follow the lr, as ASGD's eta: {} for every other optimizer)."""
        return RULES[self.kind].carry(self, lr, weight_decay, step)


@dataclass(frozen=True)
class OptimSpec:
    cls_name: str
    groups: tuple[GroupSpec, ...]

    def group_of(self) -> dict[str, int]:
        return {fqn: g for g, spec in enumerate(self.groups) for fqn in spec.params}
