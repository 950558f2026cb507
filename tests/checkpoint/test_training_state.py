"""graphfuse.checkpoint.TrainingState declares exactly what checkpoint/ reads of the object it is handed
(read from checkpoint/'s source); checkpoint/ imports no implementation of it; save, load and
Checkpointer refuse an object that does not implement it, before any rank meets another."""

import ast

import pytest

import graphfuse as gf
from graphfuse.checkpoint import TrainingState
from tests._common import ROOT

CHECKPOINT = ROOT / "graphfuse" / "checkpoint"


def _members(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")} | set(cls.__annotations__)


def _read_of_the_owner() -> set[str]:
    """Every attribute checkpoint/ reads of a parameter annotated TrainingState (and of self.dm)."""
    read = set()
    for f in CHECKPOINT.glob("*.py"):
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            owners = {
                a.arg for a in fn.args.args if isinstance(a.annotation, ast.Name) and a.annotation.id == "TrainingState"
            }
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute):
                    v = node.value
                    if isinstance(v, ast.Name) and v.id in owners:
                        read.add(node.attr)
                    elif (
                        isinstance(v, ast.Attribute)
                        and v.attr == "dm"
                        and isinstance(v.value, ast.Name)
                        and v.value.id == "self"
                    ):
                        read.add(node.attr)
    return read


def test_the_protocol_declares_exactly_what_checkpoints_read():
    read = _read_of_the_owner()
    assert read == _members(TrainingState), (read - _members(TrainingState), _members(TrainingState) - read)


def test_checkpoint_imports_neither_the_runtime_nor_the_frontends():
    found = []
    for f in CHECKPOINT.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{f.name}: {n}" for n in names if n.startswith(("graphfuse.runtime", "graphfuse.frontends"))]
    assert not found


@pytest.mark.parametrize("call", ["save", "load", "Checkpointer"])
def test_an_object_that_is_not_training_state_is_refused_naming_the_way_out(call, tmp_path):
    not_state = {"program": None}
    with pytest.raises(
        gf.UnsupportedError,
        match=r"expected a gf.DistModel or gf.ShardedOptimizer .*got 'dict'; pass the object gf.compile",
    ):
        if call == "Checkpointer":
            gf.Checkpointer(tmp_path, not_state)
        else:
            getattr(gf, call)(not_state, tmp_path / "ckpt")
    assert not any(tmp_path.iterdir())  # refused before anything was written
