"""GraphfuseTrainer (graphfuse.integrations.transformers) against Hugging Face's own Trainer (DDP at 2
ranks) on a tiny GPT-2 at 1 and 2 Gloo ranks: bitwise losses and weights with gradient accumulation,
the logged grad_norm, max_grad_norm clipping, the compile path, resume_from_checkpoint at 2 ranks, from
2 ranks to 1 and from a plain Trainer's checkpoint, and the README's Trainer example run as written."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

import graphfuse as gf
from tests._common import ROOT, run_ranks

pytest.importorskip("transformers", reason="the Trainer integration needs transformers (the hf extra)")
pytest.importorskip("accelerate", reason="the Trainer integration needs accelerate (the hf extra)")

README = ROOT / "README.md"
STEPS, SAVE_AT, ACCUM = 4, 2, 2  # 4 steps of 2 micro-batches: one epoch of the 32 samples at 2 ranks of 2
CLIP = 0.2  # below every step's gradient norm (about 0.6): it bites


def _env(rank: int, world: int) -> None:
    """What torchrun sets, read by TrainingArguments and accelerate (run_ranks made the group)."""
    env = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world, OMP_NUM_THREADS=1)
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


class TinyLM(torch.nn.Module):
    """A Trainer-ready model of one graph for dynamo (GPT-2's several graphs take inductor a minute
    to compile on 2 cores with a cold cache): embedding, a hidden layer, an LM head; the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(torch.tanh(self.mid(self.emb(input_ids))))
        return {"loss": torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())}


def _data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (t := torch.randint(0, 64, (8,), generator=g)), "labels": t.clone()} for _ in range(32)]


def _snapshot(trainer) -> dict:
    """The weights and the optimizer's state in torch.optim's form (gathered: every rank calls it)."""
    opt = getattr(trainer, "sharded_optimizer", None) or trainer.optimizer
    state = opt.state_dict()["state"]
    return {
        "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optim": {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()},
    }


def _train(
    kind: str, out: str, world: int, resume: str | None = None, optim: str = "adamw_torch", model=_model, opt=None, **kw
) -> dict:
    """Train STEPS steps with Trainer ("plain") or GraphfuseTrainer (given `opt(model)` as its optimizer, if
    any); the logged losses and grad norms, the final weights, and snapshots where training began (after a
    resume's load) and at each save."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from graphfuse.integrations.transformers import GraphfuseTrainer

    snaps = {}

    class Snapshots(TrainerCallback):
        def on_train_begin(self, args, state, control, **_):
            snaps["begin"] = _snapshot(trainer) if resume else None

        def on_save(self, args, state, control, **_):
            snaps[state.global_step] = _snapshot(trainer)

    args = dict(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=4 // world,
        gradient_accumulation_steps=ACCUM,
        logging_steps=1,
        save_strategy="no",
        optim=optim,
        seed=0,
        learning_rate=0.1 if optim == "sgd" else 1e-2,
        max_grad_norm=0.0,
        disable_tqdm=True,
        log_level="error",
    )
    cls = Trainer if kind == "plain" else GraphfuseTrainer
    net, args = model(), TrainingArguments(**{**args, **kw})
    optimizers = (opt(net), None) if opt else (None, None)
    trainer = cls(model=net, args=args, train_dataset=_data(), callbacks=[Snapshots()], optimizers=optimizers)
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h and h["step"] > (SAVE_AT if resume else 0)]
    sharded = getattr(trainer, "sharded_optimizer", None)
    return _host(
        {
            "losses": [h["loss"] for h in logs],
            "norms": [h["grad_norm"] for h in logs],
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "wrapped": type(trainer.model_wrapped).__name__,
            "reduced_in_backward": sharded is not None and any(b for _, b in sharded.backward_graphs),
            "snapshots": snaps,
        }
    )


def _users_sharded_adamw(model) -> gf.ShardedOptimizer:
    """Trainer's AdamW (optim="adamw_torch", weight_decay=0) in one group, sharded before Trainer moves the model."""
    return gf.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0), model=model)


