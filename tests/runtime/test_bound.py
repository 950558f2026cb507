"""runtime/bound.py: both frontends read their training state through one BoundProgram, whose step
advances the counters only when the step ran. World size 1 here: the multi-rank steps through it are
those of tests/runtime/test_zero1.py and tests/frontends/test_sharded_optimizer.py (1-3 Gloo ranks)."""

import pytest
import torch

import graphfuse as gf
from graphfuse.checkpoint import TrainingState
from graphfuse.runtime.bound import BoundProgram

FIELDS = ("program", "tensors", "steps", "carried", "group", "rank", "world_size", "group_name")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _loss(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _reads_through(owner) -> None:
    bound = owner._bound
    assert type(bound) is BoundProgram and isinstance(owner, TrainingState)
    for name in FIELDS:
        assert getattr(owner, name) is getattr(bound, name), name
    assert owner.layout is bound.program.layout
    owner.steps = [7] * len(owner.steps)  # a checkpoint load assigns them: the BoundProgram's change
    owner.carried = [{"eta": 0.5}] * len(owner.carried)
    assert bound.steps == [7] * len(owner.steps) and bound.carried[0] == {"eta": 0.5}


def test_a_dist_model_reads_its_training_state_through_its_bound_program():
    model = _model()
    dm = gf.compile(model, torch.optim.ASGD(model.parameters(), lr=1e-2), _loss, _batch(0))
    assert dm.steps == [0] and dm.carried == [{}]
    for i in range(2):
        dm(_batch(i))
    # ASGD carries its eta from step to step: what torch.optim.ASGD holds after the same steps
    eager_model = _model()
    eager = torch.optim.ASGD(eager_model.parameters(), lr=1e-2)
    for i in range(2):
        eager.zero_grad()
        _loss(eager_model, _batch(i)).backward()
        eager.step()
    etas = {s["eta"].item() for s in eager.state.values()}
    assert dm.steps == [2] and len(etas) == 1 and set(dm.carried[0]) == {"eta"}
    # graphfuse carries it as a Python float, torch as a 0-d fp32 tensor: equal once rounded so
    assert torch.tensor(dm.carried[0]["eta"], dtype=torch.float32).item() == etas.pop()
    slices = dict(dm.named_slices())
    assert set(slices) >= {f"slice@{n}" for n, _ in model.named_parameters()}
    assert all(torch.equal(slices[f"slice@{n}"], p.detach().reshape(-1)) for n, p in model.named_parameters())
    _reads_through(dm)


def test_a_sharded_optimizer_reads_its_training_state_through_its_bound_program():
    model = _model()
    opt = gf.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
    _loss(model, _batch(0)).backward()
    opt.step()
    assert opt.steps == [1]
    _reads_through(opt)
    with pytest.raises(gf.UnsupportedError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_a_step_that_fails_advances_no_counter_and_carries_nothing_new():
    model = _model()
    opt = torch.optim.ASGD(model.parameters(), lr=1e-2)
    dm = gf.compile(model, opt, _loss, _batch(0))
    dm(_batch(1))
    steps, carried = list(dm.steps), [dict(c) for c in dm.carried]
    opt.param_groups[0]["t0"] = 5.0  # a hyper-parameter the traced update baked in: the step is refused
    with pytest.raises(gf.UnsupportedError):
        dm(_batch(2))
    assert dm.steps == steps and dm.carried == carried
