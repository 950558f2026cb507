"""Plan buckets: read each trainable parameter's shape, dtype, group and gradient order from
the captured program and attach the `BucketLayout` (graphfuse.ir.layout does the arithmetic)."""

from __future__ import annotations

from graphfuse.capture.tracing import reads_whole, whole_cost
from graphfuse.ir import signature as sig
from graphfuse.ir.blocks import aligned_blocks
from graphfuse.ir.layout import ParamInfo
from graphfuse.ir.layout import plan_buckets as plan
from graphfuse.ir.program import Program

from ._contract import always, expect
from .graph import grad_nodes, position, ready_position

NAME = "plan_buckets"
NEEDS: tuple[str, ...] = ()
PROVIDES: tuple[str, ...] = ()


applies = always  # every program


def requires(program: Program) -> None:
    expect(program, NAME, program.layout is None, "a program whose buckets are not planned yet")
    expect(
        program,
        NAME,
        bool(program.signature.names(sig.PARAM)),
        "trainable parameter inputs",
        "give the optimizer at least one parameter that requires grad",
    )
    missing = [f for f in program.signature.names(sig.PARAM) if f not in program.signature.grads]
    expect(program, NAME, not missing, f"a gradient node for every trainable parameter (none for {missing})")


def run(program: Program) -> Program:
    order = position(program.graph)
    group_of = program.optim.group_of()
    params = []
    for fqn in program.signature.names(sig.PARAM):
        m = program.inputs_meta[fqn]
        params.append(ParamInfo(fqn, m.shape, m.dtype, m.device, group_of[fqn]))
    # Backward produces the last layer's gradient first: that order fills the buckets.
    grad_pos = {}
    for fqn, node in grad_nodes(program).items():
        grad_pos[fqn] = (ready_position(order, node), order[node])
    params.sort(key=lambda p: grad_pos[p.fqn])
    # A parameter whose update reads it whole (decided from the traced update) lies in one rank's
    # shard; owners balance the update's cost.
    groups = program.optim.groups
    whole = {p.fqn: whole_cost(groups[p.group], p.shape) for p in params if reads_whole(groups[p.group])}
    s = program.strategy
    blocks = aligned_blocks(params, s.align_buckets_to_blocks)
    layout = plan(params, program.world_size, s.align_bytes, s.bucket_bytes, blocks=blocks, whole=whole)
    return program.with_(layout=layout)


def ensures(program: Program) -> None:
    fqns = program.bucket_layout.fqns
    expect(
        program,
        NAME,
        sorted(fqns) == sorted(program.signature.names(sig.PARAM)),
        "every trainable parameter in exactly one bucket",
    )
    split = [
        f
        for b in program.bucket_layout.buckets
        if reads_whole(program.optim.groups[b.group])
        for f in b.fqns
        if len([s for r in range(b.world_size) for s in b.slices(r) if s.fqn == f]) > 1
    ]
    expect(program, NAME, not split, f"every parameter updated whole inside one rank's shard ({split} cross a shard)")
