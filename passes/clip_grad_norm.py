"""Clip gradients by their global norm, as torch.nn.utils.clip_grad_norm_ does, across shards:
each rank sums the squares of its gradient shards (padding is zero and adds nothing), ONE
all-reduce adds the ranks' sums, and every shard is scaled by min(1, max_norm / (norm + 1e-6))."""

from __future__ import annotations

import torch

from graphfuse import signature as sig
from graphfuse.program import Program

from ._graph import c10d, call, mark, marked


def requires(program: Program) -> None:
    for b in program.layout.buckets:
        assert f"grad_shard:{b.name}" in program.signature.marks, "reduce-scatter gradients first"


def run(program: Program) -> Program:
    graph, layout = program.graph, program.layout
    max_norm = program.strategy.max_grad_norm
    buckets = layout.buckets
    shards = [marked(program, f"grad_shard:{b.name}") for b in buckets]
    with graph.inserting_before(graph.output_node()):
        total = call(graph, torch.ops.aten.square.default, call(graph, torch.ops.aten._to_copy.default, shards[0], dtype=torch.float32, phase=sig.OPTIMIZER), phase=sig.OPTIMIZER)
        total = call(graph, torch.ops.aten.sum.default, total, phase=sig.OPTIMIZER)
        for s in shards[1:]:
            sq = call(graph, torch.ops.aten.square.default, call(graph, torch.ops.aten._to_copy.default, s, dtype=torch.float32, phase=sig.OPTIMIZER), phase=sig.OPTIMIZER)
            total = call(graph, torch.ops.aten.add.Tensor, total, call(graph, torch.ops.aten.sum.default, sq, phase=sig.OPTIMIZER), phase=sig.OPTIMIZER)
        if layout.world_size > 1:
            total = call(graph, c10d.all_reduce.default, total, "sum", program.group_name, phase=sig.COMM)
            total = call(graph, c10d.wait_tensor.default, total, phase=sig.COMM)
        norm = call(graph, torch.ops.aten.sqrt.default, total, phase=sig.OPTIMIZER)
        coef = call(graph, torch.ops.aten.reciprocal.default, call(graph, torch.ops.aten.add.Tensor, norm, 1e-6, phase=sig.OPTIMIZER), phase=sig.OPTIMIZER)
        coef = call(graph, torch.ops.aten.mul.Tensor, coef, max_norm, phase=sig.OPTIMIZER)
        coef = call(graph, torch.ops.aten.clamp_max.default, coef, 1.0, phase=sig.OPTIMIZER)
        for b, s in zip(buckets, shards):
            scaled = call(graph, torch.ops.aten.mul.Tensor, s, coef, phase=sig.OPTIMIZER)
            program = mark(program, f"grad_shard:{b.name}", scaled)
    return program


def ensures(program: Program) -> None:
    n = sum(1 for x in program.graph.nodes if x.target is c10d.all_reduce.default)
    assert n == (1 if program.layout.world_size > 1 else 0), f"{n} all-reduces for the global norm"