def _two_ranks(rank: int, world: int, tmp: str) -> dict:
    _env(rank, world)
    out = {
        "plain": _train("plain", f"{tmp}/plain", world),
        "gf": _train("gf", f"{tmp}/gf", world, save_strategy="steps", save_steps=SAVE_AT),
        "resumed": _train("gf", f"{tmp}/resumed", world, resume=f"{tmp}/gf/checkpoint-{SAVE_AT}"),
        "users_sharded": _train("gf", f"{tmp}/users", world, opt=_users_sharded_adamw),
        "plain_clip": _train("plain", f"{tmp}/plain_clip", world, optim="sgd", max_grad_norm=CLIP),
        "gf_clip": _train("gf", f"{tmp}/gf_clip", world, optim="sgd", max_grad_norm=CLIP),
        "gf_unclipped": _train("gf", f"{tmp}/gf_unclipped", world, optim="sgd"),
        "tiny": _train("plain", f"{tmp}/tiny", world, optim="sgd", max_grad_norm=CLIP, model=TinyLM),
        "compiled": _train(
            "gf",
            f"{tmp}/compiled",
            world,
            optim="sgd",
            max_grad_norm=CLIP,
            model=TinyLM,
            torch_compile_backend="graphfuse",
        ),
    }
    out["files"] = sorted(os.listdir(f"{tmp}/gf/checkpoint-{SAVE_AT}"))
    return out


def _one_rank(rank: int, world: int, tmp: str) -> dict:
    _env(rank, world)
    out = {
        "plain": _train("plain", f"{tmp}/plain1", world, save_strategy="steps", save_steps=SAVE_AT),
        "gf": _train("gf", f"{tmp}/gf1", world),
        "from_plain": _train("gf", f"{tmp}/from_plain", world, resume=f"{tmp}/plain1/checkpoint-{SAVE_AT}"),
        "from_2_ranks": _train("gf", f"{tmp}/from2", world, resume=f"{tmp}/gf/checkpoint-{SAVE_AT}"),
    }
    os.chdir(tmp)  # the README's relative output_dir
    names: dict = {}
    exec(readme_trainer_example(), names)
    out["readme"] = {"steps": names["trainer"].state.global_step, "files": sorted(os.listdir("run/checkpoint-8"))}
    return out


def readme_trainer_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if "GraphfuseTrainer(" in b]
    return block


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="module")
def two(tmp) -> list[dict]:
    return run_ranks(_two_ranks, 2, tmp)


@pytest.fixture(scope="module")
def one(two, tmp) -> dict:  # after `two`: it resumes from its checkpoint
    return run_ranks(_one_rank, 1, tmp)[0]


def _host(obj):
    """`obj` with tensors as numpy arrays: a tensor returned from a rank travels as a handle to the
    rank's shared memory, gone when the rank exits."""
    if isinstance(obj, dict):
        return {k: _host(v) for k, v in obj.items()}
    return obj.detach().numpy().copy() if isinstance(obj, torch.Tensor) else obj


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _close_norms(got: list[float], ref: list[float]) -> bool:
    return len(got) == len(ref) == STEPS and all(abs(g - r) <= 1e-5 * r for g, r in zip(got, ref))


def test_graphfuse_trainer_trains_bitwise_as_trainer_with_ddp_at_2_ranks(two):
    for r in two:
        plain = r["plain"]
        assert plain["wrapped"] == "DistributedDataParallel"
        for mine in (r["gf"], r["users_sharded"]):  # Trainer's optimizer sharded, and the user's
            assert mine["wrapped"] == "GPT2LMHeadModel"  # no DDP
            assert len(mine["losses"]) == STEPS and mine["losses"] == plain["losses"]
            assert _same(mine["weights"], plain["weights"])
            assert _close_norms(mine["norms"], plain["norms"]), (mine["norms"], plain["norms"])
    assert _same(two[0]["gf"]["weights"], two[1]["gf"]["weights"])


