"""The runtime: the inductor executor writes buckets and shards in place, compiles at the
first step (also for a program loaded from a file), and schedulers see the optimizer step."""

import warnings

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
    assert model[0].weight.data_ptr() == dm.tensors[dm.layout.bucket_of("0.weight").name].data_ptr() + dm.layout.bucket_of(
        "0.weight"
    ).slot("0.weight").offset * 4

    # A loaded program has no example batch: inductor compiles it at its first step.
    gf.save_program(dm.program, tmp_path / "program")
    fresh = _mlp()
    loaded = gf.DistModel.from_program(gf.load_program(tmp_path / "program"), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    other = _mlp()
    again = gf.compile(other, torch.optim.AdamW(other.parameters(), lr=1e-2), _loss, batches[0], strategy=gf.Strategy(compile="inductor"))
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
