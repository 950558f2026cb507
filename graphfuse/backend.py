"""The `torch.compile(model, backend="graphfuse")` path: the backend compiles the model's
forward and backward (inductor through AOTAutograd), and `shard_optimizer` runs the
optimizer step as a fused, sharded ZeRO-1 program built by the same passes as gf.compile:
one reduce-scatter per bucket, one fused update per shard, one all-gather per bucket."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from graphfuse import optim as gopt
from graphfuse import signature as sig
from graphfuse.capture import tensor_meta
from graphfuse.errors import UnsupportedError
from graphfuse.passes import run_pipeline, verify
from graphfuse.passes._graph import sanitize
from graphfuse.program import Program
from graphfuse.runtime import arguments, backend_of, bind_tensors, compile_in_place, group_info, run_step
from graphfuse.strategy import Strategy

log = logging.getLogger("graphfuse")


def graphfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """torch.compile backend "graphfuse": forward and backward compiled by inductor. Pair it
    with `gf.shard_optimizer(optimizer)` for the fused, sharded optimizer step."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def capture_update(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, strategy: Strategy) -> Program:
    """Trace the optimizer update alone: inputs are parameters, their gradients, states and
    host scalars; outputs the new parameters and states (the fusion passes then shard it)."""
    names = {id(p): n for n, p in params.items()}
    optim = gopt.describe_optimizer(optimizer, names)
    group_of = optim.group_of()
    trainable = [n for n in params if n in group_of]
    specs, examples = [], []
    for n in trainable:
        specs.append(sig.InputSpec(sig.PARAM, n))
        examples.append(params[n])
    for n in trainable:
        specs.append(sig.InputSpec(sig.GRAD, f"{n}.grad"))
        examples.append(params[n])
    for n in trainable:
        for s in optim.groups[group_of[n]].state_names:
            specs.append(sig.InputSpec(sig.STATE, f"{n}.{s}"))
            examples.append(params[n])
    for g, spec in enumerate(optim.groups):
        for s in spec.scalar_names:
            specs.append(sig.InputSpec(sig.SCALAR, f"group{g}.{s}"))
            examples.append(torch.zeros((), dtype=torch.bool if s == "first" else torch.float64))
    index = {s.name: i for i, s in enumerate(specs)}

    def update(*flat):
        new_params, new_states = [], []
        for g, spec in enumerate(optim.groups):
            scalars = {s: flat[index[f"group{g}.{s}"]] for s in spec.scalar_names}
            for n in spec.params:
                states = {s: flat[index[f"{n}.{s}"]] for s in spec.state_names}
                p, st = gopt.update(spec, flat[index[n]], flat[index[f"{n}.grad"]], states, scalars)
                new_params.append(p)
                new_states.extend(st[s] for s in spec.state_names)
        return new_params, new_states

    mode = FakeTensorMode()
    fakes = []
    for spec, t in zip(specs, examples):
        fake = mode.from_tensor(t)
        if spec.role in (sig.GRAD, sig.STATE):  # fresh tensors: fakes are memoised per real tensor
            with mode:
                fake = torch.empty_like(fake)
        fakes.append(fake)
    gm = make_fx(update, tracing_mode="fake")(*fakes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, specs):
        node._rename(sanitize(f"{spec.role}_{spec.name}"))
        node.target = node.name
        node.meta["gf_input"] = spec
    order = [n for spec in optim.groups for n in spec.params]
    outputs = [sig.OutputSpec(sig.NEW_PARAM, n, n) for n in order]
    outputs += [sig.OutputSpec(sig.NEW_STATE, f"{n}.{s}", f"{n}.{s}") for n in order for s in optim.groups[group_of[n]].state_names]
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0][0]) + tuple(out.args[0][1]),)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["phase"] = sig.OPTIMIZER
    gm.recompile()
    grads = {n: placeholders[index[f"{n}.grad"]].name for n in trainable}
    signature = sig.Signature(inputs=tuple(specs), outputs=tuple(outputs), grads=grads)
    meta = {s.name: tensor_meta(t) for s, t in zip(specs, examples)}
    return Program(gm, signature, optim, meta, strategy=strategy, passes=("capture_update",))


class ShardedOptimizer:
    """ZeRO-1 over fused buckets for an eagerly (or torch.compile-) computed backward.

    `step()` reads each parameter's `.grad`, reduce-scatters the packed gradients once per
    bucket, updates this rank's shard with one fused update and all-gathers the buckets.
    Learning-rate schedulers keep driving the wrapped optimizer's param_groups.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Strategy | None = None, group=None) -> None:
        strategy = strategy or Strategy()
        if strategy.grad_accumulation != 1 or strategy.max_grad_norm is not None:
            raise UnsupportedError(
                "gf.shard_optimizer runs the optimizer step only: accumulate gradients in your loop and clip them "
                "with torch.nn.utils.clip_grad_norm_ before step(), or use gf.compile for in-graph accumulation and clipping"
            )
        self.optimizer = optimizer
        self.group, self.world_size, self.rank, self.group_name = group_info(group)
        device = optimizer.param_groups[0]["params"][0].device.type
        self.strategy = strategy = strategy.for_backend(backend_of(self.group, device))
        self.params = {f"param{i}": p for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        program = capture_update(self.params, optimizer, strategy)
        # Without a backward graph, assume gradients arrive in reverse registration order.
        reversed_grads = dict(reversed(list(program.signature.grads.items())))
        program = program.with_(
            signature=program.signature.with_(grads=reversed_grads),
            world_size=self.world_size,
            rank=self.rank,
            group_name=self.group_name,
        )
        self.program = verify(run_pipeline(program))
        self.layout = self.program.layout
        self.tensors = bind_tensors(self.program, self.params, {}, self.group)
        self.steps = [0] * len(self.program.optim.groups)
        self._fn = self.program.graph_module if strategy.compile == "eager" else None  # inductor: at the first step

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for spec in self.program.signature.inputs:
            if spec.role == sig.GRAD:
                p = self.params[spec.name.removesuffix(".grad")]
                if p.grad is None:
                    raise UnsupportedError(
                        f"a parameter of shape {tuple(p.shape)} has no gradient at step(); every optimized "
                        "parameter must get one (or leave it out of the optimizer)"
                    )
                grads.append(p.grad)
        return grads

    def step(self) -> None:
        steps = [s + 1 for s in self.steps]
        grads = self._grads()
        if self._fn is None:  # inductor compiles for the gradients' devices and strides
            self._fn = compile_in_place(self.program, arguments(self.program, self.tensors, grads))
        run_step(self.program, self._fn, self.tensors, self.optimizer.param_groups, steps, grads)
        self.steps = steps
        self.optimizer._opt_called = True  # the optimizer has stepped: LR schedulers check this

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def shard_optimizer(optimizer: torch.optim.Optimizer, strategy: Strategy | None = None, group: dist.ProcessGroup | None = None) -> ShardedOptimizer:
    """The optimizer for `torch.compile(model, backend="graphfuse")`: a fused, sharded ZeRO-1
    step over `group` (the default process group if initialised, else world size 1)."""
    return ShardedOptimizer(optimizer, strategy, group)
