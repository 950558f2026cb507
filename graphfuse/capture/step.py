"""`capture`: trace forward, loss, backward and the optimizer update of one training step
into ONE aten-level FX graph, with a `Signature` naming every input and output."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils.stateless import _reparametrize_module

from graphfuse import optim as gopt
from graphfuse.capture.phases import mark_phases
from graphfuse.capture.tracing import (
    make_fx_exact,
    module_of_error,
    reads_whole,
    scalar_example,
    tensor_meta,
    trace,
    update_function,
)
from graphfuse.errors import GraphfuseError, UnsupportedError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import PassRun, Program
from graphfuse.strategy import Strategy

log = logging.getLogger("graphfuse")
OptimizerArg = torch.optim.Optimizer | gopt.Optimizers | Sequence[torch.optim.Optimizer]  # a list: several as one


# ---- capture ------------------------------------------------------------------------------


@contextlib.contextmanager
def presenting_as_compiling(on: bool = True) -> Iterator[None]:
    """Make `torch.compiler.is_compiling()` return `on`: true as models written for
    torch.compile expect; they then skip data-dependent checks that fake tensors cannot answer."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = on
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


class _ModelInfo:
    """Parameters (deduplicated, with tied aliases), buffers, and the optimizer's view of them."""

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerArg) -> None:
        self.params: dict[str, torch.nn.Parameter] = {}
        self.aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                self.aliases[fqn] = first[id(p)]
            else:
                first[id(p)] = fqn
                self.params[fqn] = p
        self.buffers: dict[str, torch.Tensor] = {}
        for fqn, b in model.named_buffers(remove_duplicate=False):
            if fqn not in self.buffers:
                self.buffers[fqn] = b
        self.optim = gopt.describe_optimizer(gopt.as_one(optimizer), first)  # a list: several optimizers
        self.group_of = self.optim.group_of()
        self.trainable = [f for f in self.params if f in self.group_of]
        self.frozen = [f for f in self.params if f not in self.group_of]
        for fqn, p in self.params.items():
            if p.is_complex() or not p.is_floating_point():
                raise UnsupportedError(
                    f"parameter {fqn} has dtype {p.dtype}; only real floating-point parameters are supported"
                )
            if p.is_sparse:
                raise UnsupportedError(f"parameter {fqn} is sparse; only dense parameters are supported")


class _Batch:
    """The example batch as leaves and a tree spec, and its split into micro-batches."""

    def __init__(self, batch, micro_batches: int) -> None:
        self.leaves, self.spec = pytree.tree_flatten(batch)
        self.is_tensor = [isinstance(x, torch.Tensor) for x in self.leaves]
        self.k = micro_batches
        for x in self.leaves:
            if self.k > 1 and isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % self.k):
                raise UnsupportedError(
                    f"grad_accumulation={self.k} splits every batch tensor along dim 0, but a batch leaf has "
                    f"shape {tuple(x.shape)}; use a batch whose first dimension is a multiple of {self.k}"
                )

    def micro_batches(self, tensors: list[torch.Tensor]) -> list:
        """The batch with `tensors` in place of its tensor leaves, split into k micro-batches."""
        it = iter(tensors)
        batch = pytree.tree_unflatten([next(it) if t else x for x, t in zip(self.leaves, self.is_tensor)], self.spec)
        if self.k == 1:
            return [batch]
        return [
            pytree.tree_map(lambda x, i=i: x.chunk(self.k)[i] if isinstance(x, torch.Tensor) else x, batch)
            for i in range(self.k)
        ]


