"""The op allowlist: the only call targets a program file may name. Nothing outside it is ever
looked up, and every admitted overload is functional (docs/program-format.md, "The op allowlist").

An aten operator is admitted by family: PyTorch tags it `core` (the Core ATen IR, the opset
torch's own compilers lower to) or `pointwise`, or it is the `<op>_backward` of an admitted op.
That covers the normalisations, pooling, embeddings and activations of torch.nn and their
gradients without naming each. EXPLICIT names the rest, by operator name: what the tests'
training steps contain after every pass outside those families (`tools/list_program_ops.py`
prints the ops of the tests' models), including torch.nn layers the families miss (dropout's
`bernoulli`, GPT-2's causal mask `ones` and `tril`, GLU, Hardswish, PReLU, LogSigmoid,
adaptive max pooling, the LSTM's CPU kernel), Muon's Newton-Schulz (`linalg_vector_norm`, and
`diagonal_scatter` where CUDA batches it; `baddbmm`, in programs saved before), the attention
kernels (the CUDA ones seen on an H200 with torch 2.11), MoE routing, and the collectives the
passes emit.

Whatever admits a name, an overload is refused unless its schema is functional: it mutates no
argument (which keeps out the in-place forms and every `out=` overload) and returns only
tensors. The families also leave out what reads state or memory the arguments do not give: ops
tagged random, data-dependent or in-place, uninitialised memory (`empty`, `empty_strided`) and
`as_strided`; an explicit name is one a person has checked for that.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from .values import IDENT, Malformed

EXPLICIT: dict[str, frozenset[str]] = {
    "aten": frozenset(
        """
        _grouped_mm _log_softmax_backward_data baddbmm linalg_vector_norm _native_batch_norm_legit_functional
        _prelu_kernel _safe_softmax
        _scaled_dot_product_cudnn_attention _scaled_dot_product_cudnn_attention_backward
        _scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
        _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_for_cpu
        _softmax_backward_data _unsafe_view adaptive_max_pool2d adaptive_max_pool3d bernoulli detach diagonal_scatter
        empty_like floor_divide glu hardswish histc index lift_fresh_copy log_sigmoid_forward mkldnn_rnn_layer mse_loss
        native_batch_norm_backward new_empty new_zeros nll_loss_forward
        ones ones_like pixel_shuffle pixel_unshuffle reshape split stack t transpose tril unbind
        zeros zeros_like
    """.split()
    ),
    # The collectives the passes emit: one reduce-scatter and one all-gather per bucket, the
    # clip norm's all-reduce, and the waits.
    "_c10d_functional": frozenset({"all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "wait_tensor"}),
}
# Python functions a graph may call: `x[i]` on a multi-output operator's result.
BUILTINS: dict[str, Any] = {"operator.getitem": operator.getitem}

FAMILY_TAGS = frozenset({torch.Tag.core, torch.Tag.pointwise})
# An overload with one of these tags is no family member: it draws random numbers, or has a shape
# or result that depends on tensor values. One that writes into an argument (in place, a view in
# place, out=) is kept out by its schema instead (`_by_family`), on every torch: 2.11 has no
# `inplace` tag.
OUTSIDE_FAMILIES = frozenset(
    {torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
)
# Family members kept out by name: uninitialised memory, and views at any stride and offset.
NOT_IN_FAMILIES = ("empty", "new_empty", "_empty", "as_strided")
BACKWARD = "_backward"


def allowed_names() -> list[str]:
    """The explicitly allowed operators as "<namespace>.<name>", sorted, then the Python
    functions: what docs/program-format.md lists next to the family rule."""
    return sorted(f"{ns}.{op}" for ns, ops in EXPLICIT.items() for op in ops) + list(BUILTINS)


def admitted_names() -> list[str]:
    """Every operator of this torch with at least one admitted overload, "<namespace>.<name>",
    sorted: the explicit names and the families' members."""
    names = {(s.name.partition("::")[0], s.name.partition("::")[2]) for s in torch._C._jit_get_all_schemas()}
    found = set()
    for ns, name in names:
        packet = _packet(ns, name)
        if packet is not None and any(admitted(getattr(packet, ov)) for ov in packet.overloads()):
            found.add(f"{ns}.{name}")
    return sorted(found)


