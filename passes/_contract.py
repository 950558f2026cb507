"""Pass contracts: what a pass requires of the program it is given and ensures of the one it
makes, raised as `PassContractError` naming the pass and the passes that ran before it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from types import ModuleType

from graphfuse.errors import PassContractError
from graphfuse.ir.program import Handoffs, Program

HANDOFFS = tuple(f.name for f in fields(Handoffs))


def expect(program: Program, pass_name: str, ok: bool, condition: str, way_out: str = "") -> None:
    """Raise PassContractError unless `ok`; `condition` says what must hold, in words."""
    if ok:
        return
    before = ", ".join(program.pass_names) or "none"
    hint = f"; {way_out}" if way_out else ""
    raise PassContractError(f"pass {pass_name}: expected {condition} (passes run before it: {before}){hint}")


def expect_handoffs(program: Program, pass_name: str, names: Sequence[str], what: str) -> None:
    """Every hand-off in `names` holds one node of the graph per bucket."""
    buckets = len(program.layout.buckets) if program.layout is not None else 0
    graph_nodes = set(program.graph.nodes)
    for name in names:
        nodes = getattr(program.handoffs, name)
        ok = nodes is not None and len(nodes) == buckets and all(n in graph_nodes for n in nodes)
        expect(program, pass_name, ok, f"the hand-off {name}: one node of the graph per bucket, {what}")


def check_pipeline(pipeline: Sequence[ModuleType]) -> None:
    """Before anything runs: every hand-off a pass NEEDS is one an earlier pass PROVIDES, and
    every pass has the contract functions."""
    provided: set[str] = set()
    for i, p in enumerate(pipeline):
        for attr in ("NAME", "NEEDS", "PROVIDES", "applies", "requires", "run", "ensures"):
            if not hasattr(p, attr):
                raise PassContractError(f"pass module {p.__name__} (pipeline position {i}) has no {attr}")
        unknown = set(p.NEEDS) | set(p.PROVIDES)
        if not unknown <= set(HANDOFFS):
            raise PassContractError(f"pass {p.NAME}: unknown hand-offs {sorted(unknown - set(HANDOFFS))}; known: {HANDOFFS}")
        missing = set(p.NEEDS) - provided
        if missing:
            before = ", ".join(q.NAME for q in pipeline[:i]) or "none"
            raise PassContractError(
                f"pass {p.NAME} needs the hand-offs {sorted(missing)}, which no pass before it provides "
                f"(passes before it: {before}); put the pass that provides them earlier"
            )
        provided |= set(p.PROVIDES)
