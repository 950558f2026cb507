"""Every elementwise torch.optim optimizer compiled by graphfuse is bitwise equal to its
foreach=False form (two param groups, a frozen layer, a warm-up LR schedule); optimizers
whose update is not elementwise are refused by name. 2-rank runs are in test_zoo.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import graphfuse as gf
from tests.capture.test_capture import MLP, freeze_first_layer, mlp_batches, mlp_loss, run_bitwise, two_groups

STEPS = 8  # RAdam's rectification starts at step 6 with beta2=0.999: both branches are run


def _groups(model: nn.Module, decay: float, **second) -> list[dict]:
    """two_groups, the second with hyper-parameters of its own (`second`)."""
    groups = two_groups(model, decay=decay)
    groups[1].update(second)
    return groups


OPTIMIZERS = {
    "rmsprop": lambda m: torch.optim.RMSprop(_groups(m, 1e-2), lr=1e-2, foreach=False),
    "rmsprop_centered_momentum": lambda m: torch.optim.RMSprop(
        _groups(m, 1e-2, momentum=0.0), lr=1e-2, alpha=0.9, momentum=0.8, centered=True, foreach=False
    ),
    "rmsprop_maximize": lambda m: torch.optim.RMSprop(
        _groups(m, 0.0), lr=1e-3, momentum=0.5, maximize=True, foreach=False
    ),
    "adagrad": lambda m: torch.optim.Adagrad(_groups(m, 1e-2, lr_decay=0.0), lr=5e-2, lr_decay=0.01, foreach=False),
    "adamax": lambda m: torch.optim.Adamax(_groups(m, 1e-2, betas=(0.8, 0.99)), lr=1e-2, foreach=False),
    "nadam": lambda m: torch.optim.NAdam(_groups(m, 1e-2, momentum_decay=2e-3), lr=1e-2, foreach=False),
    "nadam_decoupled": lambda m: torch.optim.NAdam(
        _groups(m, 0.1), lr=1e-2, decoupled_weight_decay=True, foreach=False
    ),
    "radam": lambda m: torch.optim.RAdam(_groups(m, 1e-2), lr=1e-2, foreach=False),
    "radam_decoupled": lambda m: torch.optim.RAdam(
        _groups(m, 0.1), lr=1e-2, decoupled_weight_decay=True, foreach=False
    ),
    "adadelta": lambda m: torch.optim.Adadelta(_groups(m, 1e-2, rho=0.8), lr=0.5, foreach=False),
    "adamw": lambda m: torch.optim.AdamW(_groups(m, 0.1, betas=(0.8, 0.9)), lr=1e-2, foreach=False),
    "adam_amsgrad": lambda m: torch.optim.Adam(_groups(m, 1e-2), lr=1e-2, amsgrad=True, foreach=False),
    "sgd_nesterov": lambda m: torch.optim.SGD(_groups(m, 1e-3), lr=5e-2, momentum=0.9, nesterov=True, foreach=False),
    "rprop": lambda m: torch.optim.Rprop(
        _groups(m, 0.0, etas=(0.3, 1.5), step_sizes=(1e-4, 2e-3)), lr=1e-2, foreach=False
    ),
    "rprop_maximize": lambda m: torch.optim.Rprop(_groups(m, 0.0), lr=1e-3, maximize=True, foreach=False),
    # t0=2 starts the averaging at step 4 in the first group; the second never averages.
    "asgd": lambda m: torch.optim.ASGD(_groups(m, 1e-2, t0=1e6), lr=5e-2, lambd=1e-2, t0=2.0, foreach=False),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_is_bitwise_equal_to_its_single_tensor_form(name):
    dm = run_bitwise(MLP, OPTIMIZERS[name], mlp_loss, mlp_batches(STEPS), freeze=freeze_first_layer)
    assert dm.program.optim.cls_name == type(OPTIMIZERS[name](MLP())).__name__
    assert dm.steps == [STEPS, STEPS]


def _decaying(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """An lr that changes at every step (the warm-up schedule stops changing at step 5)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.7**s)


