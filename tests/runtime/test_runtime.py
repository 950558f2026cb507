"""The runtime: the inductor executor writes buckets and shards in place, compiles at the
first step (also for a program loaded from a file), schedulers see the optimizer step, and
programs run in the grad mode they were traced in (issue 13: LSTM, activation checkpointing)."""

import contextlib
import copy
import warnings

import pytest
import torch

import graphfuse as gf


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _batches(n: int = 4):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def test_inductor_executor_writes_in_place_and_matches_eager(tmp_path):
    batches = _batches()
    eager_model, model = _mlp(), _mlp()
    eager = gf.compile(eager_model, torch.optim.AdamW(eager_model.parameters(), lr=1e-2), _loss, batches[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dm = gf.compile(model, opt, _loss, batches[0], strategy=gf.Strategy(compile="inductor"))
    ptrs = {n: t.data_ptr() for n, t in dm.tensors.items()}
    for b in batches:
        torch.testing.assert_close(dm(b), eager(b), rtol=1e-5, atol=1e-6)
    assert {n: t.data_ptr() for n, t in dm.tensors.items()} == ptrs
    # inductor does not round like eager kernels (lerp, sqrt): close, not bitwise
    for a, b in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (
        model[0].weight.data_ptr()
        == dm.tensors[dm.layout.bucket_of("0.weight").name].data_ptr()
        + dm.layout.bucket_of("0.weight").slot("0.weight").offset * 4
    )

    # A loaded program has no example batch: inductor compiles it at its first step.
    gf.save_program(dm.program, tmp_path / "program")
    fresh = _mlp()
    loaded = gf.DistModel.from_program(
        gf.load_program(tmp_path / "program"), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    )
    other = _mlp()
    again = gf.compile(
        other,
        torch.optim.AdamW(other.parameters(), lr=1e-2),
        _loss,
        batches[0],
        strategy=gf.Strategy(compile="inductor"),
    )
    for b in batches:
        torch.testing.assert_close(loaded(b), again(b), rtol=0, atol=0)


def test_lr_scheduler_sees_the_optimizer_step():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    dm = gf.compile(model, opt, _loss, _batches(1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        dm(_batches(1)[0])
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.5e-2


class _LSTMHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def _eager_and_graphfuse(model_fn, batches, steps_under=contextlib.nullcontext):
    """Losses and final parameters of eager AdamW(foreach=False) and of gf.compile."""
    torch.manual_seed(0)
    model = model_fn()
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, foreach=False)
    dm = gf.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _loss, batches[0])
    eager_losses, losses = [], []
    for b in batches:
        eager_opt.zero_grad()
        loss = _loss(eager, b)
        loss.backward()
        eager_opt.step()
        eager_losses.append(loss.detach())
        with steps_under():
            losses.append(dm(b))
    return (eager_losses, list(eager.parameters())), (losses, list(model.parameters()))


def test_lstm_program_runs_in_the_grad_mode_it_was_traced_in():
    """oneDNN's LSTM (mkldnn_rnn_layer) returns no workspace with grad mode off: the program
    must run with it on, also when the caller steps under torch.no_grad()."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 5, 8, generator=g), torch.randn(3, 4, generator=g)) for _ in range(3)]
    (e_losses, e_params), (losses, params) = _eager_and_graphfuse(_LSTMHead, batches, steps_under=torch.no_grad)
    assert all(torch.equal(a, b) for a, b in zip(e_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(e_params, params))
    assert not any(loss.requires_grad for loss in losses)


class _Checkpointed(torch.nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.embed, self.inner, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(
            lambda y: torch.relu(self.inner(y)), self.embed(x), use_reentrant=self.use_reentrant
        )
        return self.out(h)


def test_reentrant_activation_checkpointing_is_refused_by_name_with_the_way_out():
    model = _Checkpointed(use_reentrant=True)
    with pytest.raises(gf.UnsupportedError, match=r"use_reentrant=True.*pass use_reentrant=False"):
        gf.compile(model, torch.optim.AdamW(model.parameters()), _loss, _batches(1)[0])


def test_non_reentrant_activation_checkpointing_is_bitwise_with_eager():
    (e_losses, e_params), (losses, params) = _eager_and_graphfuse(
        lambda: _Checkpointed(use_reentrant=False), _batches(3)
    )
    assert all(torch.equal(a, b) for a, b in zip(e_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(e_params, params))
