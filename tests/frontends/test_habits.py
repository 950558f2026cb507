"""A PyTorch user's habits after gf.compile and gf.shard_optimizer (docs/habits.md), at 1, 2 and
3 Gloo ranks: the optimizer's own state_dict, torch.save / torch.load(weights_only=True), in-memory
state dicts into fresh objects (before and after a step), DCP's get_state_dict / set_state_dict,
the wrapped optimizer's step, gradient clipping and the global norm. Every resumed copy trains on
bitwise with an eager data-parallel AdamW that never stopped."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import graphfuse as gf
from tests._common import run_ranks
from tests.frontends.test_sharded_optimizer import (
    accumulate,
    adamw,
    batches,
    ddp_step,
    loss_of,
    model_,
    sharded,
    sharded_step,
    warmup,
)

STEPS, AT = 6, 3  # train to AT, save, then every copy trains on to STEPS
MODES = ("balanced", "unbalanced")


def _strategy(**kw) -> gf.Strategy:
    return gf.Strategy(align_bytes=32, bucket_size_mb=0.0005, **kw)


def _compiled(**kw):
    model = model_()
    opt = adamw(model.parameters())
    dm = gf.compile(model, opt, loss_of, batches(0, 1)[0], strategy=_strategy(**kw))
    return model, opt, dm, torch.optim.lr_scheduler.LambdaLR(opt, warmup)


def _plain():
    model = model_()
    opt = adamw(model.parameters())
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup)


def _reload(obj):
    """torch.save then torch.load with torch's default (weights_only=True)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _same_state(osd: dict, plain_opt) -> bool:
    """An index-keyed optimizer state dict equal, tensor for tensor, to the plain optimizer's."""
    ref = plain_opt.state_dict()
    if sorted(osd["state"]) != sorted(ref["state"]) or [g["params"] for g in osd["param_groups"]] != [
        g["params"] for g in ref["param_groups"]
    ]:
        return False
    return all(
        set(osd["state"][i]) == set(s) and all(torch.equal(osd["state"][i][k], v) for k, v in s.items())
        for i, s in ref["state"].items()
    )


def _raises(fn) -> str:
    try:
        fn()
    except gf.UnsupportedError as e:
        return str(e)
    return ""


def _evaluates_like(model, plain, x) -> bool:
    """Evaluation as usual (eval mode, no_grad, back to train) shows the trained weights."""
    model.eval()
    plain.eval()
    with torch.no_grad():
        same = torch.equal(model(x), plain(x))
    model.train()
    plain.train()
    return same


