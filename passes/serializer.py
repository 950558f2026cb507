"""Serializer: derive, once, how this rank's training state is saved and loaded in both
checkpoint modes (the plan types and their derivation live in graphfuse.checkpoint.plan);
graphfuse.checkpoint executes the plan and computes no offset."""

from __future__ import annotations

from graphfuse import signature as sig
from graphfuse.checkpoint.plan import MASTER, Piece, StatePlan, derive_plan, flat_boxes, plan_of
from graphfuse.program import Program

# Piece and StatePlan stay importable from here: program files of format 1 name this module.
__all__ = ["MASTER", "Piece", "StatePlan", "derive_plan", "ensures", "flat_boxes", "requires", "run"]


def requires(program: Program) -> None:
    assert program.layout is not None, "plan buckets first"
    assert not program.signature.names(sig.STATE), "shard the optimizer states first"


def run(program: Program) -> Program:
    return program.with_(state_plan=plan_of(program))


def ensures(program: Program) -> None:
    plan = program.state_plan
    for mode in ("unbalanced", "balanced"):
        for p in plan.pieces(mode):
            assert p.save or p.load
            n = 1
            for d in p.sizes:
                n *= d
            assert n == p.stop - p.start, (
                f"piece {p.key} at {p.offsets}: sizes {p.sizes} do not hold {p.stop - p.start} elements"
            )
    keys = [p.key for p in plan.saved("unbalanced") if p.path[0] != "model"]
    assert len(keys) == len(set(keys)), "unbalanced keys are unique"
