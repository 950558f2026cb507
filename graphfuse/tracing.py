"""What both captures share (the whole step in graphfuse.capture, the update alone in
graphfuse.backend): example inputs, fake tensors, placeholder names, the update function."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphfuse import optim as gopt
from graphfuse import signature as sig
from graphfuse.program import TensorMeta


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), dtype_name(t.dtype), t.device.type)


def scalar_example(name: str) -> torch.Tensor:
    """The example of a per-step host scalar input: a 0-d float64, as torch.optim computes its
    scalars in Python doubles, except flags that select a branch (SGD's `first`), bools."""
    return torch.zeros((), dtype=torch.bool if name in gopt.BOOL_SCALARS else torch.float64)


def placeholder_name(spec: sig.InputSpec) -> str:
    """The graph's name of an input: its role and name, as a Python identifier."""
    return re.sub(r"\W", "_", f"{spec.role}_{spec.name}")


def name_placeholders(graph: torch.fx.Graph, specs: list[sig.InputSpec]) -> list[torch.fx.Node]:
    """Name the traced graph's placeholders after `specs` (in order) and record each spec."""
    nodes = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(nodes, specs, strict=True):
        node._rename(placeholder_name(spec))
        node.target = node.name
        node.meta["gf_input"] = spec
    return nodes


def fake_examples(mode: FakeTensorMode, specs: list[sig.InputSpec], examples: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fake tensors like `examples`; gradients and optimizer states (whose examples are their
    parameter) get fresh fakes of their own, since a fake is memoised per real tensor."""
    fakes = []
    for spec, t in zip(specs, examples, strict=True):
        fake = mode.from_tensor(t)
        if spec.role in (sig.STATE, sig.GRAD):
            with mode:
                fake = torch.empty_like(fake)
        fakes.append(fake)
    return fakes


def update_function(spec: gopt.GroupSpec) -> Callable:
    """`gopt.update` of one group as `fn(param, grad, *states, *scalars) -> [new param, *new
    states]`, in the order of spec.state_names and spec.scalar_names."""

    def fn(p, g, *rest):
        states = dict(zip(spec.state_names, rest[: len(spec.state_names)]))
        scalars = dict(zip(spec.scalar_names, rest[len(spec.state_names) :]))
        new_p, new_states = gopt.update(spec, p, g, states, scalars)
        return [new_p, *(new_states[s] for s in spec.state_names)]

    return fn
