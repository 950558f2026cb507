"""Changes to the model or optimizer after gf.compile are found at the next step and refused
with a message naming the change and the way out (issue 11, item 3), before any state moves."""

from __future__ import annotations

import pytest
import torch

import graphfuse as gf


def _loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _compiled():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 1e-3}]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    dm = gf.compile(model, opt, _loss, _batch())
    dm(_batch())
    return model, opt, dm


def _add_param_group(model, opt):
    opt.add_param_group({"params": list(model[3].parameters())})


def _freeze(model, opt):
    model[0].weight.requires_grad_(False)


def _remove_from_group(model, opt):
    removed = opt.param_groups[1]["params"].pop()
    assert removed is model[2].bias


def _optimizer_load_state_dict(model, opt):
    opt.load_state_dict(opt.state_dict())


def _pop_group(model, opt):
    opt.param_groups.pop()


def _assign(model, opt):
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _double(model, opt):
    model.double()


CHANGES = {
    _add_param_group: r"3 param groups, 2 when gf.compile traced it: a group was added \(add_param_group\)",
    _freeze: r"parameter 0\.weight: requires_grad changed from True to False",
    _remove_from_group: r"param group 1 changed after gf.compile \(removed: \['2\.bias'\]",
    _optimizer_load_state_dict: r"replaced after gf.compile \(optimizer\.load_state_dict\?\).*gf\.load",
    _pop_group: r"1 param groups, 2 when gf.compile traced it: a group was removed \(param_groups\.pop\(\)\)",
    _assign: r"parameter 0\.weight was replaced .*assign=True",
    _double: r"parameter 0\.weight no longer views its bucket.*torch\.float32 -> torch\.float64",
}


@pytest.mark.parametrize("change", list(CHANGES), ids=lambda f: f.__name__.strip("_"))
def test_change_after_compile_is_refused_at_the_next_step_before_any_state_moves(change):
    model, opt, dm = _compiled()
    before = {n: t.clone() for n, t in dm.tensors.items()}
    change(model, opt)
    with pytest.raises(gf.UnsupportedError, match=CHANGES[change]) as info:
        dm(_batch())
    assert "gf.compile" in str(info.value)  # the way out
    assert all(torch.equal(before[n], t) for n, t in dm.tensors.items())
    assert dm.steps == [1, 1]


def test_allowed_changes_still_train():
    """lr from a scheduler, in-place weight loads and dm.load_state_dict are not changes."""
    model, opt, dm = _compiled()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched.step()
    sd = dm.state_dict()
    model.load_state_dict(model.state_dict())  # copies in place: the views stay
    dm.load_state_dict(sd)
    dm(_batch())
    assert dm.steps == [2, 2] and opt.param_groups[0]["lr"] == 5e-3