def _clip_reference_step(model, opt, batch, world, layout, max_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager data parallel with clipping: the averaged gradients' global norm, clipped, stepped."""
    opt.zero_grad()
    loss = accumulate(model, [batch])
    grads = dict(model.named_parameters())
    for bucket in layout.buckets if world > 1 else ():
        flat = torch.zeros(bucket.size)
        for s in bucket.slots:
            flat[slice(*s.data_range)] = grads[s.fqn].grad.reshape(-1)
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for s in bucket.slots:
            grads[s.fqn].grad.copy_(flat[slice(*s.data_range)].view(s.shape))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
    opt.step()
    return loss, norm


def _compile_habits(rank: int, world: int) -> dict:
    data = batches(rank, STEPS)
    model, opt, dm, sched = _compiled()
    plain, plain_opt, plain_sched = _plain()
    for step in range(AT):
        opt.zero_grad()  # a habit: harmless, there are no .grad tensors to clear
        dm(data[step])
        ddp_step(plain, plain_opt, [data[step]], world, layout=dm.layout)
        sched.step()
        plain_sched.step()
    out = {"optimizer_state_dict_is_torchs": _same_state(opt.state_dict(), plain_opt)}
    out["eval"] = _evaluates_like(model, plain, data[0][0])
    habitual = _reload({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()})
    copies = []  # (DistModel, model, scheduler): each trains on from step AT
    for mode in MODES:  # in memory, through torch.save, into a fresh DistModel that has not stepped
        m, o, d, s = _compiled()
        d.load_state_dict(_reload(dm.state_dict(mode)))
        s.load_state_dict(sched.state_dict())
        copies.append((d, m, s))
    m, o, d, s = _compiled()  # the habitual checkpoint into a fresh DistModel's own model and optimizer
    m.load_state_dict(habitual["model"])
    o.load_state_dict(habitual["optim"])
    s.load_state_dict(habitual["sched"])
    copies.append((d, m, s))
    msd, osd = get_state_dict(model, opt)  # DCP's habit
    m, o, d, s = _compiled()
    set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
    s.load_state_dict(sched.state_dict())
    copies.append((d, m, s))
    resumed, resumed_opt, resumed_sched = _plain()  # plain PyTorch from the habitual checkpoint
    resumed.load_state_dict(habitual["model"])
    resumed_opt.load_state_dict(habitual["optim"])
    resumed_sched.load_state_dict(habitual["sched"])
    out["refusals"] = [
        _raises(lambda: opt.step()),
        _raises(lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})),
        _raises(lambda: opt.state[next(model.parameters())]),
    ]
    copies.append((dm, model, sched))
    for step in range(AT, STEPS):
        expected = ddp_step(plain, plain_opt, [data[step]], world, layout=dm.layout)
        ddp_step(resumed, resumed_opt, [data[step]], world, layout=dm.layout)
        for d, _, s in copies:
            out.setdefault("losses", []).append(torch.equal(d(data[step]), expected))
            s.step()
        plain_sched.step()
        resumed_sched.step()
    ref = list(plain.parameters())
    out["params"] = [all(torch.equal(a, b) for a, b in zip(m.parameters(), ref)) for _, m, _ in copies]
    out["plain_resumed"] = all(torch.equal(a, b) for a, b in zip(resumed.parameters(), ref))
    out["lr"] = {s.get_last_lr()[0] for _, _, s in copies} == {plain_sched.get_last_lr()[0]}
    out["metrics"] = (dm.metrics.step, dm.metrics.samples, dm.metrics.tokens, dm.grad_norm)
    return out


def _compile_clipping(rank: int, world: int) -> dict:
    data = batches(rank, AT)
    model, _, dm, _ = _compiled(max_grad_norm=0.05)
    plain, plain_opt, _ = _plain()
    losses, norms = [], []
    for step in range(AT):
        loss = dm(data[step])
        ref_loss, ref_norm = _clip_reference_step(plain, plain_opt, data[step], world, dm.layout, 0.05)
        losses.append((loss - ref_loss).abs().item())
        norms.append((dm.grad_norm.item(), ref_norm.item(), dm.metrics.as_dict()["grad_norm"]))
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
    return {"losses": losses, "norms": norms, "param_diff": diff}


