"""Plan buckets: read each trainable parameter's shape, dtype, group and gradient order from
the captured program and attach the `BucketLayout` (graphfuse.ir.layout does the arithmetic)."""

from __future__ import annotations

import logging

from graphfuse.capture.tracing import reads_whole, whole_cost
from graphfuse.ir import signature as sig
from graphfuse.ir.blocks import aligned_blocks
from graphfuse.ir.layout import BucketLayout, ParamInfo, itemsize
from graphfuse.ir.layout import plan_buckets as plan
from graphfuse.ir.program import Program

from ._contract import always, expect
from .graph import grad_nodes, position, ready_position

log = logging.getLogger("graphfuse")

NAME = "plan_buckets"
# A bucket laid out whole whose padding passes both of these is reported (whole_padding_warnings).
WARN_PADDING_SHARE = 0.2  # of the bucket's elements
WARN_PADDING_BYTES = 1 << 20
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
    for message in whole_padding_warnings(layout, set(whole)) if program.rank == 0 else []:  # one layout, said once
        log.warning("graphfuse: %s", message)
    return program.with_(layout=layout)


def whole_padding_warnings(layout: BucketLayout, whole: set[str]) -> list[str]:
    """What a bucket laid out whole costs in padding, where that passes WARN_PADDING_SHARE of its
    elements and WARN_PADDING_BYTES, with the way out: every rank holds the whole parameter and
    gradient buckets, so their padding is memory the user pays for on each rank
    (docs/design.md, "The limit of equal shards")."""
    out = []
    for b in layout.buckets:
        if not b.slots or any(f not in whole for f in b.fqns):
            continue
        data = sum(s.numel for s in b.slots)
        padding = b.size - data
        if padding < WARN_PADDING_SHARE * b.size or padding * itemsize(b.dtype) < WARN_PADDING_BYTES:
            continue
        fair = -(-data // b.world_size)
        largest = max(b.slots, key=lambda s: s.numel)
        siblings = [o for o in layout.buckets if (o.group, o.dtype, o.device) == (b.group, b.dtype, b.device)]
        ways = ["train on fewer ranks"]
        if largest.numel > fair:
            cause = (
                f"{largest.fqn} ({largest.numel:,} elements) is larger than a fair share of the bucket "
                f"({fair:,}), and a rank's shard holds whole parameters"
            )
            ways.insert(
                0,
                f"put {largest.fqn} under an elementwise optimizer (AdamW, where torch's Muon documentation keeps "
                "embeddings and the output head)",
            )
        else:
            cause = (
                f"its {len(b.slots)} parameters, each whole on one rank, do not divide evenly among "
                f"{b.world_size} ranks, and every shard is as long as the longest"
            )
        if len(siblings) > 1:
            ways.append(
                f"raise Strategy.bucket_size_mb (now {layout.bucket_bytes / 2**20:g}): larger buckets share more evenly"
            )
        out.append(
            f"{b.name} (param group {b.group}, updated whole) is {b.size / data:.2f}x its parameters' elements "
            f"at {b.world_size} ranks ({padding * itemsize(b.dtype) / 2**20:,.1f} MiB of padding in the "
            f"parameter bucket and as much in the gradient bucket, on every rank): {cause}. "
            f"To lower it: {'; or '.join(ways)}"
        )
    return out


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
