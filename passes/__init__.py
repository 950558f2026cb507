"""graphfuse.passes: one rewrite per module, each `Program -> Program` with `requires` and
`ensures` checks. `PIPELINE` reads top to bottom as what happens to a captured step."""

from __future__ import annotations

import logging
from types import ModuleType

from graphfuse.program import Program

from . import all_gather, clip_grad_norm, fuse_params, overlap, plan_buckets, reduce_scatter, serializer, sharded_update
from ._graph import eliminate_dead_code
from .verify import verify

log = logging.getLogger("graphfuse")

PIPELINE: list[ModuleType] = [
    plan_buckets,  # BucketLayout from shapes, dtypes and the backward's gradient order
    fuse_params,  # per-parameter inputs -> flat bucket inputs + views
    reduce_scatter,  # pack gradients, one reduce-scatter per bucket
    clip_grad_norm,  # (if max_grad_norm) global norm over shards, one all-reduce
    sharded_update,  # one fused optimizer update per bucket shard
    all_gather,  # one all-gather per bucket back into the bucket
    overlap,  # wait for each collective only where its result is first used
    serializer,  # the save and load plan of both checkpoint modes
]


def pass_name(p: ModuleType) -> str:
    return p.__name__.rsplit(".", 1)[-1]


def run_pipeline(program: Program, check: bool = False) -> Program:
    """Run every pass in PIPELINE; with `check`, verify the program after each one."""
    for p in PIPELINE:
        if p is clip_grad_norm and program.strategy.max_grad_norm is None:
            continue
        p.requires(program)
        program = p.run(program)
        p.ensures(program)
        program.graph_module.recompile()
        program = program.with_(passes=program.passes + (pass_name(p),))
        if check:
            verify(program, propagate=True)
    eliminate_dead_code(program)
    program.graph_module.recompile()
    return program
