"""The optimizer update alone, traced into a Program (parameters, gradients, states and host
scalars in; new parameters and states out) for `gf.shard_optimizer` to fuse and shard."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphfuse import optim as gopt
from graphfuse.capture.tracing import (
    fake_examples,
    make_fx_exact,
    name_placeholders,
    scalar_example,
    tensor_meta,
    update_function,
)
from graphfuse.ir import signature as sig
from graphfuse.ir.program import PassRun, Program
from graphfuse.strategy import Strategy


def capture_update(
    params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | gopt.Optimizers, strategy: Strategy
) -> Program:
    """Trace the optimizer update alone: inputs are parameters, their gradients, states and
    host scalars; outputs the new parameters and states (the fusion passes then shard it)."""
    optim = gopt.describe_optimizer(optimizer, {id(p): n for n, p in params.items()})
    group_of = optim.group_of()
    trainable = [n for n in params if n in group_of]
    order = [n for spec in optim.groups for n in spec.params]
    inputs: list[tuple[sig.InputSpec, torch.Tensor]] = [(sig.InputSpec(sig.PARAM, n), params[n]) for n in trainable]
    inputs += [(sig.InputSpec(sig.GRAD, f"{n}.grad"), params[n]) for n in trainable]
    states_of = {n: optim.groups[group_of[n]].state_shapes(tuple(params[n].shape)) for n in trainable}
    inputs += [
        (sig.InputSpec(sig.STATE, f"{n}.{s}"), params[n] if shape == params[n].shape else params[n].new_empty(shape))
        for n in trainable
        for s, shape in states_of[n].items()
    ]
    inputs += [
        (sig.InputSpec(sig.SCALAR, f"group{g}.{s}"), scalar_example(s))
        for g, spec in enumerate(optim.groups)
        for s in spec.scalar_names
    ]
    specs, examples = [s for s, _ in inputs], [t for _, t in inputs]
    index = {s.name: i for i, s in enumerate(specs)}

    def update(*flat):
        new_params, new_states = [], []
        for g, spec in enumerate(optim.groups):
            scalars = [flat[index[f"group{g}.{s}"]] for s in spec.scalar_names]
            for n in spec.params:
                states = [flat[index[f"{n}.{s}"]] for s in states_of[n]]
                fn = update_function(spec, tuple(states_of[n]))
                new = fn(flat[index[n]], flat[index[f"{n}.grad"]], *states, *scalars)
                new_params.append(new[0])
                new_states.extend(new[1:])
        return new_params, new_states

    mode = FakeTensorMode()
    gm = make_fx_exact(update, tracing_mode="fake")(*fake_examples(mode, specs, examples))
    placeholders = name_placeholders(gm.graph, specs)
    outputs = [sig.OutputSpec(sig.NEW_PARAM, n, n) for n in order]
    outputs += [sig.OutputSpec(sig.NEW_STATE, f"{n}.{s}", f"{n}.{s}") for n in order for s in states_of[n]]
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0][0]) + tuple(out.args[0][1]),)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["phase"] = sig.OPTIMIZER
    gm.recompile()
    grads = {n: placeholders[index[f"{n}.grad"]].name for n in trainable}
    signature = sig.Signature(inputs=tuple(specs), outputs=tuple(outputs), grads=grads)
    meta = {s.name: tensor_meta(t) for s, t in zip(specs, examples)}
    return Program(gm, signature, optim, meta, strategy=strategy, passes=(PassRun("capture_update"),))
