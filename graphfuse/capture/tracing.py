"""What both captures share (the whole step in graphfuse.capture.step, the update alone in
graphfuse.frontends.torch_compile): example inputs, fake tensors, placeholder names, the update function."""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from collections.abc import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary

from graphfuse import optim as gopt
from graphfuse.ir import signature as sig
from graphfuse.ir.program import TensorMeta

log = logging.getLogger("graphfuse")


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
    fakes: list[torch.Tensor] = []
    for spec, t in zip(specs, examples, strict=True):
        fake: torch.Tensor = mode.from_tensor(t)
        if spec.role in (sig.STATE, sig.GRAD):
            with mode:
                fake = torch.empty_like(fake)
        fakes.append(fake)
    return fakes


def update_function(spec: gopt.GroupSpec, states: tuple[str, ...] | None = None) -> Callable:
    """`gopt.update` of one group as `fn(param, grad, *states, *scalars) -> [new param, *new
    states]`, in the order of `states` (by default spec.state_names; a parameter whose states
    are not all of the group's names, as an Adafactor vector's, passes its own) and of
    spec.scalar_names."""
    names = spec.state_names if states is None else states

    def fn(p, g, *rest):
        states = dict(zip(names, rest[: len(names)]))
        scalars = dict(zip(spec.scalar_names, rest[len(names) :]))
        new_p, new_states = gopt.update(spec, p, g, states, scalars)
        return [new_p, *(new_states[s] for s in names)]

    return fn


# Ops that act per element beside the pointwise ones: a copy, a cast, a filled tensor like another.
_PER_ELEMENT = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.full_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.empty_like.default,
}


@functools.cache
def reads_whole(spec: gopt.GroupSpec) -> bool:
    """Whether the group's update reads each parameter whole, decided from its trace on a 2x3
    parameter: an op that is not per element (not tagged pointwise, nor a copy or a fill) or
    whose result is not shaped like the parameter (a norm, a transpose, a matrix product, a
    softmax over a row) reads other elements than its own. Such an update runs per whole
    parameter, on the rank that owns it (graphfuse.ir.ownership), never on a flat shard."""
    shape = (2, 3)
    states = spec.state_shapes(shape)  # each state in its own shape (Adafactor's row and column factors)
    with FakeTensorMode():
        tensors = [torch.empty(shape), torch.empty(shape), *(torch.empty(s) for s in states.values())]
        scalars = [scalar_example(s) for s in spec.scalar_names]
    graph = make_fx_exact(update_function(spec, tuple(states)), tracing_mode="fake")(*tensors, *scalars).graph
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        per_element = torch.Tag.pointwise in getattr(n.target, "tags", ()) or n.target in _PER_ELEMENT
        if not per_element or tuple(n.meta["val"].shape) != shape:
            return True
    return False


@functools.cache
def whole_cost(spec: gopt.GroupSpec, shape: tuple[int, ...]) -> int:
    """What the owners of parameters updated whole balance (graphfuse.ir.ownership.assign),
    decided from the group's update run on fake tensors of `shape`, not from its kind: the
    floating-point operations of its matrix products as torch.utils.flop_counter counts them
    (Muon's Newton-Schulz iterations, Adafactor's outer product of its factors) plus one per
    element (the per-element work every update does)."""
    states = spec.state_shapes(shape)
    with FakeTensorMode():
        tensors = [torch.empty(shape), torch.empty(shape), *(torch.empty(s) for s in states.values())]
        scalars = [scalar_example(s) for s in spec.scalar_names]
        with FlopCounterMode(display=False) as counter:
            update_function(spec, tuple(states))(*tensors, *scalars)
    return counter.get_total_flops() + math.prod(shape)


def module_of_error(error: BaseException, model: torch.nn.Module) -> str:
    """` in module FQN (file:line)`: the innermost frame of the error's traceback that runs a
    method of one of the model's modules, so a refusal names the model's code, not only the op."""
    fqn_of = {id(m): fqn or "(the model)" for fqn, m in model.named_modules(remove_duplicate=False)}
    found = ""
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in fqn_of:
            code = tb.tb_frame.f_code
            where = f"{code.co_filename}:{tb.tb_lineno}"
            found = f" in module {fqn_of[id(owner)]} ({type(owner).__name__}.{code.co_name}, {where})"
        tb = tb.tb_next
    return found


def make_fx_exact(fn: Callable, **kwargs) -> Callable:
    """`make_fx(fn, ...)` recording every op as it was dispatched. Given no decomposition table,
    make_fx of torch 2.14 decomposes `aten.detach` into `aten.alias` (2.13 and earlier keep
    it); an explicit empty table is the documented way to keep it, so a step traces to the same
    graph on every torch the project supports, without a version test."""
    return make_fx(fn, decomposition_table={}, **kwargs)


def trace(step: Callable, specs: list[sig.InputSpec], examples: list[torch.Tensor]) -> torch.fx.GraphModule:
    """make_fx of the functionalized step on fake tensors, placeholders named after `specs`."""
    fakes = fake_examples(FakeTensorMode(allow_non_fake_inputs=True), specs, examples)
    for spec, fake in zip(specs, fakes):
        if spec.role == sig.PARAM:
            fake.requires_grad_(True)
    t0 = time.perf_counter()
    install_cpu_float_grouped_mm()
    traced = make_fx_exact(functionalized(step), tracing_mode="fake", _allow_non_fake_inputs=True)(*fakes)
    log.debug("traced the step in %.2fs", time.perf_counter() - t0)
    name_placeholders(traced.graph, specs)
    return traced


