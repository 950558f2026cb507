"""Program's typed accessors (issue 29, change 10): `bucket_layout` before and after the passes,
and `output_nodes`, the values a step's graph returns."""

from __future__ import annotations

import pytest
import torch

import graphfuse as gf
from graphfuse.capture.step import capture
from graphfuse.errors import GraphfuseError
from graphfuse.ir.program import output_nodes
from graphfuse.passes import run_pipeline
from tests.capture.test_capture import MLP, mlp_batches, mlp_loss


def _capture():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, capture(model, optimizer, mlp_loss, mlp_batches(1)[0], gf.Strategy())


@pytest.fixture(scope="module")
def captured():
    return _capture()[1]  # not given to the passes, which edit the graph in place


def test_a_captured_program_has_no_bucket_layout_and_says_which_pass_makes_one(captured):
    assert captured.layout is None
    with pytest.raises(GraphfuseError, match=r"no bucket layout \(passes run: capture\).*plan_buckets"):
        _ = captured.bucket_layout


def test_after_the_passes_bucket_layout_is_the_layout():
    model, captured = _capture()
    program = run_pipeline(captured)
    assert program.layout is not None and program.bucket_layout is program.layout
    slots = {s.fqn for b in program.bucket_layout.buckets for s in b.slots}
    assert slots == {n for n, _ in model.named_parameters()}


def test_output_nodes_are_the_output_nodes_arguments_in_order(captured):
    nodes = output_nodes(captured.graph)
    assert nodes == list(captured.graph.output_node().args[0]) and len(nodes) == len(captured.signature.outputs)
    assert all(isinstance(n, torch.fx.Node) for n in nodes)


def test_a_graph_returning_one_bare_value_is_refused():
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    with pytest.raises(GraphfuseError, match="returns Node, not a tuple"):
        output_nodes(graph)
