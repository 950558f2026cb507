"""`capture`: trace forward, loss, backward and the optimizer update of one training step
into ONE aten-level FX graph, with a `Signature` naming every input and output."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils.stateless import _reparametrize_module

from graphfuse import optim as gopt
from graphfuse import signature as sig
from graphfuse.errors import UnsupportedError
from graphfuse.program import Program, TensorMeta
from graphfuse.strategy import Strategy

log = logging.getLogger("graphfuse")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), dtype_name(t.dtype), t.device.type)


def batch_key(batch) -> tuple:
    """What a traced program is specialised on: the batch's structure, and each leaf's shape,
    dtype and device (tensors) or value (anything else)."""
    return flatten_batch(batch)[0]


def flatten_batch(batch) -> tuple[tuple, list[torch.Tensor]]:
    """(`batch_key(batch)`, the batch's tensor leaves in order), with one flatten."""
    leaves, spec = pytree.tree_flatten(batch)
    key = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(tensor_meta(leaf))
        else:
            key.append(("const", repr(leaf)))
    return (str(spec), tuple(key)), [x for x in leaves if isinstance(x, torch.Tensor)]


def program_batch_key(program: Program) -> tuple:
    """`batch_key` of the batches `program` was traced for (all batch leaves are tensors)."""
    spec = pytree.treespec_loads(program.signature.batch_spec)
    return (str(spec), tuple(program.inputs_meta[n] for n in program.signature.names(sig.BATCH)))


@contextlib.contextmanager
def presenting_as_compiling() -> Iterator[None]:
    """Make `torch.compiler.is_compiling()` true, as models written for torch.compile expect;
    they then skip data-dependent checks that fake tensors cannot answer."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def _sanitize(name: str) -> str:
    return re.sub(r"\W", "_", name)


class _ModelInfo:
    """Parameters (deduplicated, with tied aliases), buffers, and the optimizer's view of them."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
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
        self.optim = gopt.describe_optimizer(optimizer, first)
        self.group_of = self.optim.group_of()
        self.trainable = [f for f in self.params if f in self.group_of]
        self.frozen = [f for f in self.params if f not in self.group_of]
        for fqn, p in self.params.items():
            if p.is_complex() or not p.is_floating_point():
                raise UnsupportedError(f"parameter {fqn} has dtype {p.dtype}; only real floating-point parameters are supported")
            if p.is_sparse:
                raise UnsupportedError(f"parameter {fqn} is sparse; only dense parameters are supported")


def capture(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
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
    k = strategy.grad_accumulation
    leaves, batch_spec = pytree.tree_flatten(example_batch)
    tensor_leaf = [isinstance(x, torch.Tensor) for x in leaves]
    if k > 1:
        for x in leaves:
            if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % k):
                raise UnsupportedError(
                    f"grad_accumulation={k} splits every batch tensor along dim 0, but a batch leaf has "
                    f"shape {tuple(x.shape)}; use a batch whose first dimension is a multiple of {k}"
                )

    specs: list[sig.InputSpec] = []
    examples: list[torch.Tensor] = []

    def add_input(role: str, name: str, t: torch.Tensor) -> None:
        specs.append(sig.InputSpec(role, name))
        examples.append(t)

    for fqn in info.trainable:
        add_input(sig.PARAM, fqn, info.params[fqn])
    for fqn in info.frozen:
        add_input(sig.FROZEN, fqn, info.params[fqn])
    for fqn, b in info.buffers.items():
        add_input(sig.BUFFER, fqn, b)
    for fqn in info.trainable:
        p = info.params[fqn]
        for s in info.optim.groups[info.group_of[fqn]].state_names:
            add_input(sig.STATE, f"{fqn}.{s}", p)  # shape and dtype only: tracing is fake
    for g, gspec in enumerate(info.optim.groups):
        for s in gspec.scalar_names:
            dtype = torch.bool if s == "first" else torch.float64
            add_input(sig.SCALAR, f"group{g}.{s}", torch.zeros((), dtype=dtype))
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            add_input(sig.BATCH, f"batch.{i}", x)

    roles = [s.role for s in specs]
    n_train, n_frozen, n_buf = len(info.trainable), len(info.frozen), len(info.buffers)
    buffer_names = list(info.buffers)

    def step(*flat):
        flat = list(flat)
        params = flat[:n_train]
        frozen = flat[n_train : n_train + n_frozen]
        buffers = flat[n_train + n_frozen : n_train + n_frozen + n_buf]
        batch_tensors = iter([flat[i] for i, r in enumerate(roles) if r == sig.BATCH])
        batch_leaves = [next(batch_tensors) if is_t else x for x, is_t in zip(leaves, tensor_leaf)]
        batch = pytree.tree_unflatten(batch_leaves, batch_spec)
        micro_batches = [batch] if k == 1 else [
            pytree.tree_map(lambda x, i=i: x.chunk(k)[i] if isinstance(x, torch.Tensor) else x, batch) for i in range(k)
        ]

        def loss_of(train_params, bufs, mb):
            bufs = [b.clone() for b in bufs]  # the forward may update buffers in place
            tensors = dict(zip(info.trainable, train_params))
            tensors.update(zip(info.frozen, frozen))
            tensors.update(zip(buffer_names, bufs))
            for alias, canonical in info.aliases.items():
                tensors[alias] = tensors[canonical]
            with _reparametrize_module(model, tensors):
                loss = loss_fn(model, mb)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise UnsupportedError("loss_fn(model, batch) must return a scalar tensor")
            if k > 1:
                loss = loss / k
            return loss, bufs

        # torch.autograd.grad (as AOTAutograd's joint graph does), not torch.func.grad: functorch
        # decomposes some backward kernels (silu_backward) into ops that round differently.
        grads = None
        total = None
        with presenting_as_compiling(), torch.enable_grad():
            for mb in micro_batches:
                loss, buffers = loss_of(params, buffers, mb)
                try:
                    g = torch.autograd.grad(loss, params, allow_unused=True)
                except RuntimeError as e:
                    if "use_reentrant=True" in str(e):  # its backward re-runs forward under .backward() only
                        raise UnsupportedError(
                            "loss_fn uses torch.utils.checkpoint(..., use_reentrant=True) (reentrant activation "
                            "checkpointing), which only works under .backward(), not the torch.autograd.grad that "
                            "graphfuse traces; pass use_reentrant=False (for transformers models: "
                            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
                        ) from e
                    raise
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

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_examples = []
    for s, t in zip(specs, examples):
        fake = fake_mode.from_tensor(t)
        if s.role == sig.STATE:  # a fresh tensor: fakes are memoised per real tensor
            with fake_mode:
                fake = torch.empty_like(fake)
        if s.role == sig.PARAM:
            fake.requires_grad_(True)
        fake_examples.append(fake)
    t0 = time.perf_counter()
    try:
        traced = make_fx(_functionalized(step), tracing_mode="fake", _allow_non_fake_inputs=True)(*fake_examples)
    except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode) as e:
        raise UnsupportedError(
            f"the training step reads a tensor's value on the host ({e}: .item(), float(t), int(t), "
            "`if t:`, or an op whose output shape depends on values, such as nonzero); graphfuse traces "
            "with fake tensors and cannot follow that. Keep such values as tensors (torch.where instead "
            "of `if`), or guard the code with torch.compiler.is_compiling(), which is true while tracing"
        ) from e
    log.debug("traced the step in %.2fs", time.perf_counter() - t0)

    # step() returned (loss, buffers, grads); the output node holds them flattened, in order.
    graph = traced.graph
    out_node = graph.output_node()
    flat_out = [x for x in pytree.tree_leaves(out_node.args) if isinstance(x, torch.fx.Node)]
    loss_n, buf_outs, grad_outs = flat_out[0], flat_out[1 : 1 + n_buf], flat_out[1 + n_buf :]
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for node, s in zip(placeholders, specs):
        node._rename(_sanitize(f"{s.role}_{s.name}"))
        node.target = node.name
        node.meta["gf_input"] = s

    # The optimizer update is elementwise, the same ops for every parameter of a group: trace
    # it once per group and copy it per parameter, far cheaper than dispatching every op through
    # functionalization and fake tensors again. Every node it copies has the parameter's shape
    # and dtype (_trace_update checks), so each gets a fake value shaped like the parameter.
    by_name = {s.name: n for n, s in zip(placeholders, specs)}
    grad_of = dict(zip(info.trainable, grad_outs))
    templates: dict[tuple, torch.fx.Graph] = {}
    outputs: list[sig.OutputSpec] = [sig.OutputSpec(sig.LOSS, "loss")]
    out_args: list[torch.fx.Node] = [loss_n]
    new_params, new_states = [], []
    for g, gspec in enumerate(info.optim.groups):
        scalar_nodes = [by_name[f"group{g}.{s}"] for s in gspec.scalar_names]
        for fqn in gspec.params:
            p = info.params[fqn]
            key = (g, p.dtype, p.device.type)
            if key not in templates:
                templates[key] = _trace_update(gspec, p.dtype, p.device.type)
            template = templates[key]
            param_val = by_name[fqn].meta["val"]
            args = [by_name[fqn], grad_of[fqn], *(by_name[f"{fqn}.{s}"] for s in gspec.state_names), *scalar_nodes]
            val_map = dict(zip([n for n in template.nodes if n.op == "placeholder"], args))
            with graph.inserting_before(out_node):
                new = graph.graph_copy(template, val_map)
            with param_val.fake_mode:
                for t_node in template.nodes:
                    if t_node.op == "call_function":
                        val_map[t_node].meta["val"] = torch.empty_like(param_val)
            new_params.append((fqn, new[0]))
            new_states.extend((f"{fqn}.{s}", n) for s, n in zip(gspec.state_names, new[1:]))
    for fqn, n in new_params:
        outputs.append(sig.OutputSpec(sig.NEW_PARAM, fqn, fqn))
        out_args.append(n)
    for name, n in new_states:
        outputs.append(sig.OutputSpec(sig.NEW_STATE, name, name))
        out_args.append(n)
    for fqn, n, ph in zip(buffer_names, buf_outs, placeholders[n_train + n_frozen :]):
        if _unchanged(n, ph):
            continue  # the forward did not write this buffer
        outputs.append(sig.OutputSpec(sig.NEW_BUFFER, fqn, fqn))
        out_args.append(n)
    out_node.args = (tuple(out_args),)
    traced.graph.eliminate_dead_code()

    grad_names = {}
    for fqn, n in zip(info.trainable, grad_outs):
        grad_names[fqn] = n.name
    _mark_phases(traced.graph, loss_n, buf_outs, grad_outs)
    traced.recompile()

    signature = sig.Signature(
        inputs=tuple(specs),
        outputs=tuple(outputs),
        grads=grad_names,
        aliases=dict(info.aliases),
        batch_spec=pytree.treespec_dumps(batch_spec) if all(tensor_leaf) else "",
    )
    inputs_meta = {s.name: tensor_meta(t) for s, t in zip(specs, examples)}
    return Program(traced, signature, info.optim, inputs_meta, strategy=strategy, passes=("capture",))


