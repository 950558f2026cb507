"""Overlap: every collective is issued where the pass that made it put it (as early as its
input exists); this pass moves each `wait_tensor` down to just before the first op that
reads its result, so communication runs while the graph computes. With
`Strategy.max_inflight_collectives = k`, the oldest collective's wait moves up to just before
the issue of the (k+1)-th, so at most k are ever outstanding (Gloo on torch 2.13 breaks under
many, see docs/gloo-inflight.md). Without `Strategy.overlap`, waits stay right after their
collectives (no overlap)."""

from __future__ import annotations

import torch.fx

from graphfuse.errors import GraphfuseError
from graphfuse.program import Program

from ._graph import c10d, is_collective, position


def requires(program: Program) -> None:
    if program.layout is None:
        raise GraphfuseError("overlap: the program has no bucket layout; run plan_buckets first")


def bound(program: Program) -> int | None:
    """The bound on collectives in flight; "auto" unresolved (no runtime chose a backend): none."""
    k = program.strategy.max_inflight_collectives
    return k if isinstance(k, int) else None


def run(program: Program) -> Program:
    if not program.strategy.overlap:
        return program
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
        elif is_collective(node):
            while len(outstanding) >= k:
                node.prepend(outstanding.pop(0))
            outstanding.extend(u for u in node.users if u.target is c10d.wait_tensor.default)


def in_flight(graph: torch.fx.Graph) -> list[int]:
    """How many collectives are issued and not yet waited for, after each node in order."""
    count, counts = 0, []
    for node in graph.nodes:
        if node.target is c10d.wait_tensor.default:
            count -= 1
        elif is_collective(node):
            count += 1
        counts.append(count)
    return counts


def ensures(program: Program) -> None:
    order = position(program.graph)
    for n in program.graph.nodes:
        if n.target is c10d.wait_tensor.default and not all(order[u] > order[n] for u in n.users):
            raise GraphfuseError(f"overlap: {n.name} was moved after one of its users")
    k = bound(program)
    if program.strategy.overlap and k is not None and max(in_flight(program.graph), default=0) > k:
        raise GraphfuseError(f"overlap: more than max_inflight_collectives={k} collectives are in flight")
