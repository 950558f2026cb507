"""Clip gradients by their global norm, as torch.nn.utils.clip_grad_norm_ does, across shards:
each rank sums the squares of its gradient shards (padding is zero and adds nothing), ONE
all-reduce adds the ranks' sums, and every shard is scaled by min(1, max_norm / (norm + 1e-6))."""

from __future__ import annotations

import torch

from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program

from ._contract import expect
from .graph import c10d, call, outputs, set_outputs

NAME = "clip_grad_norm"
NEEDS = ("grad_shards",)
PROVIDES = ("grad_shards",)


def applies(program: Program) -> bool:
    return program.strategy.max_grad_norm is not None


def requires(program: Program) -> None:
    clipped = [n for n in program.graph.nodes if n.target is c10d.all_reduce.default]
    expect(program, NAME, not clipped, "gradients not clipped yet (the graph already holds an all-reduce)")


def run(program: Program) -> Program:
    graph, layout = program.graph, program.bucket_layout
    max_norm = program.strategy.max_grad_norm
    shards = program.handoffs.grad_shards
    assert shards is not None  # NEEDS grad_shards: run_pass checked that an earlier pass set them
    with graph.inserting_before(graph.output_node()):
        total = call(
            graph,
            torch.ops.aten.square.default,
            call(graph, torch.ops.aten._to_copy.default, shards[0], dtype=torch.float32, phase=sig.OPTIMIZER),
            phase=sig.OPTIMIZER,
        )
        total = call(graph, torch.ops.aten.sum.default, total, phase=sig.OPTIMIZER)
        for s in shards[1:]:
            sq = call(
                graph,
                torch.ops.aten.square.default,
                call(graph, torch.ops.aten._to_copy.default, s, dtype=torch.float32, phase=sig.OPTIMIZER),
                phase=sig.OPTIMIZER,
            )
            total = call(
                graph,
                torch.ops.aten.add.Tensor,
                total,
                call(graph, torch.ops.aten.sum.default, sq, phase=sig.OPTIMIZER),
                phase=sig.OPTIMIZER,
            )
        if layout.world_size > 1:
            total = call(graph, c10d.all_reduce.default, total, "sum", program.group_name, phase=sig.COMM)
            total = call(graph, c10d.wait_tensor.default, total, phase=sig.COMM)
        norm = call(graph, torch.ops.aten.sqrt.default, total, phase=sig.OPTIMIZER)
        coef = call(
            graph,
            torch.ops.aten.reciprocal.default,
            call(graph, torch.ops.aten.add.Tensor, norm, 1e-6, phase=sig.OPTIMIZER),
            phase=sig.OPTIMIZER,
        )
        coef = call(graph, torch.ops.aten.mul.Tensor, coef, max_norm, phase=sig.OPTIMIZER)
        coef = call(graph, torch.ops.aten.clamp_max.default, coef, 1.0, phase=sig.OPTIMIZER)
        scaled = tuple(call(graph, torch.ops.aten.mul.Tensor, s, coef, phase=sig.OPTIMIZER) for s in shards)
    # The norm is returned with the loss (DistModel.grad_norm): a trainer logs it without a collective of its own.
    program = set_outputs(program, outputs(program) + [(sig.OutputSpec(sig.GRAD_NORM, "grad_norm"), norm)])
    return program.handing_off(grad_shards=scaled)


def ensures(program: Program) -> None:
    n = sum(1 for x in program.graph.nodes if x.target is c10d.all_reduce.default)
    expected = 1 if program.bucket_layout.world_size > 1 else 0
    expect(
        program,
        NAME,
        n == expected,
        f"{expected} all-reduce for the global norm at world size {program.bucket_layout.world_size}, found {n}",
    )
    shards = program.handoffs.grad_shards
    assert shards is not None  # run set them
    scaled = all(s.target is torch.ops.aten.mul.Tensor for s in shards)
    expect(program, NAME, scaled, "every gradient shard handed on to be the scaled one")
    norms = program.signature.output_names(sig.GRAD_NORM)
    expect(program, NAME, norms == ["grad_norm"], f"one grad_norm output, found {norms}")
