"""Sharded update: replace the per-parameter optimizer update with ONE fused elementwise
update per bucket shard, over flat state shards (and fp32 master shards where the strategy
asks). Each parameter's part of a shard is its `slice@<fqn>` view (see BucketLayout.slices).
Marks `param_shard:<bucket>` (the updated shard in the bucket's dtype) for the all-gather."""

from __future__ import annotations

import torch

from graphfuse import optim as gopt
from graphfuse import signature as sig
from graphfuse.capture import dtype_name
from graphfuse.program import Program, TensorMeta

from ._graph import (
    add_input,
    aten,
    call,
    eliminate_dead_code,
    inline,
    mark,
    marked,
    outputs,
    placeholders,
    remove_input,
    set_outputs,
    sync_inputs,
)

MASTER = "master"


def requires(program: Program) -> None:
    for b in program.layout.buckets:
        assert f"grad_shard:{b.name}" in program.signature.marks, "reduce-scatter gradients first"


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
    for bucket in layout.buckets:
        spec = program.optim.groups[bucket.group]
        dtype = shard_dtype(program, bucket)
        meta = TensorMeta((bucket.shard_size,), dtype, bucket.device)
        state_nodes = [add_input(program, sig.InputSpec(sig.SHARD, f"{bucket.name}.{s}"), meta) for s in spec.state_names]
        master = uses_master(program, bucket)
        if master:
            master_node = add_input(program, sig.InputSpec(sig.SHARD, f"{bucket.name}.{MASTER}"), meta)
        scalar_nodes = [
            next(n for n in placeholders(graph) if n.meta["gf_input"] == sig.InputSpec(sig.SCALAR, f"group{bucket.group}.{s}"))
            for s in spec.scalar_names
        ]
        scalar_metas = [program.inputs_meta[f"group{bucket.group}.{s}"] for s in spec.scalar_names]
        grad = marked(program, f"grad_shard:{bucket.name}")
        bucket_node = next(n for n in placeholders(graph) if n.meta["gf_input"] == sig.InputSpec(sig.BUCKET, bucket.name))
        lo, hi = bucket.shard_range(rank)
        with graph.inserting_before(out_node):
            param = master_node if master else call(graph, aten.slice.Tensor, bucket_node, 0, lo, hi, phase=sig.OPTIMIZER)
            names = spec.scalar_names

            def fused(p, g, *rest, spec=spec, names=names):
                states = dict(zip(spec.state_names, rest[: len(spec.state_names)]))
                scalars = dict(zip(names, rest[len(spec.state_names) :]))
                new_p, new_states = gopt.update(spec, p, g, states, scalars)
                return [new_p, *(new_states[s] for s in spec.state_names)]

            new = inline(graph, fused, [param, grad, *state_nodes, *scalar_nodes], [meta, meta, *([meta] * len(state_nodes)), *scalar_metas], sig.OPTIMIZER)
            new_param, new_states = new[0], new[1:]
            if master:
                new_outputs.append((sig.OutputSpec(sig.NEW_SHARD, f"{bucket.name}.{MASTER}", f"{bucket.name}.{MASTER}"), new_param))
                new_param = call(graph, aten._to_copy.default, new_param, dtype=getattr(torch, bucket.dtype), phase=sig.OPTIMIZER)
        for s, n in zip(spec.state_names, new_states):
            new_outputs.append((sig.OutputSpec(sig.NEW_SHARD, f"{bucket.name}.{s}", f"{bucket.name}.{s}"), n))
        program = mark(program, f"param_shard:{bucket.name}", new_param)
    program = set_outputs(program, new_outputs)
    eliminate_dead_code(program)
    for n in [n for n in placeholders(graph) if n.meta["gf_input"].role == sig.STATE]:
        remove_input(program, n)
    return sync_inputs(program)


def ensures(program: Program) -> None:
    assert not program.signature.names(sig.STATE), "no per-parameter state remains"
    for b in program.layout.buckets:
        assert f"param_shard:{b.name}" in program.signature.marks
