"""Which layer of the model a program node belongs to, for the error that refuses to save it: a
user can act on "GroupNorm in layer encoder.2" where a node name alone says nothing."""

from __future__ import annotations

import torch
import torch.fx

from graphfuse.ir import signature as sig
from graphfuse.ir.layout import BucketLayout

SEARCHED = 64  # nodes looked at, nearest first: a hint, never a walk over the whole graph
NAMED = (sig.PARAM, sig.FROZEN, sig.BUFFER)


def describe(node: torch.fx.Node, layout: BucketLayout | None) -> str:
    """Where `node` comes from, as "in the forward, in layer 1 (nearest parameters it reads:
    1.scale)": its phase; its module path where the tracer recorded one (nn_module_stack), else
    the layer of the nearest parameters or buffers it reads; its source line where recorded."""
    parts = [f"in the {node.meta['phase']}"] if "phase" in node.meta else []
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, kind = list(stack.values())[-1]
        parts.append(f"in layer {path} ({getattr(kind, '__name__', kind)})")
    elif fqns := nearest_weights(node, layout):
        owners = sorted({f.rpartition(".")[0] or "(the model itself)" for f in fqns})
        parts.append(f"in layer {', '.join(owners)} (nearest parameters it reads: {', '.join(fqns)})")
    trace = node.meta.get("stack_trace")
    if isinstance(trace, str) and "File " in trace:
        parts.append("at " + trace.strip().split("File ")[-1].split("\n")[0])
    return ", ".join(parts) or "(no layer recorded)"


def nearest_weights(node: torch.fx.Node, layout: BucketLayout | None) -> list[str]:
    """The FQNs of the parameters and buffers nearest to `node` among what it reads (breadth
    first through its inputs): a parameter input, or a parameter's view into its bucket."""
    level, seen = [node], {node}
    while level and len(seen) < SEARCHED:
        found = sorted({f for n in level if (f := _weight(n, layout))})
        if found:
            return found
        level = [m for n in level for m in n.all_input_nodes if m not in seen]
        seen.update(level)
    return []


def _weight(node: torch.fx.Node, layout: BucketLayout | None) -> str | None:
    """The FQN `node` is: a parameter or buffer input, or the slice of a bucket that holds one
    parameter (how the fuse_params pass reads parameters)."""
    spec = node.meta.get("gf_input")
    if node.op == "placeholder" and spec is not None and spec.role in NAMED:
        return spec.name
    if node.target is not torch.ops.aten.slice.Tensor or layout is None or len(node.args) < 4:
        return None
    bucket, dim, start, stop = node.args[:4]
    spec = bucket.meta.get("gf_input") if isinstance(bucket, torch.fx.Node) else None
    if spec is None or spec.role != sig.BUCKET or dim != 0:
        return None
    for b in layout.buckets:
        if b.name == spec.name:
            return next((s.fqn for s in b.slots if s.data_range == (start, stop)), None)
    return None
