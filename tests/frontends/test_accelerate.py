"""A plain accelerate loop through graphfuse.integrations.accelerate.prepare, at 1 and 2 Gloo ranks,
against the same loop through accelerator.prepare (DDP): bitwise losses and weights, the global norm
of accelerator.clip_grad_norm_ and its clipping, save_state/load_state resumed bitwise (a model with
tied weights); and the DDP that accelerate's own prepare adds, refused under the graphfuse backend."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests._common import run_ranks

pytest.importorskip("accelerate", reason="the accelerate integration needs accelerate (the hf extra)")

STEPS, SAVE_AT = 4, 2
CLIP = 0.3  # below every step's gradient norm (about 2): it bites


class TiedLM(torch.nn.Module):
    """Embedding, a hidden layer and an LM head tied to the embedding (as GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _loop(
    graphfuse: bool,
    ckpt: str,
    optim: str = "adamw",
    max_norm: float = 1e6,
    save: bool = False,
    resume: bool = False,
    compile: bool = False,
) -> dict:
    """The usual accelerate loop for STEPS steps (from SAVE_AT when resuming from `ckpt`)."""
    from accelerate import Accelerator

    from graphfuse.integrations.accelerate import prepare

    torch.manual_seed(0)
    model = TiedLM()
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        if optim == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.5)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = torch.randint(0, 32, (64, 9), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
    accelerator = Accelerator(cpu=True)
    objects = (model, opt, loader, sched)
    model, opt, loader, sched = (
        prepare(accelerator, *objects, compile=compile) if graphfuse else accelerator.prepare(*objects)
    )
    start = SAVE_AT if resume else 0
    if resume:
        accelerator.load_state(ckpt)
        loader = accelerator.skip_first_batches(loader, start)
    losses, norms = [], []
    for step, (ids,) in zip(range(start, STEPS), loader):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if save and step + 1 == SAVE_AT:
            accelerator.save_state(ckpt)
    weights = {k: v.detach().numpy().copy() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    reduced = any(b for _, b in getattr(opt.optimizer, "backward_graphs", []))  # the backend reduce-scattered
    return {"losses": losses, "norms": norms, "weights": weights, "model": type(model).__name__, "reduced": reduced}


def _ddp_under_the_graphfuse_backend() -> str:
    """accelerate's own prepare of a graphfuse model: it wraps the model in DDP."""
    from accelerate import Accelerator

    import graphfuse as gf

    model = TiedLM()
    opt = gf.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    model.compile(backend="graphfuse")
    model, opt = Accelerator(cpu=True).prepare(model, opt)
    try:
        model(torch.zeros(2, 4, dtype=torch.long))
    except Exception as e:
        return f"{type(model).__name__}: {e}"
    return f"{type(model).__name__}: not refused"


def _ddp_habits(rank: int) -> dict:
    """DDP around a model given to graphfuse (the habit of torch's ZeroRedundancyOptimizer):
    gf.shard_optimizer refuses it; gf.compile traces the step, so DDP's hooks never run, and
    trains bitwise like the unwrapped model (its FQNs prefixed "module.", as DDP's state_dict)."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import graphfuse as gf

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    ddp = DistributedDataParallel(TiedLM())
    out = {"eager": "not refused"}
    try:
        gf.shard_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), model=ddp)
    except gf.UnsupportedError as e:
        out["eager"] = str(e)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    wrapped = DistributedDataParallel(copy.deepcopy(plain))
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(3, 4, generator=g) for _ in range(3)]
    a = gf.compile(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=0.1), loss, xs[0])
    b = gf.compile(plain, torch.optim.AdamW(plain.parameters(), lr=0.1), loss, xs[0])
    out["compiled_equal"] = all(torch.equal(a(x), b(x)) for x in xs) and all(
        torch.equal(p, q) for p, q in zip(wrapped.parameters(), plain.parameters())
    )
    out["compiled_fqns"] = list(a.program.layout.fqns)
    return out


def _rank(rank: int, world: int, tmp: str) -> dict:
    env = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world, OMP_NUM_THREADS=1)
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")
    ckpt = os.path.join(tmp, f"ckpt{world}")
    out = {
        "plain": _loop(False, ckpt),
        "gf": _loop(True, ckpt, save=True),
        "resumed": _loop(True, ckpt, resume=True),
        "plain_clip": _loop(False, ckpt, "sgd", CLIP),
        "gf_clip": _loop(True, ckpt, "sgd", CLIP),
        "gf_unclipped": _loop(True, ckpt, "sgd"),
    }
    out["compiled"] = _loop(True, ckpt, "sgd", CLIP, compile=True)  # the torch.compile path: no .grad
    from safetensors.torch import load_file

    out["saved_weights"] = sorted(load_file(os.path.join(ckpt, "model.safetensors")))
    out["ddp"] = _ddp_under_the_graphfuse_backend()
    out["ddp_habits"] = _ddp_habits(rank)
    return out


@pytest.fixture(scope="module", params=[1, 2])
def results(request, tmp_path_factory):
    return request.param, run_ranks(_rank, request.param, str(tmp_path_factory.mktemp("accelerate")))


def _diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def test_prepare_trains_bitwise_as_accelerate_with_ddp(results):
    world, ranks = results
    for r in ranks:
        assert r["gf"]["model"] == "TiedLM" and r["plain"]["model"] == "DistributedDataParallel"
        assert len(r["gf"]["losses"]) == STEPS and r["gf"]["losses"] == r["plain"]["losses"]
        assert _diff(r["gf"]["weights"], r["plain"]["weights"]) == 0.0


def test_clip_grad_norm_returns_the_global_norm_and_clips_as_accelerate_does(results):
    """Not bitwise: torch sums per-parameter norms, graphfuse the squares of flat shards."""
    world, ranks = results
    for r in ranks:
        for case in ("gf", "gf_clip"):
            ref = r[case.replace("gf", "plain")]["norms"]
            assert all(abs(g - p) <= 1e-5 * p for g, p in zip(r[case]["norms"], ref)) and len(ref) == STEPS
        assert all(n > 2 * CLIP for n in r["plain_clip"]["norms"])
        residual = _diff(r["gf_clip"]["weights"], r["plain_clip"]["weights"])
        bite = _diff(r["gf_clip"]["weights"], r["gf_unclipped"]["weights"])
        assert residual < 1e-6 and bite > 1000 * max(residual, 1e-8), (residual, bite)


def test_compiled_model_clips_by_the_global_norm_as_accelerate_does(results):
    world, ranks = results
    for r in ranks:
        mine, plain = r["compiled"], r["plain_clip"]
        assert mine["reduced"] and mine["model"] == "TiedLM"
        assert (
            all(abs(g - p) <= 1e-5 * p for g, p in zip(mine["norms"], plain["norms"])) and len(mine["norms"]) == STEPS
        )
        assert _diff(mine["weights"], plain["weights"]) < 1e-6


def test_save_state_and_load_state_resume_bitwise(results):
    world, ranks = results
    for r in ranks:
        assert r["saved_weights"] == ["emb.weight", "mid.bias", "mid.weight"]  # head.weight: tied, as for any model
        assert r["resumed"]["losses"] == r["gf"]["losses"][SAVE_AT:]
        assert _diff(r["resumed"]["weights"], r["gf"]["weights"]) == 0.0


def test_ddp_around_a_model_is_refused_where_it_would_reduce_twice_and_traced_through_by_gf_compile(results):
    world, ranks = results
    for r in ranks:
        assert r["ddp"].startswith("DistributedDataParallel: ") and "DistributedDataParallel" in r["ddp"][24:]
        assert "graphfuse.integrations.accelerate.prepare" in r["ddp"], r["ddp"]
        # and around an eager model, where DDP's backward would all-reduce what graphfuse reduce-scatters again
        eager = r["ddp_habits"]["eager"]
        assert eager.startswith("gf.shard_optimizer(model=DistributedDataParallel(...)): DDP would"), eager
        assert "pass the module DDP wraps (ddp.module)" in eager, eager
        # gf.compile traces the step through DDP's forward: one reduction (graphfuse's), bitwise
        assert r["ddp_habits"]["compiled_equal"], r["ddp_habits"]
        assert sorted(r["ddp_habits"]["compiled_fqns"]) == [
            f"module.{i}.{w}" for i in (0, 2) for w in ("bias", "weight")
        ]
