"""All-gather parameters: ONE all_gather_into_tensor per bucket writes every rank's updated
shard back into the flat bucket that the model's parameters view."""

from __future__ import annotations

from graphfuse import signature as sig
from graphfuse.program import Program

from ._graph import c10d, call, marked, outputs, set_outputs


def requires(program: Program) -> None:
    for b in program.layout.buckets:
        assert f"param_shard:{b.name}" in program.signature.marks, "run the sharded update first"


def run(program: Program) -> Program:
    graph, layout = program.graph, program.layout
    pairs = outputs(program)
    for bucket in layout.buckets:
        shard = marked(program, f"param_shard:{bucket.name}")
        full = shard
        if layout.world_size > 1:
            with graph.inserting_before(shard.next):
                issued = call(graph, c10d.all_gather_into_tensor.default, shard, layout.world_size, program.group_name, phase=sig.COMM)
                full = call(graph, c10d.wait_tensor.default, issued, phase=sig.COMM)
        pairs.append((sig.OutputSpec(sig.NEW_BUCKET, bucket.name, bucket.name), full))
    return set_outputs(program, pairs)


def ensures(program: Program) -> None:
    n = sum(1 for x in program.graph.nodes if x.target is c10d.all_gather_into_tensor.default)
    expected = len(program.layout.buckets) if program.layout.world_size > 1 else 0
    assert n == expected, f"{n} all-gathers for {len(program.layout.buckets)} buckets"
    assert len(program.signature.output_names(sig.NEW_BUCKET)) == len(program.layout.buckets)