def _same_asgd_scalars(o_eager: torch.optim.Optimizer, dm: gf.DistModel, when: str) -> bool:
    """torch's eta and mu of every parameter equal what graphfuse carries and derives for the
    next step (what its checkpoints write); True when some group averages already (mu != 1)."""
    from graphfuse.optim import torch_host_states

    averaging = False
    for g, (spec, group) in enumerate(zip(dm.program.optim.groups, dm.optimizer.param_groups, strict=True)):
        host = torch_host_states(spec, dm.steps[g], dm.carried[g], group["lr"])
        for p in o_eager.param_groups[g]["params"]:
            state = o_eager.state[p]
            assert torch.equal(state["eta"], host["eta"]) and torch.equal(state["mu"], host["mu"]), f"{when}, group {g}"
            averaging |= state["mu"].item() != 1
    return averaging


@pytest.mark.parametrize("mode", ["balanced", "unbalanced"])
def test_asgd_with_an_lr_changed_every_step_is_bitwise_and_resumes_bitwise(mode, tmp_path):
    """ASGD's eta of step k follows the lr of step k - 1, which graphfuse carries from step to
    step as torch does: with a LambdaLR changing the lr at every step (two groups, one averaging
    from step 4), parameters, `ax`, eta and mu equal torch's after every step; saved after
    step 4 and loaded into a freshly compiled model, training goes on bitwise."""
    from tests.capture.test_capture import assert_same_state

    torch.manual_seed(0)
    m_eager = MLP()
    freeze_first_layer(m_eager)
    o_eager = OPTIMIZERS["asgd"](m_eager)
    s_eager = _decaying(o_eager)
    batches = mlp_batches(STEPS)

    def compiled(model: nn.Module) -> tuple[gf.DistModel, torch.optim.lr_scheduler.LRScheduler]:
        freeze_first_layer(model)
        optimizer = OPTIMIZERS["asgd"](model)
        return gf.compile(model, optimizer, mlp_loss, batches[0]), _decaying(optimizer)

    m_gf = copy.deepcopy(m_eager)
    dm, s_gf = compiled(m_gf)
    lrs, averaged = set(), False
    for i, batch in enumerate(batches):
        if i == 4:
            gf.save(dm, tmp_path / "ckpt", mode=mode, extra={"scheduler": s_gf.state_dict()})
            torch.manual_seed(1)
            m_gf = MLP()  # other weights: everything comes from the checkpoint
            dm, s_gf = compiled(m_gf)
            s_gf.load_state_dict(gf.load(dm, tmp_path / "ckpt")["scheduler"])
        o_eager.zero_grad()
        loss = mlp_loss(m_eager, batch)
        loss.backward()
        o_eager.step()
        s_eager.step()
        assert torch.equal(loss.detach(), dm(batch)), f"step {i}: loss differs"
        s_gf.step()
        assert_same_state(m_eager, o_eager, m_gf, dm, f"step {i}")
        averaged |= _same_asgd_scalars(o_eager, dm, f"step {i}")
        lrs.add(o_eager.param_groups[1]["lr"])
    assert averaged and dm.steps == [STEPS, STEPS] and len(lrs) == STEPS


def test_every_elementwise_optimizer_of_torch_is_covered():
    """A torch.optim class that is neither compiled nor refused by name would be a gap."""
    from graphfuse.optim import CLASSES, NOT_ELEMENTWISE
    from tests.optim.test_adafactor import TESTED
    from tests.optim.test_muon import MATRIX_OPTIMIZERS

    tested = {type(make(MLP())).__name__ for make in OPTIMIZERS.values()} | set(MATRIX_OPTIMIZERS) | set(TESTED)
    assert tested == set(CLASSES)
    classes = {
        name
        for name in dir(torch.optim)
        if isinstance(getattr(torch.optim, name), type)
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
    }
    unknown = classes - set(CLASSES) - set(NOT_ELEMENTWISE) - {"Optimizer"}
    assert not unknown, f"torch.optim classes graphfuse neither compiles nor refuses with a reason: {unknown}"


