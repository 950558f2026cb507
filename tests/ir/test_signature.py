"""The signature of a captured (unfused) program: one role per placeholder and output, one
gradient node per trainable parameter, a phase on every node, tied and frozen FQNs."""

from __future__ import annotations

import pytest
import torch

import graphfuse as gf
from graphfuse.ir import signature as sig
from graphfuse.testing.models import GPTConfig, gpt_loss, synthetic_tokens
from tests.capture.test_capture import (
    MLP,
    ConvNet,
    adamw,
    conv_batches,
    freeze_first_layer,
    mlp_batches,
    mlp_loss,
    sgd_nesterov,
    small_gpt,
)


def capture_mlp() -> tuple[torch.nn.Module, gf.Program]:
    model = MLP()
    freeze_first_layer(model)
    return model, gf.capture(model, adamw(model), mlp_loss, mlp_batches(1)[0])


def capture_gpt() -> tuple[torch.nn.Module, gf.Program]:
    model = small_gpt()
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return model, gf.capture(model, adamw(model), gpt_loss, synthetic_tokens(cfg, 2, 1, seed=0)[0])


def capture_conv() -> tuple[torch.nn.Module, gf.Program]:
    model = ConvNet()
    return model, gf.capture(model, sgd_nesterov(model), mlp_loss, conv_batches(1)[0])


CAPTURES = [capture_mlp, capture_gpt, capture_conv]


@pytest.fixture(scope="module", params=CAPTURES, ids=lambda f: f.__name__.removeprefix("capture_"))
def captured(request) -> tuple[torch.nn.Module, gf.Program]:
    return request.param()


def test_every_placeholder_has_exactly_one_role(captured):
    model, program = captured
    phs = program.placeholders()
    specs = program.signature.inputs
    assert len(phs) == len(specs)
    assert [n.meta["gf_input"] for n in phs] == list(specs)
    assert all(s.role in sig.INPUT_ROLES for s in specs)
    assert len({s.name for s in specs}) == len(specs), "an input name is used twice"
    # Each Parameter is one input: PARAM if the optimizer updates it, else FROZEN, never both.
    canonical = dict(model.named_parameters())
    assert sorted(program.signature.names(sig.PARAM) + program.signature.names(sig.FROZEN)) == sorted(canonical)
    assert sorted(program.signature.names(sig.BUFFER)) == sorted(dict(model.named_buffers()))
    assert all(
        program.inputs_meta[s.name].shape == tuple(canonical[s.name].shape) for s in specs if s.role == sig.PARAM
    )


def test_every_output_has_exactly_one_role_and_target(captured):
    _, program = captured
    outs = program.signature.outputs
    assert len(program.output_args()) == len(outs)
    assert all(s.role in sig.OUTPUT_ROLES for s in outs)
    assert [s.role for s in outs].count(sig.LOSS) == 1 and outs[0].role == sig.LOSS
    targets = [s.target for s in outs if s.role != sig.LOSS]
    assert len(set(targets)) == len(targets), "two outputs write the same input"
    roles = {s.name: s.role for s in program.signature.inputs}
    expected = {sig.NEW_PARAM: sig.PARAM, sig.NEW_STATE: sig.STATE, sig.NEW_BUFFER: sig.BUFFER}
    for s in outs[1:]:
        assert roles[s.target] == expected[s.role], f"{s.name} ({s.role}) writes {s.target} ({roles[s.target]})"
    assert sorted(program.signature.output_names(sig.NEW_PARAM)) == sorted(program.signature.names(sig.PARAM))
    assert sorted(program.signature.output_names(sig.NEW_STATE)) == sorted(program.signature.names(sig.STATE))


def test_every_trainable_parameter_has_exactly_one_gradient_node(captured):
    model, program = captured
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    grads = program.signature.grads
    assert set(grads) == trainable
    assert len(set(grads.values())) == len(grads), "two parameters share a gradient node"
    for fqn, name in grads.items():
        node = program.node(name)
        assert node.op == "call_function" and node.meta["phase"] == sig.BACKWARD, f"{fqn}: {node.format_node()}"
        val = node.meta["val"]
        assert (
            tuple(val.shape) == program.inputs_meta[fqn].shape
            and str(val.dtype) == f"torch.{program.inputs_meta[fqn].dtype}"
        )


def test_every_node_has_a_phase_and_each_phase_is_present(captured):
    _, program = captured
    phases = {}
    for n in program.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        assert n.meta.get("phase") in (sig.FORWARD, sig.BACKWARD, sig.OPTIMIZER), n.format_node()
        phases.setdefault(n.meta["phase"], []).append(n)
    assert set(phases) == {sig.FORWARD, sig.BACKWARD, sig.OPTIMIZER}
    loss = program.output_args()[0]
    assert loss.meta["phase"] == sig.FORWARD
    for spec, node in zip(program.signature.outputs, program.output_args()):
        if spec.role in (sig.NEW_PARAM, sig.NEW_STATE):
            assert node.meta["phase"] == sig.OPTIMIZER, f"{spec.name} comes from {node.meta['phase']}"
    # The optimizer reads gradients, never the other way round.
    for n in phases[sig.FORWARD] + phases[sig.BACKWARD]:
        assert all(a.meta.get("phase") != sig.OPTIMIZER for a in n.all_input_nodes)


def test_tied_output_layer_is_an_alias_not_an_input():
    _, program = capture_gpt()
    assert program.signature.aliases == {"lm_head.weight": "wte.weight"}
    names = {s.name for s in program.signature.inputs} | {s.name for s in program.signature.outputs}
    assert not any(n.startswith("lm_head.weight") for n in names)
    assert "wte.weight" in program.signature.grads
    # The position buffer is read, never written.
    assert program.signature.output_names(sig.NEW_BUFFER) == []


def test_frozen_parameter_is_frozen_and_never_written():
    _, program = capture_mlp()
    assert program.signature.names(sig.FROZEN) == ["inp.weight", "inp.bias"]
    targets = {s.target for s in program.signature.outputs}
    assert not {"inp.weight", "inp.bias"} & targets
    assert not [n for n in program.signature.names(sig.STATE) if n.startswith("inp.")]
    assert "inp.weight" not in program.signature.grads


def test_batchnorm_running_stats_are_new_buffers():
    _, program = capture_conv()
    assert sorted(program.signature.output_names(sig.NEW_BUFFER)) == sorted(
        f"{bn}.{b}" for bn in ("bn1", "bn2") for b in ("running_mean", "running_var", "num_batches_tracked")
    )


def test_signature_round_trips_through_json(captured):
    _, program = captured
    assert sig.Signature.from_json(program.signature.to_json()) == program.signature
