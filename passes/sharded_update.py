"""Sharded update: replace the per-parameter optimizer update with ONE fused elementwise
update per bucket shard, over flat state shards (and fp32 master shards where the strategy
asks). Each parameter's part of a shard is its `slice@<fqn>` view (see BucketLayout.slices).
Reads the `grad_shards` hand-off; hands on `param_shards` (the updated shard in the bucket's
dtype) for the all-gather."""

from __future__ import annotations

import torch

from graphfuse.capture.tracing import dtype_name, update_function
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, TensorMeta
from graphfuse.ir.state_plan import MASTER

from ._contract import expect
from .graph import (
    add_input,
    aten,
    call,
    eliminate_dead_code,
    inline,
    input_nodes,
    outputs,
    placeholders,
    remove_input,
    set_outputs,
    sync_inputs,
)

NAME = "sharded_update"
NEEDS = ("grad_shards",)
PROVIDES = ("param_shards",)


def applies(program: Program) -> bool:
    return True


def requires(program: Program) -> None:
    expect(program, NAME, not program.signature.names(sig.SHARD), "no state shard inputs yet")


def shard_dtype(program: Program, bucket) -> str:
    m = program.strategy.master_dtype
    return bucket.dtype if m is None else dtype_name(m)


def uses_master(program: Program, bucket) -> bool:
    return shard_dtype(program, bucket) != bucket.dtype


def run(program: Program) -> Program:
    graph, layout = program.graph, program.layout
    rank = program.rank
    # The traced update's outputs (per-parameter states, whole new buckets) go; once the fused update reads the gradient shards,
    # dead-code elimination removes the ops only the old outputs needed.
    new_outputs = [(s, n) for s, n in outputs(program) if s.role not in (sig.NEW_BUCKET, sig.NEW_STATE)]
    out_node = graph.output_node()
    inputs = input_nodes(program)
    param_shards = []
    for bucket, grad in zip(layout.buckets, program.handoffs.grad_shards):
        spec = program.optim.groups[bucket.group]
        dtype = shard_dtype(program, bucket)
        meta = TensorMeta((bucket.shard_size,), dtype, bucket.device)
        state_nodes = [add_input(program, sig.InputSpec(sig.SHARD, f"{bucket.name}.{s}"), meta) for s in spec.state_names]
        master = uses_master(program, bucket)
        if master:
            master_node = add_input(program, sig.InputSpec(sig.SHARD, f"{bucket.name}.{MASTER}"), meta)
        scalar_nodes = [inputs[sig.InputSpec(sig.SCALAR, f"group{bucket.group}.{s}")] for s in spec.scalar_names]
        scalar_metas = [program.inputs_meta[f"group{bucket.group}.{s}"] for s in spec.scalar_names]
        bucket_node = inputs[sig.InputSpec(sig.BUCKET, bucket.name)]
        lo, hi = bucket.shard_range(rank)
        with graph.inserting_before(out_node):
            param = master_node if master else call(graph, aten.slice.Tensor, bucket_node, 0, lo, hi, phase=sig.OPTIMIZER)
            new = inline(graph, update_function(spec), [param, grad, *state_nodes, *scalar_nodes], [meta, meta, *([meta] * len(state_nodes)), *scalar_metas], sig.OPTIMIZER)
            new_param, new_states = new[0], new[1:]
            if master:
                new_outputs.append((sig.OutputSpec(sig.NEW_SHARD, f"{bucket.name}.{MASTER}", f"{bucket.name}.{MASTER}"), new_param))
                new_param = call(graph, aten._to_copy.default, new_param, dtype=getattr(torch, bucket.dtype), phase=sig.OPTIMIZER)
        for s, n in zip(spec.state_names, new_states):
            new_outputs.append((sig.OutputSpec(sig.NEW_SHARD, f"{bucket.name}.{s}", f"{bucket.name}.{s}"), n))
        param_shards.append(new_param)
    program = set_outputs(program, new_outputs).handing_off(param_shards=tuple(param_shards))
    eliminate_dead_code(program)
    for n in [n for n in placeholders(graph) if n.meta["gf_input"].role == sig.STATE]:
        remove_input(program, n)
    return sync_inputs(program)


def ensures(program: Program) -> None:
    expect(program, NAME, not program.signature.names(sig.STATE), "no per-parameter optimizer state input left")
    expect(program, NAME, not program.signature.output_names(sig.NEW_BUCKET), "no whole-bucket output left (the all-gather makes them)")
    expected = sorted(f"{b.name}.{s}" for b in program.layout.buckets for s in program.optim.groups[b.group].state_names)
    states = sorted(n for n in program.signature.names(sig.SHARD) if not n.endswith(f".{MASTER}"))
    expect(program, NAME, states == expected, f"one state shard input per bucket and state, {expected}")
    shards = sorted(program.signature.names(sig.SHARD))
    expect(program, NAME, sorted(program.signature.output_names(sig.NEW_SHARD)) == shards, "a new-shard output for every shard input")