def _trace_update(spec: gopt.GroupSpec, dtype: torch.dtype, device: str) -> torch.fx.Graph:
    """`gopt.update` of one parameter as a graph whose placeholders are (param, grad, *states,
    *scalars) and whose output is [new param, *new states]; every op in it is elementwise and
    gives a tensor of the parameter's shape and dtype, so it serves parameters of any shape."""

    def fn(p, g, *rest):
        states = dict(zip(spec.state_names, rest[: len(spec.state_names)]))
        scalars = dict(zip(spec.scalar_names, rest[len(spec.state_names) :]))
        new_p, new_states = gopt.update(spec, p, g, states, scalars)
        return [new_p, *(new_states[s] for s in spec.state_names)]

    shape = (2, 3)
    with FakeTensorMode():
        tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2 + len(spec.state_names))]
        scalars = [torch.zeros((), dtype=torch.bool if s == "first" else torch.float64) for s in spec.scalar_names]
    graph = make_fx(fn, tracing_mode="fake")(*tensors, *scalars).graph
    for n in graph.nodes:
        val = n.meta.get("val")
        if n.op == "call_function" and (tuple(val.shape) != shape or val.dtype != dtype):
            raise AssertionError(f"the {spec.kind} update is not elementwise: {n.format_node()} gives {val.shape} {val.dtype}")
    return graph