def capture(
    model: torch.nn.Module,
    optimizer: OptimizerArg,
    loss_fn: Callable,
    example_batch,
    strategy: Strategy | None = None,
) -> Program:
    """Trace one whole training step of `model` under `optimizer` into a `Program`.

    `loss_fn(model, batch)` returns a scalar tensor. The program's inputs are the trainable
    parameters, frozen parameters, buffers, optimizer states, per-step host scalars and the
    batch leaves; its outputs are the loss and the new parameters, states and buffers.
    """
    strategy = strategy or Strategy()
    info = _ModelInfo(model, optimizer)
    batch = _Batch(example_batch, strategy.grad_accumulation)
    specs, examples = _step_inputs(info, batch)
    traced = _trace_step(model, loss_fn, info, batch, specs, examples)
    loss, new_buffers, grads = _step_outputs(traced.graph, len(info.buffers))
    outputs = [(sig.OutputSpec(sig.LOSS, "loss"), loss)]
    outputs += _add_updates(traced.graph, info, dict(zip(info.trainable, grads)))
    outputs += _changed_buffers(traced.graph, info, new_buffers)
    traced.graph.output_node().args = (tuple(n for _, n in outputs),)
    traced.graph.eliminate_dead_code()
    mark_phases(traced.graph, loss, new_buffers, grads)
    traced.recompile()
    signature = sig.Signature(
        inputs=tuple(specs),
        outputs=tuple(s for s, _ in outputs),
        grads={fqn: n.name for fqn, n in zip(info.trainable, grads)},
        aliases=dict(info.aliases),
        batch_spec=pytree.treespec_dumps(batch.spec) if all(batch.is_tensor) else "",
    )
    inputs_meta = {s.name: tensor_meta(t) for s, t in zip(specs, examples)}
    return Program(traced, signature, info.optim, inputs_meta, strategy=strategy, passes=(PassRun("capture"),))


def _step_inputs(info: _ModelInfo, batch: _Batch) -> tuple[list[sig.InputSpec], list[torch.Tensor]]:
    """The program's inputs in order, each with an example tensor of its shape and dtype."""
    inputs: list[tuple[sig.InputSpec, torch.Tensor]] = [
        (sig.InputSpec(sig.PARAM, f), info.params[f]) for f in info.trainable
    ]
    inputs += [(sig.InputSpec(sig.FROZEN, f), info.params[f]) for f in info.frozen]
    inputs += [(sig.InputSpec(sig.BUFFER, f), b) for f, b in info.buffers.items()]
    for fqn in info.trainable:  # a state shaped like its parameter is traced with it (tracing is fake)
        p = info.params[fqn]
        inputs += [
            (sig.InputSpec(sig.STATE, f"{fqn}.{s}"), p if shape == p.shape else p.new_empty(shape))
            for s, shape in info.optim.groups[info.group_of[fqn]].state_shapes(tuple(p.shape)).items()
        ]
    for g, gspec in enumerate(info.optim.groups):
        inputs += [(sig.InputSpec(sig.SCALAR, f"group{g}.{s}"), scalar_example(s)) for s in gspec.scalar_names]
    inputs += [
        (sig.InputSpec(sig.BATCH, f"batch.{i}"), x) for i, x in enumerate(batch.leaves) if isinstance(x, torch.Tensor)
    ]
    return [s for s, _ in inputs], [t for _, t in inputs]