def _packet(namespace: str, name: str):
    """torch.ops.<namespace>.<name> of an allowed namespace, or None."""
    if namespace not in EXPLICIT or not IDENT.match(name) or name.startswith("__"):
        return None
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _tensors_only(t) -> bool:
    """A schema type that is a tensor, an optional tensor, or a list of them."""
    if isinstance(t, torch.TensorType):
        return True
    if isinstance(t, (torch.OptionalType, torch.ListType)):
        return _tensors_only(t.getElementType())
    return False


def functional(op: torch._ops.OpOverload) -> bool:
    """The overload writes into none of its arguments (no in-place or out= form) and returns
    tensors, with at most sizes beside them (flash attention's max_q): not a number read off a
    tensor, a string or a list of Python values."""
    schema = op._schema
    if schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    types = [r.type for r in schema.returns]
    sizes = (torch.IntType, torch.SymIntType)
    return any(map(_tensors_only, types)) and all(_tensors_only(t) or isinstance(t, sizes) for t in types)


@functools.cache
def _in_family(name: str) -> bool:
    """An aten operator one of whose overloads PyTorch tags core or pointwise."""
    packet = _packet("aten", name)
    return packet is not None and any(FAMILY_TAGS & set(getattr(packet, ov).tags) for ov in packet.overloads())


def _admitted_name(namespace: str, name: str) -> bool:
    return name in EXPLICIT.get(namespace, ()) or (namespace == "aten" and _in_family(name))


def _by_family(op: torch._ops.OpOverload) -> bool:
    name = op._opname
    if op.namespace != "aten" or name.startswith(NOT_IN_FAMILIES) or OUTSIDE_FAMILIES & set(op.tags):
        return False
    if op._schema.is_mutable:  # writes into an argument, whatever tags this torch gives it
        return False
    if _in_family(name):
        return True
    base = name.removesuffix(BACKWARD)  # the gradient of an admitted op: max_pool3d_with_indices_backward
    return base != name and any(_admitted_name("aten", b) for b in (base, base + "_forward"))


@functools.cache
def admitted(op: torch._ops.OpOverload) -> bool:
    """Whether a program file may call the overload `op`."""
    if not functional(op):
        return False
    return op._opname in EXPLICIT.get(op.namespace, ()) or _by_family(op)


def target_name(target) -> str | None:
    """The qualified name a program file uses for a call target, or None if the allowlist
    does not hold it (such a program cannot be saved)."""
    if isinstance(target, torch._ops.OpOverload) and admitted(target):
        return str(target)  # "aten.add.Tensor"
    for name, fn in BUILTINS.items():
        if target is fn:
            return name
    return None


def resolve_target(name) -> Any:
    """The call target named `name`, looked up only among the allowed namespaces' registered
    operators (no import, no eval), and admitted only by the rule above."""
    if isinstance(name, str) and name in BUILTINS:
        return BUILTINS[name]
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or not all(IDENT.match(p) and not p.startswith("__") for p in parts):
        raise Malformed(
            f"unknown operator {name!r}: a program file may call only the operators of the allowlist "
            "(docs/program-format.md, graphfuse/program_files/ops.py)"
        )
    namespace, packet_name, overload = parts
    packet = _packet(namespace, packet_name)
    op = getattr(packet, overload, None) if packet is not None else None
    if not isinstance(op, torch._ops.OpOverload) or str(op) != name:
        if _admitted_name(namespace, packet_name):
            raise Malformed(
                f"unknown operator {name!r}: this torch ({torch.__version__}) has no such operator overload"
            )
        op = None
    if op is None or not admitted(op):
        raise Malformed(
            f"unknown operator {name!r}: a program file may call only the operators of the allowlist "
            "(functional overloads of the families and names in docs/program-format.md, graphfuse/program_files/ops.py)"
        )
    return op