def _functionalized(fn: Callable) -> Callable:
    """`fn` under a FunctionalTensorMode, as AOTAutograd runs its joint graph: mutations become
    out-of-place ops, views stay views, and autograd (which torch.func.functionalize would
    hide from `fn`) sees its inputs' requires_grad."""

    def wrapped(*args):
        with FunctionalTensorMode():
            fargs = [FunctionalTensor.to_functional(a) for a in args]
            out = fn(*fargs)
        return pytree.tree_map_only(FunctionalTensor, FunctionalTensor.from_functional, out)

    return wrapped


def _unchanged(out: torch.fx.Node, placeholder: torch.fx.Node) -> bool:
    if out is placeholder:
        return True
    return out.op == "call_function" and out.target is torch.ops.aten.clone.default and out.args[0] is placeholder


def _ancestors(roots: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _mark_phases(graph: torch.fx.Graph, loss: torch.fx.Node, buffers: list, grads: list) -> None:
    """node.meta["phase"]: forward (what the loss and new buffers need), backward (what the
    gradients need beyond that), optimizer (the rest)."""
    forward = _ancestors([loss, *buffers])
    backward = _ancestors(list(grads)) - forward
    for n in graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        n.meta["phase"] = sig.FORWARD if n in forward else sig.BACKWARD if n in backward else sig.OPTIMIZER
