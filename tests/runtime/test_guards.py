"""Guards of a compiled step (issue 11, items 3-5): changes to the model or optimizer after
gf.compile are refused at the next step before any state moves; the batch gets messages that
name the real cause; the program cache is bounded."""

from __future__ import annotations

import collections

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


def _append_param_group(model, opt):
    opt.param_groups.append(
        {**opt.param_groups[0], "params": list(model[3].parameters())}
    )  # add_param_group raises at once


def _freeze(model, opt):
    model[0].weight.requires_grad_(False)


def _remove_from_group(model, opt):
    removed = opt.param_groups[1]["params"].pop()
    assert removed is model[2].bias


def _replace_state(model, opt):
    opt.state = collections.defaultdict(
        dict
    )  # optimizer.load_state_dict loads into the shards (tests/frontends/test_habits.py)


def _pop_group(model, opt):
    opt.param_groups.pop()


def _assign(model, opt):
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _double(model, opt):
    model.double()


CHANGES = {
    _append_param_group: r"3 param groups, 2 when gf.compile traced it: a group was added \(add_param_group\)",
    _freeze: r"parameter 0\.weight: requires_grad changed from True to False",
    _remove_from_group: r"param group 1 changed after gf.compile \(removed: \['2\.bias'\]",
    _replace_state: r"replaced after gf.compile \(assigned a new object\).*optimizer\.load_state_dict",
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


def test_progressive_unfreezing_after_compile_is_refused_at_the_next_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)  # frozen, but in the optimizer: unfrozen later
    dm = gf.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _loss, _batch())
    dm(_batch())
    before = {n: t.clone() for n, t in dm.tensors.items()}
    model[0].weight.requires_grad_(True)
    with pytest.raises(gf.UnsupportedError, match=r"parameter 0\.weight: requires_grad changed from False to True"):
        dm(_batch())
    assert all(torch.equal(before[n], t) for n, t in dm.tensors.items()) and dm.steps == [1]


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


def _sized(n: int):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def test_program_cache_keeps_at_most_program_cache_size_programs_and_warns_when_it_churns(caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    dm = gf.compile(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _sized(2), strategy=gf.Strategy(program_cache_size=2)
    )
    with pytest.warns(
        UserWarning, match=r"program cache \(Strategy.program_cache_size=2\) dropped a traced program \(1 so far\)"
    ):
        for n in (2, 3, 4):
            dm(_sized(n))
    assert len(dm._programs) == 2 and dm._programs.evictions == 1
    caplog.set_level("INFO", logger="graphfuse")
    caplog.clear()
    with pytest.warns(UserWarning, match=r"\(2 so far\)"):
        dm(_sized(2))  # dropped: traced again, and the least recently used (3) goes
    assert [k[1][0].shape[0] for k in dm._programs] == [4, 2]
    assert sum("re-capturing" in r.getMessage() for r in caplog.records) == 1
    dm(_sized(4))  # still cached: no trace, no eviction
    assert dm._programs.evictions == 2 and dm.steps == [5]


def test_float64_batch_is_named_as_a_dtype_change_not_a_shape_change():
    model, opt, dm = _compiled()
    x, y = _batch()
    with pytest.raises(gf.UnsupportedError, match=r"leaf 0: dtype float32 -> float64.*cast the batch") as info:
        dm((x.double(), y.double()))
    assert "shape" not in str(info.value)


def test_empty_batch_is_refused_by_name_at_compile_and_at_a_step():
    model, opt, dm = _compiled()
    with pytest.raises(gf.UnsupportedError, match=r"batch leaf 0 has shape \(0, 8\): an empty batch.*drop_last"):
        dm((torch.randn(0, 8), torch.randn(0, 4)))
    fresh = torch.nn.Linear(8, 4)
    with pytest.raises(gf.UnsupportedError, match="an empty batch"):
        gf.compile(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), _loss, (torch.randn(0, 8), torch.randn(0, 4)))


def test_a_batch_of_another_structure_that_breaks_loss_fn_says_it_was_being_recaptured():
    model, opt, dm = _compiled()
    with pytest.raises(IndexError) as info:
        dm((_batch()[0],))
    assert any(
        "re-capturing the step for a batch that differs" in n and "structure changed" in n for n in info.value.__notes__
    )


def test_train_eval_switch_after_compile_warns_that_python_state_is_frozen():
    model, opt, dm = _compiled()
    model.eval()
    with pytest.warns(
        UserWarning, match=r"module model was switched to eval mode after gf.compile.*frozen at trace time"
    ):
        dm(_batch())
    assert dm.steps == [2, 2]  # a warning, not a refusal: the step ran as traced


# ---- the ranks agree before gf.compile's first collective (issue 11 item 2) ---------------------
def _compile_faults(rank: int, world: int) -> dict:
    """Rank 1's loss_fn raises while tracing; then rank 1's model is wider (another layout); then
    both compile and train: the failures left the ranks in step."""
    import time

    def broken(model, batch):
        if rank == 1:
            raise ValueError("rank 1's loss_fn is broken")
        return _loss(model, batch)

    def build(width: int, loss_fn=_loss):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
        return gf.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, _batch())

    out = {}
    for name, make in (("raises", lambda: build(16, broken)), ("layout", lambda: build(16 if rank == 0 else 32))):
        start = time.monotonic()
        try:
            make()
            out[name] = (None, None, time.monotonic() - start)
        except Exception as e:
            out[name] = (type(e).__name__, str(e), time.monotonic() - start)
    out["loss_after"] = build(16)(_batch()).item()
    return out


def test_a_rank_failing_in_gf_compile_ends_compile_on_every_rank_soon_and_they_stay_in_step():
    from tests._common import run_ranks

    r0, r1 = run_ranks(_compile_faults, 2, timeout=240)
    cls, msg, seconds = r0["raises"]
    assert cls == "GraphfuseError" and "gf.compile (build) failed on rank 1" in msg and "loss_fn is broken" in msg, msg
    assert seconds < 60
    assert r1["raises"][:2] == ("ValueError", "rank 1's loss_fn is broken")  # its own error, unwrapped
    for r in (r0, r1):
        cls, msg, _ = r["layout"]
        assert cls == "UnsupportedError" and "different bucket layouts" in msg, msg
    assert isinstance(r0["loss_after"], float) and r0["loss_after"] == r1["loss_after"]  # same weights, same batch
