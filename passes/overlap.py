"""Overlap: every collective is issued where the pass that made it put it (as early as its
input exists); this pass moves each `wait_tensor` down to just before the first op that
reads its result, so communication runs while the graph computes. Without
`Strategy.overlap`, waits stay right after their collectives (no overlap)."""

from __future__ import annotations

from graphfuse.program import Program

from ._graph import c10d, position


def requires(program: Program) -> None:
    assert program.layout is not None


def run(program: Program) -> Program:
    if not program.strategy.overlap:
        return program
    graph = program.graph
    waits = [n for n in graph.nodes if n.target is c10d.wait_tensor.default]
    for wait in waits:
        order = position(graph)
        first_user = min(wait.users, key=order.__getitem__)
        first_user.prepend(wait)
    return program


def ensures(program: Program) -> None:
    order = position(program.graph)
    for n in program.graph.nodes:
        if n.target is c10d.wait_tensor.default:
            assert all(order[u] > order[n] for u in n.users)
