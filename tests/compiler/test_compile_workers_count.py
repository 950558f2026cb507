"""Strategy(compile_workers="auto") (compile_workers.how_many): how many compile workers a
process starts, from the cores of its rank's share of the host. The core count is set by
monkeypatching `host_cores`, so every branch runs on any machine; the rule's numbers come
from the H200 measurements in docs/benchmarks.md ("How many compile workers")."""

from __future__ import annotations

import os

import pytest
import torch

import graphfuse as gf
from graphfuse.compiler import workers as W


def _cores(monkeypatch, cores: int, bound: bool = False, local: str | None = None, gpus: int = 1):
    monkeypatch.setattr(W, "host_cores", lambda: (cores, bound))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)


@pytest.mark.parametrize(("cores", "expected"), [(2, 0), (4, 0), (8, 1), (12, 2), (16, 3), (128, 3)])
def test_auto_gives_one_process_per_four_cores_of_a_rank_at_most_three_workers(monkeypatch, cores, expected):
    _cores(monkeypatch, cores)
    assert W.how_many("auto", "inductor", "cuda", world_size=1) == expected


def test_auto_shares_the_host_among_its_local_ranks(monkeypatch):
    _cores(monkeypatch, 128, local="8", gpus=8)  # torchrun on an 8-GPU host: 16 cores a rank
    assert W.how_many("auto", "inductor", "cuda", world_size=16) == 3
    _cores(monkeypatch, 16, local="2")
    assert W.how_many("auto", "inductor", "cuda", world_size=2) == 1
    _cores(monkeypatch, 16, gpus=4)  # no LOCAL_WORLD_SIZE: one rank per GPU, up to the world size
    assert W.how_many("auto", "inductor", "cuda", world_size=4) == 0
    assert W.how_many("auto", "inductor", "cuda", world_size=2) == 1
    _cores(monkeypatch, 16, local="not a number", gpus=2)
    assert W.how_many("auto", "inductor", "cuda", world_size=2) == 1


def test_auto_takes_cores_a_launcher_bound_the_rank_to_as_its_share(monkeypatch):
    _cores(monkeypatch, 16, bound=True, local="8")
    assert W.how_many("auto", "inductor", "cuda", world_size=8) == 3


def test_auto_starts_no_worker_off_inductor_or_off_cuda(monkeypatch):
    _cores(monkeypatch, 64)
    assert W.how_many("auto", "inductor", "cpu", world_size=1) == 0
    assert W.how_many("auto", "eager", "cuda", world_size=1) == 0
    assert W.how_many(2, "inductor", "cpu", world_size=1) == 2  # a number is taken as it is


def test_host_cores_are_the_cores_this_process_may_run_on():
    cores, bound = W.host_cores()
    if hasattr(os, "sched_getaffinity"):
        assert cores == len(os.sched_getaffinity(0))
    assert 1 <= cores <= (os.cpu_count() or 1) and bound == (cores < (os.cpu_count() or 1))


def test_auto_is_the_default_and_any_compile_mode_takes_it():
    assert gf.Strategy().compile_workers == "auto"
    assert gf.Strategy(compile="eager").compile_workers == "auto"
    with pytest.raises(gf.UnsupportedError, match="compile_workers must be an int >= 0 or 'auto'"):
        gf.Strategy(compile="inductor", compile_workers="many")


def test_a_cpu_model_starts_no_worker_by_default(monkeypatch):
    _cores(monkeypatch, 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(3, 4), torch.randn(3, 2))

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    dm = gf.compile(model, opt, loss_fn, batch, gf.Strategy(compile="inductor"))
    assert dm.compile_workers == 0 and dm._workers is None
    assert dm.program.strategy.compile_workers == "auto"  # chosen again wherever the program is run