def test_graphfuse_trainer_trains_bitwise_as_trainer_at_1_rank(one):
    assert one["gf"]["losses"] == one["plain"]["losses"] and _same(one["gf"]["weights"], one["plain"]["weights"])
    assert _close_norms(one["gf"]["norms"], one["plain"]["norms"])


def test_max_grad_norm_clips_as_trainer_does(two):
    """Not bitwise: torch sums per-parameter norms, graphfuse the squares of flat shards."""
    for r in two:
        plain, mine = r["plain_clip"], r["gf_clip"]
        assert all(n > 1.5 * CLIP for n in plain["norms"]) and _close_norms(mine["norms"], plain["norms"])
        residual, bite = _diff(mine["weights"], plain["weights"]), _diff(mine["weights"], r["gf_unclipped"]["weights"])
        assert residual < 1e-6 and bite > 1000 * max(residual, 1e-8), (residual, bite)


def test_compiled_trainer_reduces_in_the_backward_and_trains_as_trainer(two):
    for r in two:
        plain, mine = r["tiny"], r["compiled"]
        assert (
            mine["reduced_in_backward"]
            and mine["wrapped"] == "TinyLM"
            and plain["wrapped"] == "DistributedDataParallel"
        )
        assert _close_norms(mine["norms"], plain["norms"])
        assert max(abs(a - b) for a, b in zip(mine["losses"], plain["losses"])) < 1e-5
        assert _diff(mine["weights"], plain["weights"]) < 1e-6


def test_resume_from_checkpoint_at_2_ranks_is_bitwise(two):
    assert {"graphfuse", "scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(
        two[0]["files"]
    )
    for r in two:
        assert r["resumed"]["losses"] == r["gf"]["losses"][SAVE_AT:]
        assert _same(r["resumed"]["weights"], r["gf"]["weights"])
        saved, begun = r["gf"]["snapshots"][SAVE_AT], r["resumed"]["snapshots"]["begin"]
        assert _same(begun["weights"], saved["weights"])


def test_resume_from_2_ranks_at_1_rank_loads_the_state_bitwise_and_trains_on(one, two):
    """The state loads bitwise; training on at 1 rank (the same global batches) sums in another
    order than 2 ranks did, so it is compared with a tolerance (AdamW's first steps, nearly sign
    steps, turn last-bit gradient differences into 2e-6 in the weights)."""
    saved, resumed, uninterrupted = two[0]["gf"]["snapshots"][SAVE_AT], one["from_2_ranks"], two[0]["gf"]
    begun = resumed["snapshots"]["begin"]
    assert _same(begun["weights"], saved["weights"])
    assert begun["optim"].keys() == saved["optim"].keys() and all(
        _same(begun["optim"][i], s) for i, s in saved["optim"].items()
    )
    assert max(abs(a - b) for a, b in zip(resumed["losses"], uninterrupted["losses"][SAVE_AT:])) < 1e-5
    assert len(resumed["losses"]) == STEPS - SAVE_AT and _diff(resumed["weights"], uninterrupted["weights"]) < 1e-5


def test_resume_from_a_plain_trainers_checkpoint_is_bitwise(one):
    assert one["from_plain"]["losses"] == one["plain"]["losses"][SAVE_AT:]
    assert _same(one["from_plain"]["weights"], one["plain"]["weights"])


def test_the_readme_trainer_example_runs_as_written(one):
    assert one["readme"]["steps"] == 8 and "graphfuse" in one["readme"]["files"]


def test_shard_optimizer_refuses_world_size_1_when_torchrun_says_otherwise(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(gf.UnsupportedError, match="WORLD_SIZE=2 .* no process group is initialised"):
        gf.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    with pytest.raises(gf.UnsupportedError, match="WORLD_SIZE=2"):
        gf.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(), torch.ones(1, 2))