def _sharded_habits(rank: int, world: int) -> dict:
    data = batches(rank, STEPS)
    model = model_()
    opt = sharded(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    plain, plain_opt, plain_sched = _plain()
    first = []
    for step in range(AT):
        first.append(sharded_step(model, opt, [data[step]]))
        ddp_step(plain, plain_opt, [data[step]], world, layout=opt.layout)
        sched.step()
        plain_sched.step()
    out = {"optimizer_state_dict_is_torchs": _same_state(opt.state_dict(), plain_opt)}
    out["eval"] = _evaluates_like(model, plain, data[0][0])
    # accelerate's prepare: state_dict() and load_state_dict() of an optimizer that never stepped
    early = model_()
    early_opt = sharded(early)
    early_opt.load_state_dict(_reload(early_opt.state_dict()))
    early_sched = torch.optim.lr_scheduler.LambdaLR(early_opt, warmup)
    out["early_round_trip"] = []
    for step in range(AT):
        out["early_round_trip"].append(torch.equal(sharded_step(early, early_opt, [data[step]]), first[step]))
        early_sched.step()
    habitual = _reload({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()})
    copies = []  # (model, optimizer, scheduler), each built as a user builds them, then loaded

    def fresh():
        m = model_()
        o = sharded(m)
        copies.append((m, o, torch.optim.lr_scheduler.LambdaLR(o, warmup)))
        return copies[-1]

    for mode in MODES:
        m, o, s = fresh()
        o.load_state_dict(_reload(opt.state_dict(mode)))
        s.load_state_dict(sched.state_dict())
    m, o, s = fresh()  # the usual resume: build model and optimizer, load both state dicts, train
    m.load_state_dict(habitual["model"])
    o.load_state_dict(habitual["optim"])
    s.load_state_dict(habitual["sched"])
    msd, osd = get_state_dict(model, opt)
    m, o, s = fresh()
    set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
    s.load_state_dict(sched.state_dict())
    out["refusals"] = [
        _raises(lambda: opt.optimizer.step()),
        _raises(lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})),
        _raises(lambda: opt.state[next(model.parameters())]),
    ]
    moved = model_()  # Hugging Face Trainer's model.to("cpu:0") copies every parameter out of the buckets
    moved_opt = sharded(moved)
    moved.to("cpu:0")
    accumulate(moved, [data[0]])
    out["moved"] = _raises(moved_opt.step)
    copies.append((model, opt, sched))
    for step in range(AT, STEPS):
        expected = ddp_step(plain, plain_opt, [data[step]], world, layout=opt.layout)
        for m, o, s in copies:
            out.setdefault("losses", []).append(torch.equal(sharded_step(m, o, [data[step]]), expected))
            s.step()
        plain_sched.step()
    ref = list(plain.parameters())
    out["params"] = [all(torch.equal(a, b) for a, b in zip(m.parameters(), ref)) for m, _, _ in copies]
    return out


def _sharded_clipping(rank: int, world: int) -> dict:
    data = batches(rank, AT)
    model = model_()
    opt = sharded(model)
    torch.optim.lr_scheduler.LambdaLR(opt, warmup)  # its first factor, as _plain()'s
    plain, plain_opt, _ = _plain()
    losses, norms = [], []
    for step in range(AT):
        opt.zero_grad()
        loss = accumulate(model, [data[step]])
        norm = opt.clip_grad_norm_(0.05)
        opt.step()
        ref_loss, ref_norm = _clip_reference_step(plain, plain_opt, data[step], world, opt.layout, 0.05)
        losses.append((loss - ref_loss).abs().item())
        norms.append((norm.item(), ref_norm.item()))
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
    unclipped = model_()  # clipping bites: without it the weights end elsewhere
    uopt = sharded(unclipped)
    torch.optim.lr_scheduler.LambdaLR(uopt, warmup)
    for step in range(AT):
        sharded_step(unclipped, uopt, [data[step]])
    bite = max((a - b).abs().max().item() for a, b in zip(model.parameters(), unclipped.parameters()))
    return {"losses": losses, "norms": norms, "param_diff": diff, "bite": bite}


def _weights_follow(rank: int, world: int) -> dict:
    """model.state_dict() with a deferred all-gather pending shows the current weights (it
    gathers first); model.load_state_dict() reaches the fp32 master shards the update reads."""
    data = batches(rank, 2)
    _, _, now, _ = _compiled()
    model, _, deferred, _ = _compiled(overlap_param_gather=True)
    for batch in data:
        now(batch)
        deferred(batch)
    current = model.state_dict()  # collective here: every rank gathers the others' ranges
    same = all(torch.equal(current[n], p) for n, p in now.model.named_parameters())
    torch.manual_seed(1)
    bf16 = model_().to(torch.bfloat16)
    opt = torch.optim.AdamW(bf16.parameters(), lr=1e-2, foreach=False)
    dm = gf.compile(
        bf16,
        opt,
        loss_of,
        (data[0][0].bfloat16(), data[0][1].bfloat16()),
        strategy=_strategy(master_dtype=torch.float32),
    )
    dm((data[0][0].bfloat16(), data[0][1].bfloat16()))
    bf16.load_state_dict(model_().to(torch.bfloat16).state_dict())  # other weights, copied in place
    masters = [(n, t) for n, t in dm.named_slices() if n.endswith(".master")]
    weights = dict(dm.named_slices())
    follow = all(torch.equal(t, weights[n.removesuffix(".master")].float()) for n, t in masters)
    return {"state_dict_gathers": same, "masters_follow": follow, "masters": len(masters)}


