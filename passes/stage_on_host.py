"""Stage collectives on the host: each collective reads a host copy of its input and its
result is copied back to the device before its first use. For Gloo groups over CUDA tensors
(several ranks sharing one GPU, where NCCL refuses), whose functional collectives on CUDA
tensors crashed in torch 2.11; it applies only with `Strategy.stage_collectives_on_host`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, arg_node

from ._contract import expect
from .graph import aten, c10d, call, issues_collective, position

NAME = "stage_on_host"
NEEDS: tuple[str, ...] = ()
PROVIDES: tuple[str, ...] = ()
HOST = torch.device("cpu")


def applies(program: Program) -> bool:
    return program.strategy.stage_collectives_on_host is True and program.bucket_layout.world_size > 1


def requires(program: Program) -> None:
    expect(
        program, NAME, any(issues_collective(n) for n in program.graph.nodes), "collectives to stage (world size > 1)"
    )
    for n in _collectives(program):
        expect(program, NAME, _wait_of(n) is not None, f"{n.name} waited for by exactly one wait_tensor")


def run(program: Program) -> Program:
    graph = program.graph
    device = torch.device(program.bucket_layout.buckets[0].device)
    for node in _collectives(program):
        with graph.inserting_before(node):
            host = call(graph, aten._to_copy.default, node.args[0], device=HOST, phase=sig.COMM)
        node.args = (host, *node.args[1:])
        wait = _wait_of(node)
        assert wait is not None  # requires checked that every collective has its one wait
        order = position(graph)
        first_use = min(wait.users, key=order.__getitem__)
        with graph.inserting_before(first_use):
            back = call(graph, aten._to_copy.default, wait, device=device, phase=sig.COMM)
        wait.replace_all_uses_with(back, delete_user_cb=_other_than(back))
    return program


def ensures(program: Program) -> None:
    for node in _collectives(program):
        src = arg_node(node)  # a collective's first argument is the tensor it reads
        expect(
            program,
            NAME,
            src.target is aten._to_copy.default and bool(src.kwargs.get("device") == HOST),
            f"{node.name} reads a host copy of its input",
        )
        wait = _wait_of(node)
        assert wait is not None  # requires checked one wait per collective, and run kept it
        expect(
            program,
            NAME,
            all(u.target is aten._to_copy.default for u in wait.users),
            f"the result of {node.name} is used only through a copy back to the device",
        )


def _collectives(program: Program) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if issues_collective(n)]


def _other_than(node: torch.fx.Node) -> Callable[[torch.fx.Node], bool]:
    """Whether a user is another node than `node` (which then keeps reading the value it replaces)."""
    return lambda user: user is not node


def _wait_of(node: torch.fx.Node) -> torch.fx.Node | None:
    waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
    return waits[0] if len(node.users) == 1 and len(waits) == 1 else None
