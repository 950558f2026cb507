"""Overlap: every collective is issued where the pass that made it put it (as early as its
input exists); this pass moves each `wait_tensor` down to just before the first op that
reads its result, so communication runs while the graph computes. With
`Strategy.max_inflight_collectives = k`, the oldest collective's wait moves up to just before
the issue of the (k+1)-th, so at most k are ever outstanding (Gloo on torch 2.13 breaks under
many, see docs/gloo-inflight.md). It applies only with `Strategy.overlap`; otherwise waits
stay right after their collectives (no overlap)."""

from __future__ import annotations

import torch

from graphfuse.ir.program import Program

from ._contract import expect
from .graph import c10d, issues_collective, position

NAME = "overlap"
NEEDS: tuple[str, ...] = ()
PROVIDES: tuple[str, ...] = ()


def applies(program: Program) -> bool:
    return program.strategy.overlap


def requires(program: Program) -> None:
    expect(
        program,
        NAME,
        program.layout is not None,
        "a bucket layout (the collectives are placed)",
        "run the collective passes first",
    )
    _expect_waited_collectives(program)


def bound(program: Program) -> int | None:
    """The bound on collectives in flight; "auto" unresolved (no runtime chose a backend): none."""
    k = program.strategy.max_inflight_collectives
    return k if isinstance(k, int) else None


def run(program: Program) -> Program:
    graph = program.graph
    waits = [n for n in graph.nodes if n.target is c10d.wait_tensor.default]
    for wait in waits:
        order = position(graph)
        first_user = min(wait.users, key=order.__getitem__)
        first_user.prepend(wait)
    k = bound(program)
    if k is not None:
        _bound_in_flight(graph, k)
    return program


def _bound_in_flight(graph: torch.fx.Graph, k: int) -> None:
    """Walk the graph in order; before issuing a collective while k are outstanding, wait for
    the oldest there. Moving a wait up is always valid: its collective came before, and its
    users come after its old place."""
    outstanding: list[torch.fx.Node] = []  # waits of issued collectives, oldest first
    for node in list(graph.nodes):
        if node.target is c10d.wait_tensor.default:
            if node in outstanding:
                outstanding.remove(node)
        elif issues_collective(node):
            while len(outstanding) >= k:
                node.prepend(outstanding.pop(0))
            outstanding.extend(u for u in node.users if u.target is c10d.wait_tensor.default)


def in_flight(graph: torch.fx.Graph) -> list[int]:
    """How many collectives are issued and not yet waited for, after each node in order."""
    count, counts = 0, []
    for node in graph.nodes:
        if node.target is c10d.wait_tensor.default:
            count -= 1
        elif issues_collective(node):
            count += 1
        counts.append(count)
    return counts


def ensures(program: Program) -> None:
    _expect_waited_collectives(program)
    k = bound(program)
    most = max(in_flight(program.graph), default=0)
    expect(
        program,
        NAME,
        k is None or most <= k,
        f"at most max_inflight_collectives={k} collectives in flight, found {most}",
    )


def _expect_waited_collectives(program: Program) -> None:
    """Every collective's result is read only through its one wait, and that wait comes after
    the collective and before the first op that reads the waited value."""
    order = position(program.graph)
    for n in program.graph.nodes:
        if issues_collective(n):
            users = list(n.users)
            ok = len(users) == 1 and users[0].target is c10d.wait_tensor.default
            expect(
                program,
                NAME,
                ok,
                f"collective {n.name} read only through one wait_tensor, found users {[u.name for u in users]}",
            )
            wait = users[0]
            first_use = min((order[u] for u in wait.users), default=len(order))
            ok = order[n] < order[wait] < first_use
            expect(
                program,
                NAME,
                ok,
                f"the wait {wait.name} after its collective {n.name} and before the first use of its result",
            )
        elif n.target is c10d.wait_tensor.default:
            issued = n.args[0]
            ok = isinstance(issued, type(n)) and issues_collective(issued)
            expect(program, NAME, ok, f"wait {n.name} to wait on a collective, not {issued}")
