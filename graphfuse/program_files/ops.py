"""The op allowlist: the only call targets a program file may name, by namespace and operator
name (any overload of a listed operator). Nothing outside the list is ever looked up.

The list is what the tests' training steps contain after every pass (MLP, GPT, conv +
BatchNorm, transformers Llama and BERT, the zoo's T5, GRU and Mixtral; AdamW, Adam with amsgrad, SGD with nesterov and
dampening, the other optimizers of tests/test_optimizers.py; gradient clipping, accumulation,
fp32 masters, 2 ranks), as
`tools/list_program_ops.py` prints it, plus what the GPT and Llama steps add on CUDA (seen
on an H200 with torch 2.11: the efficient and cuDNN attention kernels, `le`, `scalar_tensor`,
`squeeze`) and the flash attention kernel of the same operator.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .values import IDENT, Malformed

ALLOWED: dict[str, frozenset[str]] = {
    "aten": frozenset("""
        _log_softmax _log_softmax_backward_data _native_batch_norm_legit_functional
        _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward
        _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward
        _scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
        _scaled_dot_product_cudnn_attention _scaled_dot_product_cudnn_attention_backward
        _softmax _softmax_backward_data _to_copy _unsafe_view abs add addcdiv addcmul addmm alias arange bmm cat
        clamp clamp_max clone constant_pad_nd convolution convolution_backward cos detach div embedding
        embedding_dense_backward eq expand full_like gather gelu gelu_backward gt le lerp lift_fresh_copy lt
        max_pool2d_with_indices max_pool2d_with_indices_backward maximum mean mm mse_loss mse_loss_backward mul
        native_batch_norm_backward native_layer_norm native_layer_norm_backward neg new_zeros
        nll_loss_backward nll_loss_forward ones_like pow reciprocal relu reshape rsqrt scalar_tensor sign silu silu_backward sin zeros_like
        slice slice_backward split sqrt square squeeze sub sum t tanh tanh_backward threshold_backward transpose
        unsqueeze view where
        _grouped_mm _safe_softmax bernoulli copy cumsum empty_like fill floor_divide ge histc index index_put log
        masked_fill minimum permute scatter select select_scatter sigmoid sigmoid_backward slice_scatter sort stack
        topk unbind zeros
    """.split()),
    # The collectives the passes emit: one reduce-scatter and one all-gather per bucket, the
    # clip norm's all-reduce, and the waits.
    "_c10d_functional": frozenset({"all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "wait_tensor"}),
}
# Python functions a graph may call: `x[i]` on a multi-output operator's result.
BUILTINS: dict[str, Any] = {"operator.getitem": operator.getitem}


def allowed_names() -> list[str]:
    """Every allowed operator as "<namespace>.<name>", sorted, then the Python functions."""
    return sorted(f"{ns}.{op}" for ns, ops in ALLOWED.items() for op in ops) + list(BUILTINS)


def _is_allowed(namespace: str, name: str) -> bool:
    return name in ALLOWED.get(namespace, ())


def target_name(target) -> str | None:
    """The qualified name a program file uses for a call target, or None if the allowlist
    does not hold it (such a program cannot be saved)."""
    if isinstance(target, torch._ops.OpOverload) and _is_allowed(target.namespace, target._opname):
        return str(target)  # "aten.add.Tensor"
    for name, fn in BUILTINS.items():
        if target is fn:
            return name
    return None


def resolve_target(name) -> Any:
    """The call target named `name`, looked up only in the allowlist (no import, no eval)."""
    if isinstance(name, str) and name in BUILTINS:
        return BUILTINS[name]
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or not all(IDENT.match(p) for p in parts) or not _is_allowed(parts[0], parts[1]):
        raise Malformed(
            f"unknown operator {name!r}: a program file may call only the operators of the allowlist "
            f"(docs/program-format.md, graphfuse/program_files/ops.py)"
        )
    namespace, packet, overload = parts
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        op = None
    if not isinstance(op, torch._ops.OpOverload) or str(op) != name:
        raise Malformed(f"unknown operator {name!r}: this torch ({torch.__version__}) has no such operator overload")
    return op
