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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
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
    leaves, spec = pytree.tree_flatten(batch)
    key = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(tensor_meta(leaf))
        else:
            key.append(("const", repr(leaf)))
    return (str(spec), tuple(key))


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
        states = dict(zip([s.name for s in specs if s.role == sig.STATE], [flat[i] for i, r in enumerate(roles) if r == sig.STATE]))
        scalars = dict(zip([s.name for s in specs if s.role == sig.SCALAR], [flat[i] for i, r in enumerate(roles) if r == sig.SCALAR]))
        batch_tensors = iter([flat[i] for i, r in enumerate(roles) if r == sig.BATCH])
        batch_leaves = [next(batch_tensors) if is_t else x for x, is_t in zip(leaves, tensor_leaf)]
        batch = pytree.tree_unflatten(batch_leaves, batch_spec)
        micro_batches = [batch] if k == 1 else [
            pytree.tree_map(lambda x: x.chunk(k)[i] if isinstance(x, torch.Tensor) else x, batch) for i in range(k)
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

        grads = None
        total = None
        with presenting_as_compiling():
            for mb in micro_batches:
                g, (loss, buffers) = torch.func.grad_and_value(loss_of, has_aux=True)(tuple(params), buffers, mb)
                grads = list(g) if grads is None else [a + b for a, b in zip(grads, g)]
                total = loss if total is None else total + loss

        new_params, new_states = [], []
        for gi, gspec in enumerate(info.optim.groups):
            group_scalars = {s: scalars[f"group{gi}.{s}"] for s in gspec.scalar_names}
            for fqn in gspec.params:
                i = info.trainable.index(fqn)
                p, st = gopt.update(gspec, params[i], grads[i], {s: states[f"{fqn}.{s}"] for s in gspec.state_names}, group_scalars)
                new_params.append((fqn, p))
                new_states.extend((f"{fqn}.{s}", st[s]) for s in gspec.state_names)
        return total.detach(), new_params, new_states, buffers, grads

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_examples = []
    for s, t in zip(specs, examples):
        fake = fake_mode.from_tensor(t)
        if s.role == sig.STATE:  # a fresh tensor: fakes are memoised per real tensor
            with fake_mode:
                fake = torch.empty_like(fake)
        fake_examples.append(fake)
    t0 = time.perf_counter()
    traced = make_fx(
        torch.func.functionalize(step, remove="mutations"),
        tracing_mode="fake",
        _allow_non_fake_inputs=True,
    )(*fake_examples)
    log.debug("traced the step in %.2fs", time.perf_counter() - t0)

    # step() returned (loss, [(fqn, p)...], [(name, s)...], buffers, grads): after flattening, the
    # output node holds the same values in that order, with the names dropped.
    out_node = traced.graph.output_node()
    flat_out = [x for x in pytree.tree_leaves(out_node.args) if isinstance(x, torch.fx.Node)]
    n_states = sum(len(info.optim.groups[info.group_of[f]].state_names) for f in info.trainable)
    loss_n = flat_out[0]
    param_outs = flat_out[1 : 1 + n_train]
    state_outs = flat_out[1 + n_train : 1 + n_train + n_states]
    buf_outs = flat_out[1 + n_train + n_states : 1 + n_train + n_states + n_buf]
    grad_outs = flat_out[1 + n_train + n_states + n_buf :]
    param_order = [fqn for gspec in info.optim.groups for fqn in gspec.params]
    state_order = [f"{fqn}.{s}" for gspec in info.optim.groups for fqn in gspec.params for s in gspec.state_names]

    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for node, s in zip(placeholders, specs):
        node._rename(_sanitize(f"{s.role}_{s.name}"))
        node.target = node.name
        node.meta["gf_input"] = s

    outputs: list[sig.OutputSpec] = [sig.OutputSpec(sig.LOSS, "loss")]
    out_args: list[torch.fx.Node] = [loss_n]
    for fqn, n in zip(param_order, param_outs):
        outputs.append(sig.OutputSpec(sig.NEW_PARAM, fqn, fqn))
        out_args.append(n)
    for name, n in zip(state_order, state_outs):
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
