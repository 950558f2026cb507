"""Verify a program: the graph is well formed, the signature matches the placeholders and
outputs, every output fits the input it replaces, and fake propagation of the inputs'
shapes and dtypes gives every output the shape and dtype it must have. Only checks: the
program, its graph and its nodes' meta are left as they were."""

from __future__ import annotations

from typing import cast

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphfuse.errors import VerifyError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program

from .graph import placeholders


def fake_inputs(program: Program, mode: FakeTensorMode) -> list[torch.Tensor]:
    out = []
    with mode:
        for spec in program.signature.inputs:
            m = program.inputs_meta[spec.name]
            out.append(
                torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta" if m.device == "meta" else m.device)
            )
    return out


def fake_values(program: Program) -> dict[torch.fx.Node, object]:
    """Every node's value when the graph runs on fake tensors shaped like its inputs (nothing
    is written to the nodes' meta). Raises whatever an operator raises on its arguments."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    interpreter = torch.fx.Interpreter(program.graph_module, garbage_collect_values=False)
    with mode:
        interpreter.run(*fake_inputs(program, mode))
    return dict(interpreter.env)


def verify(program: Program, propagate: bool = True) -> Program:
    """Raise VerifyError on the first broken invariant; return `program` unchanged."""
    graph = program.graph
    graph.lint()
    phs = placeholders(graph)
    specs = program.signature.inputs
    if [n.meta.get("gf_input") for n in phs] != list(specs):
        raise VerifyError("the placeholders do not match the signature's inputs")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise VerifyError("two inputs share a name")
    if set(names) != set(program.inputs_meta):
        raise VerifyError(f"inputs_meta does not match the inputs: {set(names) ^ set(program.inputs_meta)}")
    outs = program.output_args()
    if len(outs) != len(program.signature.outputs):
        raise VerifyError(f"{len(outs)} outputs for {len(program.signature.outputs)} output specs")
    for spec in program.signature.outputs:
        if (spec.role in sig.RESULT_ROLES) != (spec.target is None):
            raise VerifyError(f"output {spec.name}: only the loss and the gradient norm have no target")
        if spec.target is not None and spec.target not in program.inputs_meta:
            raise VerifyError(f"output {spec.name} targets {spec.target}, which is not an input")
    node_names = {n.name for n in graph.nodes}
    for fqn, name in program.signature.grads.items():
        if program.layout is None and name not in node_names:
            raise VerifyError(f"the gradient of {fqn} names a missing node {name}")
    graph_nodes = set(graph.nodes)
    for node in program.handoffs.nodes():
        if node not in graph_nodes:
            raise VerifyError(f"a hand-off between passes names {node.name}, which is not in the graph")
    if program.layout is not None:
        roles = {s.role for s in specs}
        if sig.BUCKET in roles and sig.PARAM in roles:
            raise VerifyError("a fused program still has per-parameter inputs")
        if sig.SHARD in roles and sig.STATE in roles:
            raise VerifyError("a sharded program still has per-parameter optimizer states")
    if propagate:
        check_values(program, fake_values(program))
    return program


def check_values(program: Program, values: dict[torch.fx.Node, object]) -> None:
    """Every output's value (from `fake_values`) has the shape and dtype its target input has."""
    for spec, node in zip(program.signature.outputs, program.output_args()):
        val = cast(torch.Tensor, values[node])  # a step returns tensors (the loss, new values)
        if spec.target is None:
            if val.numel() != 1:
                raise VerifyError(f"the loss has shape {tuple(val.shape)}")
            continue
        m = program.inputs_meta[spec.target]
        if spec.role == sig.NEW_BUCKET_SHARD:  # written into this rank's range of the bucket
            bucket = next(b for b in program.bucket_layout.buckets if b.name == spec.target)
            m = m.__class__((bucket.shard_size,), m.dtype, m.device)
        if tuple(val.shape) != m.shape or str(val.dtype).removeprefix("torch.") != m.dtype:
            raise VerifyError(
                f"output {spec.name} is {tuple(val.shape)} {val.dtype}, but its target {spec.target} is "
                f"{m.shape} {m.dtype}"
            )
