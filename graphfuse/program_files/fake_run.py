"""The last check of a loaded program: graphfuse's verifier, then a run on fake tensors in
which every operator must accept its arguments and give the shape and dtype the file records."""

from __future__ import annotations

from pathlib import Path

import torch

from graphfuse.errors import GraphfuseError, ProgramFormatError
from graphfuse.ir.program import Program
from graphfuse.passes.verify import check_values, fake_values, verify

from .files import GRAPH
from .values import short


def _shapes(val):
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype)
    if isinstance(val, (list, tuple)):
        return [_shapes(v) for v in val]
    return val


def check(program: Program, path: Path) -> None:
    """Raise ProgramFormatError unless `program` verifies and runs on fake tensors as its file
    says (the verifier only checks: the nodes keep the meta the file holds)."""
    try:
        verify(program, propagate=False)
    except Exception as e:  # the verifier's own errors, or whatever a defect it did not foresee raises
        cause = str(e) if isinstance(e, GraphfuseError) else f"{type(e).__name__}: {short(e)}"
        raise ProgramFormatError(f"{path}: the graph and the program metadata disagree: {cause}") from None
    try:
        ran = fake_values(program)
        check_values(program, ran)
    except Exception as e:  # whatever an operator raises on arguments it does not accept
        raise ProgramFormatError(
            f"{path / GRAPH}: the graph does not run on fake tensors ({type(e).__name__}: {short(e)})"
        ) from None
    for node in program.graph.nodes:
        if "val" in node.meta and _shapes(ran.get(node)) != _shapes(node.meta["val"]):
            raise ProgramFormatError(
                f"{path / GRAPH}: node {node.name}: meta records {_shapes(node.meta['val'])}, its operator "
                f"gives {_shapes(ran.get(node))}"
            )
