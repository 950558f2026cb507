"""Serializer: derive, once, how this rank's training state is saved and loaded in both
checkpoint modes (the plan types and their derivation live in graphfuse.checkpoint.plan);
graphfuse.checkpoint executes the plan and computes no offset."""

from __future__ import annotations

from graphfuse.checkpoint.plan import derive_plan, flat_boxes, plan_of
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program
from graphfuse.ir.state_plan import MASTER, Piece, StatePlan

from ._contract import always, expect

# Piece and StatePlan stay importable from here: program files of format 1 name this module.
__all__ = [
    "MASTER",
    "NAME",
    "NEEDS",
    "PROVIDES",
    "Piece",
    "StatePlan",
    "applies",
    "derive_plan",
    "ensures",
    "flat_boxes",
    "requires",
    "run",
]

NAME = "serializer"
NEEDS: tuple[str, ...] = ()
PROVIDES: tuple[str, ...] = ()


applies = always  # every program


def requires(program: Program) -> None:
    expect(program, NAME, program.layout is not None, "a bucket layout", "run plan_buckets first")
    expect(
        program,
        NAME,
        not program.signature.names(sig.STATE),
        "no per-parameter optimizer state",
        "run sharded_update first",
    )


def run(program: Program) -> Program:
    return program.with_(state_plan=plan_of(program))


def ensures(program: Program) -> None:
    plan = program.state_plan
    assert plan is not None  # run set it
    for mode in ("unbalanced", "balanced"):
        for p in plan.pieces(mode):
            expect(program, NAME, p.save or p.load, f"piece {p.key} at {p.offsets} to be saved or loaded")
            n = 1
            for d in p.sizes:
                n *= d
            expect(
                program,
                NAME,
                n == p.stop - p.start,
                f"piece {p.key} at {p.offsets}: sizes {p.sizes} holding its {p.stop - p.start} elements",
            )
    keys = [p.key for p in plan.saved("unbalanced") if p.path[0] != "model"]
    expect(program, NAME, len(keys) == len(set(keys)), "unique unbalanced checkpoint keys")
