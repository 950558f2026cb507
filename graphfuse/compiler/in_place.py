"""The step made to write in place: a `copy_` of every output into the input it replaces,
appended to the program's graph (the only place that adds this epilogue), and its compilation."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from graphfuse.compiler.inductor import compile_graph
from graphfuse.compiler.workers import Workers, compile_pieces
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, output_nodes


def in_place_graph(program: Program) -> torch.fx.GraphModule:
    """The program's graph with a `copy_` of every output into the input it replaces appended,
    returning only the outputs that replace nothing (the loss)."""
    graph = copy.deepcopy(program.graph)
    # A traced graph names its tracer class, a loaded one none; AOTAutograd's cache key hashes
    # the module's attributes, so without this a restart missed the entry a fresh start saved.
    graph._tracer_cls = None
    gm = torch.fx.GraphModule(program.graph_module, graph)
    graph = gm.graph
    inputs = {s.name: n for s, n in zip(program.signature.inputs, (n for n in graph.nodes if n.op == "placeholder"))}
    out = graph.output_node()
    results = output_nodes(graph)
    with graph.inserting_before(out):
        for spec, node in zip(program.signature.outputs, results):
            if spec.target is None:  # returned, not written into an input
                continue
            if spec.role == sig.NEW_BUCKET_SHARD:
                bucket = next(b for b in program.bucket_layout.buckets if b.name == spec.target)
                into = graph.call_function(
                    torch.ops.aten.slice.Tensor, (inputs[spec.target], 0, *bucket.shard_range(program.rank))
                )
                graph.call_function(torch.ops.aten.copy_.default, (into, node))
            else:
                graph.call_function(torch.ops.aten.copy_.default, (inputs[spec.target], node))
    out.args = (tuple(r for s, r in zip(program.signature.outputs, results) if s.target is None),)
    gm.recompile()
    return gm


def compile_in_place(program: Program, example_inputs: list[torch.Tensor], workers: Workers | None = None) -> Callable:
    """Compile the program with inductor after appending `copy_` of every output into the input
    it replaces (in_place_graph), so inductor writes new buckets and shards straight into their
    storage (one read and one write per element) instead of returning new tensors the runtime
    must copy. With `workers` (Strategy.compile_workers), the step is cut into one piece per
    process, this one and the workers, compiled at once (graphfuse/compiler/workers.py)."""
    gm = in_place_graph(program)
    if workers is not None:
        return compile_pieces(program, gm, example_inputs, workers)
    return InPlaceStep(compile_graph(gm, example_inputs))


class InPlaceStep:
    """A compiled step that writes new buckets and shards into its inputs and returns the rest."""

    writes_in_place = True  # the executor reads it: no copy back into the inputs

    def __init__(self, compiled: Callable) -> None:
        self.compiled = compiled

    def __call__(self, *args: torch.Tensor) -> Any:
        return self.compiled(*args)
