"""What capture refuses (with gf.UnsupportedError, before any state changes), what it traces
again (a batch of new shape), and what it refuses after compile (a changed hyper-parameter)."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
import torch.nn as nn

import graphfuse as gf
from graphfuse.testing.models import GPTConfig, gpt_loss, synthetic_tokens
from tests.capture.test_capture import MLP, adamw, assert_same_state, mlp_batches, mlp_loss, sgd_nesterov, small_gpt


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Each parameter's object, storage and a copy of its value; the optimizer's groups."""
    params = {n: (p, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    groups = [] if optimizer is None else [(list(g["params"]), dict(g)) for g in optimizer.param_groups]
    return {"params": params, "groups": groups, "optimizer": optimizer}


def assert_untouched(model: nn.Module, before: dict) -> None:
    after = dict(model.named_parameters())
    assert after.keys() == before["params"].keys()
    for n, (p, ptr, value) in before["params"].items():
        assert after[n] is p and p.data_ptr() == ptr, f"{n} was rebound"
        assert torch.equal(p, value), f"{n} changed"
    optimizer = before["optimizer"]
    if optimizer is not None:
        assert not any(optimizer.state.values()), "the optimizer gained state"
        assert len(optimizer.param_groups) == len(before["groups"])
        for group, (params, old) in zip(optimizer.param_groups, before["groups"]):
            assert all(a is b for a, b in zip(group["params"], params, strict=True))
            assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in old.items() if k != "params"}


class MyAdamW(torch.optim.AdamW):
    pass


def lbfgs(m):
    return torch.optim.LBFGS(m.parameters())


def subclass(m):
    return MyAdamW(m.parameters(), lr=1e-3)


def differentiable(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-3, differentiable=True)


def tensor_betas(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(torch.tensor(0.9), torch.tensor(0.999)))


def foreign_tensor(m):
    return torch.optim.AdamW([*m.parameters(), nn.Parameter(torch.zeros(7, 3))], lr=1e-3)


def same_param_twice(m):
    optimizer = torch.optim.SGD([{"params": [m.inp.weight]}, {"params": [m.out.bias]}], lr=1e-3)
    optimizer.param_groups[1]["params"].append(m.inp.weight)  # torch checks this only when groups are added
    return optimizer


def sparse_adam(m):  # updates sparse gradients: refused by name
    return torch.optim.SparseAdam(list(m.parameters()))


@pytest.mark.parametrize(
    ("make_optim", "named"),
    [
        (lbfgs, "LBFGS"),
        (sparse_adam, "SparseAdam"),
        (subclass, "MyAdamW"),
        (differentiable, "differentiable=True"),
        (tensor_betas, "tensor betas"),
        (foreign_tensor, "(7, 3) that is not a parameter of the model"),
        (same_param_twice, "inp.weight is in more than one param group"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.__name__,
)
def test_unsupported_optimizer_is_refused_before_any_state_changes(make_optim, named):
    model = MLP()
    optimizer = make_optim(model)
    before = snapshot(model, optimizer)
    with pytest.raises(gf.UnsupportedError, match=re.escape(named)) as info:
        gf.compile(model, optimizer, mlp_loss, mlp_batches(1)[0])
    if make_optim in (lbfgs, sparse_adam, subclass):
        assert "AdamW, torch.optim.Adam, torch.optim.SGD" in str(info.value), "lists what is supported"
    assert_untouched(model, before)


def test_optimizer_that_already_stepped_is_refused():
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mlp_loss(model, mlp_batches(1)[0]).backward()
    optimizer.step()
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    before = snapshot(model)
    with pytest.raises(gf.UnsupportedError, match="AdamW already has state"):
        gf.compile(model, optimizer, mlp_loss, mlp_batches(1)[0])
    assert_untouched(model, before)
    for p, s in optimizer.state.items():
        assert all(torch.equal(v, state[p][k]) for k, v in s.items())


def test_parameter_without_gradient_is_refused_by_name():
    model = MLP()
    model.unused = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model, optimizer)
    with pytest.raises(gf.UnsupportedError, match="unused.weight, unused.bias get no gradient"):
        gf.compile(model, optimizer, mlp_loss, mlp_batches(1)[0])
    assert_untouched(model, before)


class ReadsValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * float(y.abs().max())  # a host read that fake tracing cannot answer


def test_host_read_of_a_tensor_value_is_refused_with_the_way_out():
    model = ReadsValue()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = snapshot(model, optimizer)
    with pytest.raises(gf.UnsupportedError, match="reads a tensor's value on the host"):
        gf.compile(model, optimizer, lambda m, x: m(x).sum(), torch.randn(3, 4))
    assert_untouched(model, before)


class CompileAware(nn.Module):
    """As models written for torch.compile are: a data-dependent check only when not compiling."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.compiler.is_compiling())
        if not torch.compiler.is_compiling() and bool((x == 0).all()):
            raise ValueError("an all-zero batch")
        return self.lin(x)


def test_forward_that_reads_an_input_is_traced_again_as_compiling_and_the_flag_is_restored():
    torch.manual_seed(0)
    m_eager = CompileAware()
    m_gf = copy.deepcopy(m_eager)
    o_eager = torch.optim.AdamW(m_eager.parameters(), lr=1e-2, foreach=False)
    o_gf = torch.optim.AdamW(m_gf.parameters(), lr=1e-2)
    x = torch.randn(5, 4)
    dm = gf.compile(m_gf, o_gf, lambda m, b: m(b).square().mean(), x)
    # First as eager runs it (the all-zero check reads the batch: fake tensors cannot answer),
    # then as compiling, which skips the check.
    assert m_gf.seen == [False, True]
    assert not torch.compiler.is_compiling()
    for _ in range(3):
        o_eager.zero_grad()
        loss = m_eager(x).square().mean()
        loss.backward()
        o_eager.step()
        assert torch.equal(dm(x), loss.detach())
    assert_same_state(m_eager, o_eager, m_gf, dm, "compile-aware model")


def test_compiling_flag_is_restored_when_tracing_fails():
    model = ReadsValue()
    with pytest.raises(gf.UnsupportedError):
        gf.capture(model, torch.optim.SGD(model.parameters(), lr=1e-3), lambda m, x: m(x).sum(), torch.randn(3, 4))
    assert not torch.compiler.is_compiling()


@pytest.mark.parametrize("model_kind", ["mlp", "gpt"])
def test_batch_of_new_shape_is_recaptured_and_stays_bitwise(model_kind, caplog):
    torch.manual_seed(0)
    if model_kind == "mlp":
        m_eager, loss_fn, make_optim = MLP(), mlp_loss, sgd_nesterov
        first, second = mlp_batches(3, batch_size=8), mlp_batches(3, batch_size=5, seed=9)
    else:
        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
        m_eager, loss_fn, make_optim = small_gpt(), gpt_loss, adamw
        first = synthetic_tokens(cfg, 2, 3, seed=1)
        second = [(x[:, :9].contiguous(), y[:, :9].contiguous()) for x, y in synthetic_tokens(cfg, 3, 3, seed=2)]
    m_gf = copy.deepcopy(m_eager)
    o_eager, o_gf = make_optim(m_eager), make_optim(m_gf)
    dm = gf.compile(m_gf, o_gf, loss_fn, first[0])
    caplog.set_level(logging.INFO, logger="graphfuse")
    # Interleave the shapes: the second is traced once, then both programs are reused.
    for batch in [first[0], second[0], first[1], second[1], second[2], first[2]]:
        o_eager.zero_grad()
        loss = loss_fn(m_eager, batch)
        loss.backward()
        o_eager.step()
        assert torch.equal(dm(batch), loss.detach())
        assert_same_state(m_eager, o_eager, m_gf, dm, f"batch of shape {tuple(batch[0].shape)}")
    recaptures = [r for r in caplog.records if "re-capturing" in r.getMessage()]
    assert len(recaptures) == 1, [r.getMessage() for r in caplog.records]
    assert len(dm._programs) == 2


def test_changing_betas_after_compile_is_refused_and_leaves_the_model_untouched():
    model = MLP()
    optimizer = adamw(model)
    batches = mlp_batches(2)
    dm = gf.compile(model, optimizer, mlp_loss, batches[0])
    dm(batches[0])
    before = snapshot(model)
    states = {k: v.clone() for k, v in dm.named_slices()}
    steps = list(dm.steps)
    optimizer.param_groups[1]["betas"] = (0.8, 0.95)
    with pytest.raises(gf.UnsupportedError, match=r"param group 1: betas changed from \(0.9, 0.95\) to \(0.8, 0.95\)"):
        dm(batches[1])
    assert_untouched(model, before)
    assert all(torch.equal(v, states[k]) for k, v in dm.named_slices())
    assert dm.steps == steps
    optimizer.param_groups[1]["betas"] = (0.9, 0.95)  # back to the traced value: steps again
    dm(batches[1])
    assert dm.steps == [s + 1 for s in steps]


@pytest.mark.parametrize(("key", "value"), [("momentum", 0.5), ("nesterov", False), ("dampening", 0.1)])
def test_changing_sgd_options_after_compile_is_refused(key, value):
    model = MLP()
    optimizer = sgd_nesterov(model)
    dm = gf.compile(model, optimizer, mlp_loss, mlp_batches(1)[0])
    before = snapshot(model)
    optimizer.param_groups[0][key] = value
    with pytest.raises(gf.UnsupportedError, match=f"param group 0: {key} changed"):
        dm(mlp_batches(1)[0])
    assert_untouched(model, before)


class ReadsConstant(nn.Module):
    """Host reads of values computed from shapes alone, as transformers' masking code does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.compiler.is_compiling())
        positions = torch.arange(x.shape[0]).unsqueeze(0)
        scale = float(positions[:, -1].sum()) + 1.0  # read on the host: 5.0 for 5 rows
        if bool((torch.diff(positions, dim=-1) == 1).all()):
            scale = scale * 2
        return self.lin(x) * scale


def test_host_read_of_a_value_computed_from_constants_is_answered_as_eager_reads_it():
    torch.manual_seed(0)
    m_eager = ReadsConstant()
    m_gf = copy.deepcopy(m_eager)
    o_eager = torch.optim.AdamW(m_eager.parameters(), lr=1e-2, foreach=False)
    dm = gf.compile(
        m_gf, torch.optim.AdamW(m_gf.parameters(), lr=1e-2), lambda m, b: m(b).square().mean(), torch.randn(5, 4)
    )
    assert m_gf.seen == [False], "traced once, as eager runs it"
    for _ in range(2):
        x = torch.randn(5, 4)
        o_eager.zero_grad()
        loss = m_eager(x).square().mean()
        loss.backward()
        o_eager.step()
        assert torch.equal(dm(x), loss.detach())
    assert_same_state(m_eager, o_eager, m_gf, dm, "constant reads")


class OverwritesConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.zeros(4)
        c.add_(x.sum(0))  # from here on c depends on the batch: its value is no longer known
        return self.lin(x) * (2.0 if bool(c.sum() > 0) else 1.0)


def test_host_read_of_a_constant_overwritten_by_an_input_is_refused():
    model = OverwritesConstant()
    with pytest.raises(gf.UnsupportedError, match=r"reads a tensor's value on the host in module \(the model\)"):
        gf.compile(model, torch.optim.SGD(model.parameters(), lr=1e-3), lambda m, b: m(b).sum(), torch.randn(5, 4))