def _step_function(
    model: torch.nn.Module, loss_fn: Callable, info: _ModelInfo, batch: _Batch, compiling: bool
) -> Callable:
    """The step as a function of the inputs in `_step_inputs` order (the optimizer's states
    and scalars are passed and unused: the update is added per group afterwards), returning
    (loss, new buffers, gradients)."""
    n_train, n_frozen, n_buf = len(info.trainable), len(info.frozen), len(info.buffers)
    n_batch = sum(batch.is_tensor)

    def loss_of(params, frozen, buffers, micro_batch):
        buffers = [b.clone() for b in buffers]  # the forward may update buffers in place
        tensors = dict(zip(info.trainable, params))
        tensors.update(zip(info.frozen, frozen))
        tensors.update(zip(info.buffers, buffers))
        for alias, canonical in info.aliases.items():
            tensors[alias] = tensors[canonical]
        with _reparametrize_module(model, tensors):
            loss = loss_fn(model, micro_batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UnsupportedError("loss_fn(model, batch) must return a scalar tensor")
        return (loss / batch.k if batch.k > 1 else loss), buffers

    def step(*flat):
        params, frozen = list(flat[:n_train]), flat[n_train : n_train + n_frozen]
        buffers = list(flat[n_train + n_frozen : n_train + n_frozen + n_buf])
        grads = total = None
        # torch.autograd.grad (as AOTAutograd's joint graph does), not torch.func.grad: functorch
        # decomposes some backward kernels (silu_backward) into ops that round differently.
        with presenting_as_compiling(compiling), torch.enable_grad():
            for micro_batch in batch.micro_batches(list(flat[len(flat) - n_batch :])):
                loss, buffers = loss_of(params, frozen, buffers, micro_batch)
                g = _gradients(loss, params)
                unused = [f for f, x in zip(info.trainable, g) if x is None]
                if unused:
                    raise UnsupportedError(
                        f"parameter(s) {', '.join(unused)} get no gradient from loss_fn, so torch.optim would skip "
                        "them while graphfuse's fused update would not; set requires_grad=False on them or "
                        "leave them out of the optimizer (inside torch.utils.checkpoint(..., use_reentrant=True) "
                        "whose inputs need no gradient, they get none in eager PyTorch either: use use_reentrant=False)"
                    )
                grads = list(g) if grads is None else [a + b for a, b in zip(grads, g)]
                loss = loss.detach()
                total = loss if total is None else total + loss
        return total, buffers, grads

    return step


def _trace_step(
    model: torch.nn.Module, loss_fn: Callable, info: _ModelInfo, batch: _Batch, specs, examples
) -> torch.fx.GraphModule:
    """Trace the step on the path eager PyTorch takes: host reads of values computed from
    constants are answered (ConstantValues) and `torch.compiler.is_compiling()` is false. A
    step that reads a value depending on an input is traced again presenting as compiling,
    as models written for torch.compile expect (they then skip such reads); that path may
    differ from eager's (docs/models.md)."""
    try:
        return trace(_step_function(model, loss_fn, info, batch, compiling=False), specs, examples)
    except GraphfuseError:
        raise
    except Exception as e:  # noqa: BLE001 (any failure of the eager path: the compiling path decides)
        log.info("graphfuse: tracing the step as eager runs it failed (%r); tracing it as compiling", e)
    try:
        return trace(_step_function(model, loss_fn, info, batch, compiling=True), specs, examples)
    except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode) as e:
        raise UnsupportedError(
            f"the training step reads a tensor's value on the host{module_of_error(e, model)} ({e}: .item(), "
            f"float(t), int(t), "
            "`if t:`, or an op whose output shape depends on values, such as nonzero); graphfuse traces "
            "with fake tensors and cannot follow that. Keep such values as tensors (torch.where instead "
            "of `if`), or guard the code with torch.compiler.is_compiling(), which is true while tracing"
        ) from e


def _step_outputs(
    graph: torch.fx.Graph, n_buffers: int
) -> tuple[torch.fx.Node, list[torch.fx.Node], list[torch.fx.Node]]:
    """(loss, new buffers, gradients): the step's (loss, buffers, grads), flattened in the output node."""
    flat = [x for x in pytree.tree_leaves(graph.output_node().args) if isinstance(x, torch.fx.Node)]
    return flat[0], flat[1 : 1 + n_buffers], flat[1 + n_buffers :]


