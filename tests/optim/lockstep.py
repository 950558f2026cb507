"""One-rank lockstep against plain torch, shared by the whole-matrix optimizer tests: the same
batches through an eager model with torch's optimizers and through a DistModel, losses and
weights compared bit for bit after every step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def assert_bitwise_lockstep(
    m_ref: torch.nn.Module,
    o_ref: Sequence[torch.optim.Optimizer],
    m_gf: torch.nn.Module,
    dm: Callable,
    loss_fn: Callable,
    batches: Sequence,
    schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler] = (),
) -> None:
    """Step `m_ref` under `o_ref` (zero_grad, backward, step, then `schedulers`: the eager
    half first, the graphfuse half after) and `dm` on each batch; every loss and weight equal."""
    half = len(schedulers) // 2
    for i, batch in enumerate(batches):
        for o in o_ref:
            o.zero_grad()
        loss = loss_fn(m_ref, batch)
        loss.backward()
        for o in o_ref:
            o.step()
        for s in schedulers[:half]:
            s.step()
        assert torch.equal(loss.detach(), dm(batch)), f"step {i}: loss differs"
        for s in schedulers[half:]:
            s.step()
        for (n, p), q in zip(m_ref.named_parameters(), m_gf.parameters()):
            assert torch.equal(p, q), f"step {i}: {n} differs by {(p - q).abs().max().item()}"


def assert_same_torch_state(got: dict, want: dict) -> None:
    """Two optimizer state dicts equal: param groups, keys, and every state bit for bit."""
    assert got["param_groups"] == want["param_groups"] and got["state"].keys() == want["state"].keys()
    for k, states in want["state"].items():
        assert got["state"][k].keys() == states.keys(), k
        for name, t in states.items():
            assert t.shape == got["state"][k][name].shape and torch.equal(got["state"][k][name], t), f"{k}.{name}"


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    """The mean squared error of `model(x)` against `y`, for `batch = (x, y)`."""
    x, y = batch
    return (model(x) - y).square().mean()


def regression_batches(steps: int, outputs: int, seed: int = 0) -> list:
    """`steps` batches of 6 rows: 8 inputs and `outputs` targets, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, outputs, generator=g)) for _ in range(steps)]


def transformer_pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module, Callable, list]:
    """Two equal transformers ("gpt": graphfuse's 2-layer GPT; "llama": an HF Llama from a
    config), their loss and 2 token batches: (reference, copy for graphfuse, loss_fn, batches)."""
    import copy

    import pytest

    from graphfuse.testing.models import gpt_loss
    from tests.capture.test_capture import hf_lm_loss, small_gpt, tiny_llama, token_batches

    if name == "llama":
        pytest.importorskip("transformers", reason="the HF Llama needs transformers (the hf extra)")
    torch.manual_seed(0)
    m_ref = small_gpt() if name == "gpt" else tiny_llama()
    loss_of = gpt_loss if name == "gpt" else hf_lm_loss
    return m_ref, copy.deepcopy(m_ref), loss_of, token_batches(2, vocab=64 if name == "gpt" else 96)
