"""All-gather parameters: ONE all_gather_into_tensor per bucket writes every rank's updated
shard back into the flat bucket that the model's parameters view."""

from __future__ import annotations

from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program

from ._contract import always, expect
from .graph import c10d, call, outputs, set_outputs

NAME = "all_gather"
NEEDS = ("param_shards",)
PROVIDES: tuple[str, ...] = ()


applies = always  # every program


def requires(program: Program) -> None:
    expect(
        program,
        NAME,
        not program.signature.output_names(sig.NEW_BUCKET),
        "no new-bucket output yet (the all-gather makes them)",
    )


def run(program: Program) -> Program:
    graph, layout, shards = program.graph, program.bucket_layout, program.handoffs.param_shards
    assert shards is not None  # NEEDS param_shards: run_pass checked that an earlier pass set them
    pairs = outputs(program)
    for bucket, shard in zip(layout.buckets, shards):
        full = shard
        if layout.world_size > 1:
            with graph.inserting_before(shard.next):
                issued = call(
                    graph,
                    c10d.all_gather_into_tensor.default,
                    shard,
                    layout.world_size,
                    program.group_name,
                    phase=sig.COMM,
                )
                full = call(graph, c10d.wait_tensor.default, issued, phase=sig.COMM)
        pairs.append((sig.OutputSpec(sig.NEW_BUCKET, bucket.name, bucket.name), full))
    return set_outputs(program, pairs)


def ensures(program: Program) -> None:
    layout = program.bucket_layout
    n = sum(1 for x in program.graph.nodes if x.target is c10d.all_gather_into_tensor.default)
    expected = len(layout.buckets) if layout.world_size > 1 else 0
    expect(
        program,
        NAME,
        n == expected,
        f"{expected} all-gathers for {len(layout.buckets)} buckets at world size {layout.world_size}, found {n}",
    )
    names = [b.name for b in layout.buckets]
    expect(
        program,
        NAME,
        program.signature.output_names(sig.NEW_BUCKET) == names,
        f"one new-bucket output per bucket, {names}",
    )