def _add_updates(
    graph: torch.fx.Graph, info: _ModelInfo, grad_of: dict[str, torch.fx.Node]
) -> list[tuple[sig.OutputSpec, torch.fx.Node]]:
    """Append the optimizer update of every trainable parameter; return the new parameters'
    and states' outputs.

    The update is elementwise, the same ops for every parameter of a group: it is traced once
    per group and copied per parameter, far cheaper than dispatching every op through
    functionalization and fake tensors again. Every node it copies has the parameter's shape
    and dtype (_trace_update checks), so each gets a fake value shaped like the parameter."""
    by_name = {n.meta["gf_input"].name: n for n in graph.nodes if n.op == "placeholder"}
    templates: dict[tuple, torch.fx.Graph] = {}
    new_params, new_states = [], []
    for g, gspec in enumerate(info.optim.groups):
        scalars = [by_name[f"group{g}.{s}"] for s in gspec.scalar_names]
        whole = reads_whole(gspec)  # traced per shape: its ops are not all shaped like the parameter
        for fqn in gspec.params:
            p = info.params[fqn]
            key = (g, p.dtype, p.device.type) + ((tuple(p.shape),) if whole else ())
            if key not in templates:
                templates[key] = _trace_update(gspec, p.dtype, p.device.type, tuple(p.shape) if whole else None)
            template = templates[key]
            states = tuple(gspec.state_shapes(tuple(p.shape)))
            args = [by_name[fqn], grad_of[fqn], *(by_name[f"{fqn}.{s}"] for s in states), *scalars]
            val_map = dict(zip([n for n in template.nodes if n.op == "placeholder"], args))
            with graph.inserting_before(graph.output_node()):
                new = cast(Sequence[torch.fx.Node], graph.graph_copy(template, val_map))  # [param, *states]
            param_val = by_name[fqn].meta["val"]
            with param_val.fake_mode:
                for t_node in template.nodes:
                    if t_node.op == "call_function":
                        v = t_node.meta["val"]  # a whole update's template has this parameter's shapes
                        val_map[t_node].meta["val"] = (
                            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=param_val.device)
                            if whole
                            else torch.empty_like(param_val, dtype=v.dtype)
                        )
            new_params.append((sig.OutputSpec(sig.NEW_PARAM, fqn, fqn), new[0]))
            new_states += [
                (sig.OutputSpec(sig.NEW_STATE, f"{fqn}.{s}", f"{fqn}.{s}"), n) for s, n in zip(states, new[1:])
            ]
    return new_params + new_states


def _changed_buffers(
    graph: torch.fx.Graph, info: _ModelInfo, new_buffers: list[torch.fx.Node]
) -> list[tuple[sig.OutputSpec, torch.fx.Node]]:
    """Outputs for the buffers the forward wrote (a buffer returned as it came in is not)."""
    by_name = {n.meta["gf_input"].name: n for n in graph.nodes if n.op == "placeholder"}
    return [
        (sig.OutputSpec(sig.NEW_BUFFER, fqn, fqn), n)
        for fqn, n in zip(info.buffers, new_buffers)
        if not _unchanged(n, by_name[fqn])
    ]


def _trace_update(
    spec: gopt.GroupSpec, dtype: torch.dtype, device: str, whole: tuple[int, ...] | None = None
) -> torch.fx.Graph:
    """`update_function(spec)` of one parameter as a graph whose placeholders are (param, grad,
    *states, *scalars) and whose output is [new param, *new states]; every op in it is
    elementwise and gives a tensor of the parameter's shape and dtype, so it serves parameters
    of any shape. An update that reads its parameter whole is traced at that parameter's shape
    `whole`, with the states a parameter of that shape has, each in its own shape."""
    shape = (2, 3) if whole is None else whole
    states = spec.state_shapes(shape)
    with FakeTensorMode():
        tensors = [torch.empty(s, dtype=dtype, device=device) for s in (shape, shape, *states.values())]
        scalars = [scalar_example(s) for s in spec.scalar_names]
    graph = make_fx_exact(update_function(spec, tuple(states)), tracing_mode="fake")(*tensors, *scalars).graph
    if whole is not None:
        return graph
    for n in graph.nodes:
        val = n.meta.get("val")
        # Boolean masks of the same shape (Rprop's sign tests) are elementwise too.
        if n.op == "call_function" and (tuple(val.shape) != shape or val.dtype not in (dtype, torch.bool)):
            raise UnsupportedError(
                f"the {spec.kind} update is not elementwise: {n.format_node()} gives {val.shape} {val.dtype}"
            )
    return graph


def _unchanged(out: torch.fx.Node, placeholder: torch.fx.Node) -> bool:
    if out is placeholder:
        return True
    return out.op == "call_function" and out.target is torch.ops.aten.clone.default and out.args[0] is placeholder


def _gradients(loss: torch.Tensor, params: list[torch.Tensor]) -> tuple:
    try:
        return torch.autograd.grad(loss, params, allow_unused=True)
    except RuntimeError as e:
        if "use_reentrant=True" in str(e):  # its backward re-runs forward under .backward() only
            raise UnsupportedError(
                "loss_fn uses torch.utils.checkpoint(..., use_reentrant=True) (reentrant activation "
                "checkpointing), which only works under .backward(), not the torch.autograd.grad that "
                "graphfuse traces; pass use_reentrant=False (for transformers models: "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
            ) from e
        raise