class Muon(torch.optim.Optimizer):
    """A matrix optimizer of the kind users bring (a user class named like torch's, whose update
    graphfuse cannot know: refused, while torch.optim.Muon is compiled)."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})


def _refused(name: str):
    m = MLP()
    return {
        "LBFGS": lambda: torch.optim.LBFGS(m.parameters()),
        "SparseAdam": lambda: torch.optim.SparseAdam(list(m.parameters())),
        "Muon": lambda: Muon(m.parameters()),
    }[name](), m


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("LBFGS", "closure"),
        ("SparseAdam", "sparse"),
        ("Muon", "exact classes, not subclasses"),
    ],
)
def test_optimizer_that_is_not_elementwise_is_refused_by_name(name, why):
    optimizer, model = _refused(name)
    with pytest.raises(gf.UnsupportedError, match=rf"optimizer \S*{name} is not supported") as info:
        gf.compile(model, optimizer, mlp_loss, mlp_batches(1)[0])
    assert why in str(info.value)
    assert "cross parameter boundaries" in str(info.value)


def test_adagrad_with_an_initial_accumulator_is_refused():
    model = MLP()
    optimizer = torch.optim.Adagrad(model.parameters(), initial_accumulator_value=0.1)
    with pytest.raises(gf.UnsupportedError, match="initial_accumulator_value=0"):
        gf.compile(model, optimizer, mlp_loss, mlp_batches(1)[0])


def test_changing_a_baked_rmsprop_option_is_refused():
    model = MLP()
    optimizer = OPTIMIZERS["rmsprop"](model)
    dm = gf.compile(model, optimizer, mlp_loss, mlp_batches(1)[0])
    optimizer.param_groups[0]["alpha"] = 0.5
    with pytest.raises(gf.UnsupportedError, match="param group 0: alpha changed from 0.99 to 0.5"):
        dm(mlp_batches(1)[0])


DP_OPTIMIZERS = ("nadam_decoupled", "rmsprop_centered_momentum", "radam", "rprop", "asgd")


def _data_parallel(rank: int, world: int, names: tuple[str, ...]) -> dict:
    """Each optimizer on an MLP trained by graphfuse (small buckets, so shards cross parameter
    boundaries) and by an eager replica averaging gradients with all_reduce(AVG)."""

    out = {}
    for name in names:
        torch.manual_seed(0)
        m_ref = MLP()
        m_gf = copy.deepcopy(m_ref)
        o_ref = OPTIMIZERS[name](m_ref)
        batches = mlp_batches(STEPS, seed=10 + rank)
        dm = gf.compile(m_gf, OPTIMIZERS[name](m_gf), mlp_loss, batches[0], strategy=gf.Strategy(bucket_size_mb=0.002))
        equal = len(dm.layout.buckets) > 1
        for batch in batches:
            loss = _eager_data_parallel_step(m_ref, o_ref, batch)
            equal &= torch.equal(loss, dm(batch))
        ref = dict(m_ref.named_parameters())
        out[name] = equal and all(torch.equal(p, ref[n]) for n, p in m_gf.named_parameters())
    return out


def _eager_data_parallel_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    """One step of the eager data-parallel reference: gradients averaged with all_reduce(AVG)."""
    import torch.distributed as dist

    optimizer.zero_grad()
    loss = mlp_loss(model, batch)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    optimizer.step()
    return loss.detach()


def _asgd_data_parallel(rank: int, root: str) -> bool:
    """ASGD with an lr changed at every step, graphfuse against an eager replica averaging
    gradients with all_reduce(AVG); runs resumed after step 3 from a balanced and from an
    unbalanced checkpoint go on beside the unbroken one, all bitwise."""

    torch.manual_seed(0)
    m_ref = MLP()
    o_ref = OPTIMIZERS["asgd"](m_ref)
    s_ref = _decaying(o_ref)
    batches = mlp_batches(STEPS, seed=10 + rank)

    def compiled(model: nn.Module) -> tuple[nn.Module, gf.DistModel, torch.optim.lr_scheduler.LRScheduler]:
        optimizer = OPTIMIZERS["asgd"](model)
        dm = gf.compile(model, optimizer, mlp_loss, batches[0], strategy=gf.Strategy(bucket_size_mb=0.002))
        return model, dm, _decaying(optimizer)

    runs = {"unbroken": compiled(copy.deepcopy(m_ref))}
    equal = len(runs["unbroken"][1].layout.buckets) > 1
    for i, batch in enumerate(batches):
        if i == 3:
            for mode in ("balanced", "unbalanced"):
                _, dm, sched = runs["unbroken"]
                gf.save(dm, f"{root}/{mode}", mode=mode, extra={"scheduler": sched.state_dict()})
                torch.manual_seed(1)
                runs[mode] = compiled(MLP())
                runs[mode][2].load_state_dict(gf.load(runs[mode][1], f"{root}/{mode}")["scheduler"])
        loss = _eager_data_parallel_step(m_ref, o_ref, batch)
        s_ref.step()
        for _, dm, sched in runs.values():
            equal &= torch.equal(loss, dm(batch))
            sched.step()
    ref = dict(m_ref.named_parameters())
    return (
        equal
        and len(runs) == 3
        and all(torch.equal(p, ref[n]) for m, _, _ in runs.values() for n, p in m.named_parameters())
    )


def _two_ranks(rank: int, world: int, names: tuple[str, ...], root: str) -> dict:
    """Both 2-rank checks in one spawn of the ranks (a spawn costs seconds)."""
    return _data_parallel(rank, world, names) | {"asgd_lr_changed_resumed": _asgd_data_parallel(rank, root)}


def test_optimizers_at_two_ranks_are_bitwise_like_eager_data_parallel(tmp_path):
    from tests._common import run_ranks

    results = run_ranks(_two_ranks, 2, DP_OPTIMIZERS, str(tmp_path), timeout=180)
    assert results == [dict.fromkeys(DP_OPTIMIZERS, True) | {"asgd_lr_changed_resumed": True}] * 2, results


def test_every_optimizer_update_can_be_saved_in_a_program_file(tmp_path):
    """Each update's ops are in the program files' op allowlist, and its description (kind
    and hyper-parameters) reads back as it was written."""
    from graphfuse.program_files.ops import target_name

    for name, make in OPTIMIZERS.items():
        model = MLP()
        program = gf.capture(model, make(model), mlp_loss, mlp_batches(1)[0])
        missing = {
            str(n.target) for n in program.graph.nodes if n.op == "call_function" and target_name(n.target) is None
        }
        assert not missing, f"{name}: ops outside the allowlist: {missing}"
        gf.save_program(program, tmp_path / name)
        assert gf.load_program(tmp_path / name).optim == program.optim, name


def test_asgd_program_saved_with_its_lr_baked_in_loads_and_follows_the_lr(tmp_path):
    """A program file written while graphfuse baked ASGD's lr into the program (every group
    held an `lr` field) still loads; the lr is read at every step, so a scheduler drives it."""
    import json

    from tests.program_files.test_program_io import rehash

    torch.manual_seed(0)
    m_eager = MLP()
    m_gf = copy.deepcopy(m_eager)
    o_eager, o_gf = OPTIMIZERS["asgd"](m_eager), OPTIMIZERS["asgd"](m_gf)
    batches = mlp_batches(4)
    traced = copy.deepcopy(m_gf)
    gf.save_program(gf.compile(traced, OPTIMIZERS["asgd"](traced), mlp_loss, batches[0]).program, tmp_path / "p")
    doc = json.loads((tmp_path / "p" / "program.json").read_text())
    for group, lr in zip(doc["optim"]["groups"], (5e-2, 3e-3), strict=True):
        assert "lr" not in group
        group["lr"] = lr
    (tmp_path / "p" / "program.json").write_text(json.dumps(doc))
    rehash(tmp_path / "p")
    dm = gf.DistModel.from_program(gf.load_program(tmp_path / "p"), m_gf, o_gf)
    s_eager, s_gf = _decaying(o_eager), _decaying(o_gf)
    for batch in batches:
        o_eager.zero_grad()
        loss = mlp_loss(m_eager, batch)
        loss.backward()
        o_eager.step()
        s_eager.step()
        assert torch.equal(loss.detach(), dm(batch))
        s_gf.step()
    assert all(torch.equal(a, b) for a, b in zip(m_eager.parameters(), m_gf.parameters(), strict=True))


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("nadam", "balanced"),
        ("adagrad", "unbalanced"),
        ("radam", "balanced"),
        ("rprop", "unbalanced"),
        ("asgd", "balanced"),
    ],
)
def test_training_resumed_from_a_checkpoint_continues_bitwise(name, mode, tmp_path):
    """The host-computed per-step values (NAdam's mu_product, Adagrad's decayed lr, RAdam's
    rectification) come back from the saved step count: a resumed run equals an unbroken one."""
    batches = mlp_batches(6)

    def compiled():
        torch.manual_seed(0)
        model = MLP()
        return model, gf.compile(model, OPTIMIZERS[name](model), mlp_loss, batches[0])

    model_a, dm_a = compiled()
    for batch in batches[:3]:
        dm_a(batch)
    gf.save(dm_a, tmp_path / "ckpt", mode=mode)
    model_b, dm_b = compiled()
    gf.load(dm_b, tmp_path / "ckpt")
    assert dm_b.steps == dm_a.steps == [3, 3]
    for batch in batches[3:]:
        assert torch.equal(dm_a(batch), dm_b(batch))
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True))


@pytest.mark.parametrize("name", ["nadam", "asgd"])
def test_plain_torch_optimizer_resumes_from_a_balanced_checkpoint_bitwise(name, tmp_path):
    """A balanced checkpoint holds the 0-d states graphfuse computes on the host (NAdam's
    mu_product, ASGD's eta and mu): loaded through DCP into a plain model and its
    foreach=False optimizer, the next step equals graphfuse's, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    batches = mlp_batches(6)
    torch.manual_seed(0)
    model = MLP()
    dm = gf.compile(model, OPTIMIZERS[name](model), mlp_loss, batches[0])
    for batch in batches[:5]:  # ASGD averages from step 4 on
        dm(batch)
    gf.save(dm, str(tmp_path / "ckpt"), mode="balanced")

    plain = MLP()
    optimizer = OPTIMIZERS[name](plain)
    mlp_loss(plain, batches[0]).backward()
    optimizer.step()  # so the optimizer has state tensors for DCP to fill
    optimizer.zero_grad()
    msd, osd = get_state_dict(plain, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(plain, optimizer, model_state_dict=msd, optim_state_dict=osd)
    host = {"nadam": {"mu_product"}, "asgd": {"eta", "mu"}}[name]
    assert all(host <= set(state) and state["step"].item() == 5 for state in optimizer.state.values())

    loss = mlp_loss(plain, batches[5])
    loss.backward()
    optimizer.step()
    assert torch.equal(loss.detach(), dm(batches[5]))
    ours = dict(model.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in plain.named_parameters())


def _index_form(full: dict) -> dict:
    """A torch form (keyed by FQN) as a plain torch optimizer's state_dict() (keyed by index)."""
    index = {fqn: i for i, fqn in enumerate(f for g in full["param_groups"] for f in g["params"])}
    return {
        "state": {index[fqn]: state for fqn, state in full["state"].items()},
        "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in full["param_groups"]],
    }


@pytest.mark.parametrize("name", ["nadam", "asgd"])
def test_torch_form_of_the_sharded_state_resumes_plain_torch_optim_bitwise(name):
    """gf.shard_optimizer's state_dict(mode="torch") holds the 0-d states graphfuse computes on
    the host (NAdam's mu_product, ASGD's eta and mu): a plain foreach=False optimizer loading
    it, after 5 steps at an lr changed every step, goes on as graphfuse does, bit for bit."""
    batches = mlp_batches(8)
    torch.manual_seed(0)
    model = MLP()
    opt = gf.shard_optimizer(OPTIMIZERS[name](model), model=model)
    sched = _decaying(opt)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
        optimizer.zero_grad()
        loss = mlp_loss(model, batch)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for batch in batches[:5]:  # ASGD averages from step 4 on
        step(model, opt, batch)
        sched.step()
    plain = MLP()
    plain.load_state_dict(model.state_dict())
    plain_opt = OPTIMIZERS[name](plain)
    plain_sched = _decaying(plain_opt)  # before the load, which sets the lr the schedule reached
    plain_opt.load_state_dict(_index_form(opt.state_dict(mode="torch")))
    plain_sched.load_state_dict(sched.state_dict())
    host = {"nadam": {"mu_product"}, "asgd": {"eta", "mu"}}[name]
    assert all(host <= set(state) and state["step"].item() == 5 for state in plain_opt.state.values())
    for batch in batches[5:]:
        assert torch.equal(step(model, opt, batch), step(plain, plain_opt, batch))
        sched.step()
        plain_sched.step()
    ours = dict(model.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in plain.named_parameters())
    again = _index_form(opt.state_dict(mode="torch"))["state"]
    params = [p for group in plain_opt.param_groups for p in group["params"]]
    assert all(torch.equal(v, again[i][k]) for i, p in enumerate(params) for k, v in plain_opt.state[p].items())
