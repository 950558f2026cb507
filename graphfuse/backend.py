"""The `torch.compile(model, backend="graphfuse")` path: the backend compiles the model's
forward and backward (inductor through AOTAutograd), and `shard_optimizer` runs the
optimizer step as a fused, sharded ZeRO-1 program built by the same passes as gf.compile:
one reduce-scatter per bucket, one fused update per shard, one all-gather per bucket."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from graphfuse import optim as gopt
from graphfuse import signature as sig
from graphfuse.errors import UnsupportedError
from graphfuse.execute import arguments, backend_of, bind_tensors, compile_in_place, group_info, run_step
from graphfuse.inductor import compile_graph
from graphfuse.passes import run_pipeline, verify
from graphfuse.program import PassRun, Program
from graphfuse.strategy import Strategy
from graphfuse.tracing import fake_examples, name_placeholders, scalar_example, tensor_meta, update_function


def graphfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """torch.compile backend "graphfuse": forward and backward compiled by inductor. Pair it
    with `gf.shard_optimizer(optimizer)` for the fused, sharded optimizer step."""
    return compile_graph(gm, example_inputs)


def capture_update(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, strategy: Strategy) -> Program:
    """Trace the optimizer update alone: inputs are parameters, their gradients, states and
    host scalars; outputs the new parameters and states (the fusion passes then shard it)."""
    optim = gopt.describe_optimizer(optimizer, {id(p): n for n, p in params.items()})
    group_of = optim.group_of()
    trainable = [n for n in params if n in group_of]
    order = [n for spec in optim.groups for n in spec.params]
    inputs = [(sig.InputSpec(sig.PARAM, n), params[n]) for n in trainable]
    inputs += [(sig.InputSpec(sig.GRAD, f"{n}.grad"), params[n]) for n in trainable]
    inputs += [(sig.InputSpec(sig.STATE, f"{n}.{s}"), params[n]) for n in trainable for s in optim.groups[group_of[n]].state_names]
    inputs += [(sig.InputSpec(sig.SCALAR, f"group{g}.{s}"), scalar_example(s)) for g, spec in enumerate(optim.groups) for s in spec.scalar_names]
    specs, examples = [s for s, _ in inputs], [t for _, t in inputs]
    index = {s.name: i for i, s in enumerate(specs)}
    updates = [update_function(spec) for spec in optim.groups]

    def update(*flat):
        new_params, new_states = [], []
        for g, spec in enumerate(optim.groups):
            scalars = [flat[index[f"group{g}.{s}"]] for s in spec.scalar_names]
            for n in spec.params:
                states = [flat[index[f"{n}.{s}"]] for s in spec.state_names]
                new = updates[g](flat[index[n]], flat[index[f"{n}.grad"]], *states, *scalars)
                new_params.append(new[0])
                new_states.extend(new[1:])
        return new_params, new_states

    mode = FakeTensorMode()
    gm = make_fx(update, tracing_mode="fake")(*fake_examples(mode, specs, examples))
    placeholders = name_placeholders(gm.graph, specs)
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
    return Program(gm, signature, optim, meta, strategy=strategy, passes=(PassRun("capture_update"),))


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
        self.strategy = strategy = strategy.for_backend(backend_of(self.group, device), device)
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
