"""Overlap: every collective is issued where the pass that made it put it (as early as its
input exists); this pass moves each `wait_tensor` down to just before the first op that
reads its result, so communication runs while the graph computes. It applies only with
`Strategy.overlap`; otherwise waits stay right after their collectives (no overlap)."""

from __future__ import annotations

from graphfuse.program import Program

from ._contract import expect
from ._graph import c10d, issues_collective, position

NAME = "overlap"
NEEDS: tuple[str, ...] = ()
PROVIDES: tuple[str, ...] = ()


def applies(program: Program) -> bool:
    return program.strategy.overlap


def requires(program: Program) -> None:
    expect(program, NAME, program.layout is not None, "a bucket layout (the collectives are placed)", "run the collective passes first")
    _expect_waited_collectives(program)


def run(program: Program) -> Program:
    graph = program.graph
    waits = [n for n in graph.nodes if n.target is c10d.wait_tensor.default]
    for wait in waits:
        order = position(graph)
        first_user = min(wait.users, key=order.__getitem__)
        first_user.prepend(wait)
    return program


def ensures(program: Program) -> None:
    _expect_waited_collectives(program)


def _expect_waited_collectives(program: Program) -> None:
    """Every collective's result is read only through its one wait, and that wait comes after
    the collective and before the first op that reads the waited value."""
    order = position(program.graph)
    for n in program.graph.nodes:
        if issues_collective(n):
            users = list(n.users)
            ok = len(users) == 1 and users[0].target is c10d.wait_tensor.default
            expect(program, NAME, ok, f"collective {n.name} read only through one wait_tensor, found users {[u.name for u in users]}")
            wait = users[0]
            first_use = min((order[u] for u in wait.users), default=len(order))
            ok = order[n] < order[wait] < first_use
            expect(program, NAME, ok, f"the wait {wait.name} after its collective {n.name} and before the first use of its result")
        elif n.target is c10d.wait_tensor.default:
            issued = n.args[0]
            ok = isinstance(issued, type(n)) and issues_collective(issued)
            expect(program, NAME, ok, f"wait {n.name} to wait on a collective, not {issued}")
