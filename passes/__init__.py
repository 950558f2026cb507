"""graphfuse.passes: one rewrite per module, each a `Pass` (`Program -> Program` with `applies`,
`requires`, `ensures` and the hand-offs it NEEDS and PROVIDES). `PIPELINE` reads top to bottom as what
happens to a captured step; `run_pipeline` runs it, checks every contract and records statistics."""

from __future__ import annotations

import logging
import time

from graphfuse.errors import GraphfuseError
from graphfuse.ir.program import Handoffs, PassRun, Program

from . import (
    all_gather,
    clip_grad_norm,
    defer_gather,
    fuse_loss,
    fuse_params,
    overlap,
    plan_buckets,
    reduce_scatter,
    serializer,
    sharded_update,
    stage_on_host,
)
from ._contract import Pass, check_pipeline, expect_handoffs
from .graph import PASS_META, count_targets, eliminate_dead_code, is_collective, issues_collective
from .verify import VerifyError, verify

# What modules outside graphfuse.passes may use (also the graph-editing helpers in
# graphfuse.passes.graph, public and documented there); _contract is private.
__all__ = [
    "PIPELINE",
    "Pass",
    "VerifyError",
    "count_targets",
    "is_collective",
    "issues_collective",
    "pass_name",
    "run_pass",
    "run_pipeline",
    "verify",
]

log = logging.getLogger("graphfuse.passes")

PIPELINE: list[Pass] = [
    fuse_loss,  # (if fuse_loss) output projection + cross-entropy chunked over tokens
    plan_buckets,  # BucketLayout from shapes, dtypes and the backward's gradient order
    fuse_params,  # per-parameter inputs -> flat bucket inputs + views
    reduce_scatter,  # pack gradients, one reduce-scatter per bucket
    clip_grad_norm,  # (if max_grad_norm) global norm over shards, one all-reduce
    sharded_update,  # one fused optimizer update per bucket shard
    all_gather,  # one all-gather per bucket back into the bucket
    defer_gather,  # (if overlap_param_gather) the all-gathers move to the head of the next step
    stage_on_host,  # (if stage_collectives_on_host) collectives read and write host copies
    overlap,  # (if overlap) wait for each collective only where its result is first used
    serializer,  # the save and load plan of both checkpoint modes
]


def pass_name(p: Pass) -> str:
    return p.NAME


def _collectives(program: Program) -> int:
    return sum(1 for n in program.graph.nodes if issues_collective(n))


def run_pass(program: Program, p: Pass, check: bool = False, recompile: bool = True) -> Program:
    """Run pass `p` if it applies: its contracts before and after, its statistics recorded in
    `Program.passes` and logged at DEBUG; with `check`, `verify` the result. Without
    `recompile`, the graph module's code is stale until the caller recompiles it (the passes
    and `verify` read the graph, never the code)."""
    if not p.applies(program):
        log.debug("%s: does not apply", p.NAME)
        return program
    expect_handoffs(program, p.NAME, p.NEEDS, "which an earlier pass provides")
    p.requires(program)
    before, collectives, t0 = set(program.graph.nodes), _collectives(program), time.perf_counter()
    try:
        out = p.run(program)
    except GraphfuseError:
        raise
    except Exception as e:  # a bug: say where it happened, as torch.fx's PassManager does
        e.add_note(f"in graphfuse pass {p.NAME}, after: {', '.join(program.pass_names) or 'none'}")
        raise
    expect_handoffs(out, p.NAME, p.PROVIDES, "which this pass provides")
    p.ensures(out)
    after = set(out.graph.nodes)
    for n in after - before:  # provenance, as torch.fx's GraphTransformObserver records it
        n.meta[PASS_META] = p.NAME
    run = PassRun(
        p.NAME, len(after - before), len(before - after), _collectives(out) - collectives, time.perf_counter() - t0
    )
    log.debug(
        "%s: +%d -%d nodes, +%d collectives, %.3fs",
        run.name,
        run.nodes_added,
        run.nodes_removed,
        run.collectives_added,
        run.seconds,
    )
    if recompile or log.isEnabledFor(logging.DEBUG - 1):
        out.graph_module.recompile()  # code generation: about a third of the pipeline's time
    if log.isEnabledFor(logging.DEBUG - 1):
        log.log(logging.DEBUG - 1, "graph after %s:\n%s", run.name, out.graph_module.code)
    out = out.with_(passes=out.passes + (run,))
    if check:
        verify(out, propagate=True)
    return out


def run_pipeline(program: Program, check: bool = False, pipeline: list[Pass] | None = None) -> Program:
    """Run every pass of `pipeline` (default PIPELINE) that applies; with `check`, verify the
    program after each one. The hand-offs between passes are dropped at the end."""
    pipeline = PIPELINE if pipeline is None else pipeline
    check_pipeline(pipeline)
    for p in pipeline:
        program = run_pass(program, p, check, recompile=False)
    program = program.with_(handoffs=Handoffs())
    eliminate_dead_code(program)
    program.graph_module.recompile()
    return program