def _all(rank: int, world: int) -> dict:
    return {
        "weights": _weights_follow(rank, world),
        "compile": _compile_habits(rank, world),
        "compile_clip": _compile_clipping(rank, world),
        "sharded": _sharded_habits(rank, world),
        "sharded_clip": _sharded_clipping(rank, world),
    }


@pytest.fixture(scope="module", params=[1, 2, 3])
def results(request):
    return request.param, run_ranks(_all, request.param)


def _check_refusals(refusals: list[str], step_way: str) -> None:
    step, add, state = refusals
    assert step_way in step and "outside" in step
    assert "add_param_group" in add and "before" in add
    assert "optimizer.state_dict()" in state and "named_slices" in state


def test_gf_compile_users_optimizer_state_dict_torch_save_and_dcp_resume_bitwise(results):
    world, ranks = results
    for r in ranks:
        c = r["compile"]
        assert c["optimizer_state_dict_is_torchs"]
        assert c["losses"] and all(c["losses"]), c["losses"]
        assert all(c["params"]) and c["plain_resumed"] and c["lr"], c
        _check_refusals(c["refusals"], "dm(batch)")
        assert c["eval"]
        assert c["metrics"] == (STEPS, 6, None, None)


def test_shard_optimizer_state_dicts_torch_save_dcp_and_early_round_trip_resume_bitwise(results):
    world, ranks = results
    for r in ranks:
        s = r["sharded"]
        assert s["optimizer_state_dict_is_torchs"] and all(s["early_round_trip"])
        assert s["losses"] and all(s["losses"]), s["losses"]
        assert all(s["params"]), s["params"]
        _check_refusals(s["refusals"], "gf.shard_optimizer")
        assert s["eval"] and "0.weight no longer views its bucket" in s["moved"] and ".to()" in s["moved"]


@pytest.mark.parametrize("path", ["compile_clip", "sharded_clip"])
def test_global_grad_norm_is_readable_and_clips_as_torch_does(results, path):
    """Not bitwise: torch sums per-parameter norms, graphfuse the squares of flat shards."""
    world, ranks = results
    norms = [r[path]["norms"] for r in ranks]
    for r in ranks:
        c = r[path]
        assert max(c["losses"]) < 1e-6 and c["param_diff"] < 1e-6, c
        for got, ref, *logged in c["norms"]:
            assert abs(got - ref) <= 1e-5 * ref and ref > 0.05 * 2, (got, ref)  # the norm exceeds max_norm: it bites
            assert all(x == got for x in logged)
        if path == "sharded_clip":  # AdamW barely feels a scaled gradient, yet far more than the residual
            assert c["bite"] > 100 * max(c["param_diff"], 1e-8), c
    assert all(n == norms[0] for n in norms)  # every rank returns the same global norm


def test_model_state_dict_gathers_first_and_model_load_state_dict_reaches_the_master_shards(results):
    world, ranks = results
    for r in ranks:
        w = r["weights"]
        assert w["state_dict_gathers"] and w["masters_follow"] and w["masters"] > 0, w


def _state_dict_on_rank_0_only(rank: int, world: int) -> str:
    from graphfuse.checkpoint import torch_form as torch_state

    torch_state.TIMEOUT = 3.0
    model, opt, dm, _ = _compiled()
    dm(batches(rank, 1)[0])
    if rank != 0:
        return ""
    return _raises(opt.state_dict)  # the habit of DDP code: save the optimizer on rank 0 only


def test_optimizer_state_dict_called_on_rank_0_only_fails_loudly_instead_of_hanging():
    said = run_ranks(_state_dict_on_rank_0_only, 2)[0]
    assert "every rank must call it" in said and "rank 1" in said and "within 3 s" in said, said
