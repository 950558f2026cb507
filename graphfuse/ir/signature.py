"""`Signature`: the role of every placeholder and output of a program, named by FQN.

Passes find parameters, gradients and states through the signature, never by node names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Input roles.
PARAM = "param"  # a trainable parameter, one input per Parameter (tied FQNs share it)
FROZEN = "frozen"  # a parameter with requires_grad=False: read, never updated
BUFFER = "buffer"  # a module buffer (may be updated by the forward)
STATE = "state"  # an optimizer state of one parameter (name "<fqn>.<state>")
SCALAR = "scalar"  # a per-step host scalar of one param group (name "group<g>.<kind>")
BATCH = "batch"  # one leaf of the batch pytree (name "batch.<i>")
GRAD = "grad"  # a parameter's gradient, in update-only programs (gf.shard_optimizer)
BUCKET = "bucket"  # a flat parameter bucket (name "bucket<b>"), after fusion
SHARD = "shard"  # this rank's shard of a bucket's state (name "bucket<b>.<state>")
INPUT_ROLES = (PARAM, FROZEN, BUFFER, STATE, SCALAR, BATCH, GRAD, BUCKET, SHARD)

# Output roles; every output but the loss and the gradient norm names the input it replaces (`target`).
LOSS = "loss"
GRAD_NORM = "grad_norm"  # the global gradient norm before clipping (Strategy.max_grad_norm)
NEW_PARAM = "new_param"
NEW_STATE = "new_state"
NEW_BUFFER = "new_buffer"
NEW_BUCKET = "new_bucket"
NEW_SHARD = "new_shard"
NEW_BUCKET_SHARD = (
    "new_bucket_shard"  # this rank's shard of a bucket, written into that range of it (deferred all-gather)
)
OUTPUT_ROLES = (LOSS, GRAD_NORM, NEW_PARAM, NEW_STATE, NEW_BUFFER, NEW_BUCKET, NEW_SHARD, NEW_BUCKET_SHARD)
RESULT_ROLES = (LOSS, GRAD_NORM)  # outputs returned to the caller, written back nowhere

# Node phases (node.meta["phase"]).
FORWARD, BACKWARD, OPTIMIZER, COMM = "forward", "backward", "optimizer", "comm"


@dataclass(frozen=True)
class InputSpec:
    role: str
    name: str


@dataclass(frozen=True)
class OutputSpec:
    role: str
    name: str
    target: str | None = None  # the input this output's value is written back to


@dataclass(frozen=True)
class Signature:
    """Roles of inputs and outputs, the gradient node of every trainable parameter,
    the tied FQNs, and the batch's tree structure."""

    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    grads: dict[str, str] = field(default_factory=dict)  # param fqn -> gradient node name
    aliases: dict[str, str] = field(default_factory=dict)  # tied fqn -> canonical fqn
    batch_spec: str = ""  # torch.utils._pytree.treespec_dumps of the batch

    def names(self, role: str) -> list[str]:
        return [s.name for s in self.inputs if s.role == role]

    def index(self, name: str) -> int:
        for i, s in enumerate(self.inputs):
            if s.name == name:
                return i
        raise KeyError(name)

    def output_names(self, role: str) -> list[str]:
        return [s.name for s in self.outputs if s.role == role]

    def with_(self, **changes) -> Signature:
        return replace(self, **changes)

    def to_json(self) -> dict:
        return {
            "inputs": [[s.role, s.name] for s in self.inputs],
            "outputs": [[s.role, s.name, s.target] for s in self.outputs],
            "grads": dict(self.grads),
            "aliases": dict(self.aliases),
            "batch_spec": self.batch_spec,
        }

    @classmethod
    def from_json(cls, d: dict) -> Signature:
        return cls(
            inputs=tuple(InputSpec(r, n) for r, n in d["inputs"]),
            outputs=tuple(OutputSpec(r, n, t) for r, n, t in d["outputs"]),
            grads=dict(d["grads"]),
            aliases=dict(d["aliases"]),
            batch_spec=d["batch_spec"],
        )