def functionalized(fn: Callable) -> Callable:
    """`fn` under a FunctionalTensorMode, as AOTAutograd runs its joint graph: mutations become
    out-of-place ops, views stay views (`unsafe_split`'s too, see UnsafeSplitsAsViews), and
    autograd (which torch.func.functionalize would hide from `fn`) sees its inputs' requires_grad."""

    def wrapped(*args):
        with ConstantValues(), FunctionalTensorMode(), UnsafeSplitsAsViews():
            fargs = [FunctionalTensor.to_functional(a) for a in args]
            out = fn(*fargs)
        return pytree.tree_map_only(FunctionalTensor, FunctionalTensor.from_functional, out)

    return wrapped


class UnsafeSplitsAsViews(TorchDispatchMode):
    """Hands functionalization `split` where the step calls `unsafe_split` (`unsafe_chunk`), so
    that it tracks the pieces as views of their input, as they are in eager memory. Otherwise
    an in-place op on a piece (ATen's GRU cell: `add_`, `sigmoid_` on chunks of the gate matrix)
    becomes an out-of-place op on a contiguous copy, and the next op reads another layout than
    eager's; CPU kernels may round by layout (`sigmoid` of a (2, 24) view with row stride 72
    differs from that of its contiguous copy). Autograd, above this mode, still sees `unsafe_split`."""

    SAFE = {
        torch.ops.aten.unsafe_split.Tensor: torch.ops.aten.split.Tensor,
        torch.ops.aten.unsafe_split_with_sizes.default: torch.ops.aten.split_with_sizes.default,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.SAFE.get(func, func)(*args, **(kwargs or {}))


class ConstantValues(TorchDispatchMode):
    """Real values, on the CPU, of the tensors the step computes from constants alone (factory
    ops such as `arange`, and ops on such tensors), so that a read on the host of one of them
    (`.item()`, `bool(t)`) returns what eager PyTorch reads instead of failing on a fake tensor.
    The read becomes a constant of the traced program, which is exact: the value depends on no
    input. Seeded random ops and tensors above MAX_NUMEL elements are not tracked."""

    MAX_NUMEL = 1 << 22

    def __init__(self) -> None:
        super().__init__()
        self.real = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = pytree.arg_tree_leaves(*args, **kwargs)
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        known = all(t in self.real for t in tensors)
        if func in _READS and known:
            with _disable_current_modes():
                return func(*pytree.tree_map_only(torch.Tensor, self.real.get, args), **kwargs)
        out = func(*args, **kwargs)
        outs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        if (
            known
            and torch.Tag.nondeterministic_seeded not in func.tags
            and all(o.numel() <= self.MAX_NUMEL for o in outs)
        ):
            real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, self.real.get, (args, kwargs))
            if isinstance(real_kwargs.get("device"), torch.device | str):
                real_kwargs["device"] = torch.device("cpu")
            with _disable_current_modes():
                real_out = func(*real_args, **real_kwargs)
            for o, r in zip(
                outs, [x for x in pytree.tree_leaves(real_out) if isinstance(x, torch.Tensor)], strict=True
            ):
                self.real[o] = r
        elif func._schema.is_mutable:
            self._forget_written(func, args, kwargs)
        return out

    def _forget_written(self, func, args, kwargs) -> None:
        """An op wrote into a tracked tensor from untracked inputs: that tensor, and every
        tracked view of its storage, no longer has a known value."""
        written = []
        for i, a in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if (
                a.alias_info is not None
                and a.alias_info.is_write
                and isinstance(value, torch.Tensor)
                and value in self.real
            ):
                written.append(self.real[value].untyped_storage().data_ptr())
        if written:
            for t in [t for t, r in self.real.items() if r.untyped_storage().data_ptr() in written]:
                del self.real[t]


_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default)


def install_cpu_float_grouped_mm() -> None:
    """Give fake tensors a rule for `aten._grouped_mm` on CPU tensors of float dtypes other than
    bfloat16: torch's meta function accepts only bfloat16 (a CUDA kernel's limit), while the CPU
    kernel also runs float32, as eager transformers MoE experts (grouped_mm) call it. Installed
    once per process, as torch keeps these rules in a global list that every fake propagation
    reads (capture, verify, program loading); it answers only calls torch's meta refuses, with
    the meta function's output shape, contiguous as the CPU kernel returns it."""
    global _GROUPED_MM_INSTALLED
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if _GROUPED_MM_INSTALLED or op is None:
        return

    def rule(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.device.type != "cpu" or mat_a.dtype == torch.bfloat16 or bias is not None:
            return NotImplemented  # torch's own meta function decides
        if mat_a.dim() == 2:
            size = [offs.size(0), mat_a.size(0), mat_b.size(1)] if mat_b.dim() == 2 else [mat_a.size(0), mat_b.size(-1)]
        else:
            size = (
                [mat_a.size(1), mat_b.size(1)] if mat_b.dim() == 2 else [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
            )
        return FakeTensor(fake_mode, torch.empty(size, dtype=out_dtype or mat_a.dtype, device="meta"), mat_a.device)

    fake_impls.op_implementations_checks.insert(0, (lambda func: func is op.default, rule))
    _GROUPED_MM_INSTALLED = True


_GROUPED_MM_INSTALLED = False
