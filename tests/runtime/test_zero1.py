"""ZeRO-1 training on real Gloo groups of 1 to 3 ranks against an eager data-parallel
reference (replicated model, all_reduce(AVG) of gradients, torch.optim with foreach=False).

One spawned group per world size runs every scenario (spawning costs seconds); each test
below reads that group's measurements and asserts on them.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss
from tests._common import run_ranks

STEPS = 20
GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
# Small buckets (MB), so that every model has several and parameters straddle ranks.
BUCKET_MB = {"mlp": 0.004, "gpt": 0.032}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 31)
        self.fc2 = nn.Linear(31, 17)
        self.fc3 = nn.Linear(17, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def mlp_batches(rank: int, dtype: torch.dtype) -> list:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(8, 13, generator=g).to(dtype), torch.randn(8, 5, generator=g)) for _ in range(STEPS)]


def gpt_batches(rank: int) -> list:
    g = torch.Generator().manual_seed(2000 + rank)
    out = []
    for _ in range(STEPS):
        seq = torch.randint(0, GPT_CFG.vocab_size, (4, GPT_CFG.block_size + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    return torch.optim.SGD(params, lr=5e-2, momentum=0.9, weight_decay=1e-3, foreach=False)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def eager_step(model, masters, optimizer, loss_fn, batch, accumulation: int, max_grad_norm, layout=None):
    """One data-parallel step: gradients averaged with all_reduce(AVG) per parameter (or, with
    `layout`, one all_reduce per flat bucket, as graphfuse lays them out), in fp32 where the
    optimizer updates fp32 master copies; then clip and step as torch does.
    Returns (loss, whether clipping scaled the gradients)."""
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    chunks = [batch] if accumulation == 1 else list(zip(*(x.chunk(accumulation) for x in batch)))
    total = None
    for chunk in chunks:
        loss = loss_fn(model, chunk)
        if accumulation > 1:
            loss = loss / accumulation
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    trained = masters if masters is not None else params
    for p, t in zip(params, trained):
        if t is not p:
            t.grad = p.grad.to(t.dtype)
    if layout is None:
        for t in trained:
            dist.all_reduce(t.grad, op=dist.ReduceOp.AVG)
    else:
        grads = dict(zip(names, (t.grad for t in trained)))
        for bucket in layout.buckets:
            flat = torch.zeros(bucket.size, dtype=trained[0].dtype)
            for s in bucket.slots:
                flat[s.offset : s.offset + s.numel] = grads[s.fqn].reshape(-1)
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
            for s in bucket.slots:
                grads[s.fqn].copy_(flat[s.offset : s.offset + s.numel].view_as(grads[s.fqn]))
    clipped = False
    if max_grad_norm is not None:
        clipped = torch.nn.utils.clip_grad_norm_(trained, max_grad_norm, foreach=False).item() > max_grad_norm
    optimizer.step()
    if masters is not None:
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return total, clipped


def padding_is_zero(dm: gf.DistModel) -> bool:
    """Every bucket element outside a parameter, and every state element outside this
    rank's slices, is exactly zero."""
    for bucket in dm.layout.buckets:
        mask = torch.ones(bucket.size, dtype=torch.bool)
        for s in bucket.slots:
            mask[s.offset : s.offset + s.numel] = False
        if dm.tensors[bucket.name][mask].ne(0).any():
            return False
        shard_mask = torch.ones(bucket.shard_size, dtype=torch.bool)
        for s in bucket.slices(dm.rank):
            shard_mask[s.shard_start : s.shard_end] = False
        for name, t in dm.tensors.items():
            if name.startswith(bucket.name + ".") and t[shard_mask].ne(0).any():
                return False
    return True


class Reference:
    """An eager data-parallel replica of the initial model with its own optimizer."""

    def __init__(self, model: nn.Module, optim_kind: str, master_dtype, layout=None) -> None:
        self.model = copy.deepcopy(model)
        self.masters = None
        if master_dtype is not None:
            self.masters = [p.detach().to(master_dtype).requires_grad_() for p in self.model.parameters()]
        self.optimizer = make_optimizer(
            optim_kind, self.masters if self.masters is not None else self.model.parameters()
        )
        self.layout = layout
        self.clipped_steps = 0

    def step(self, loss_fn, batch, strategy: gf.Strategy) -> torch.Tensor:
        loss, clipped = eager_step(
            self.model,
            self.masters,
            self.optimizer,
            loss_fn,
            batch,
            strategy.grad_accumulation,
            strategy.max_grad_norm,
            self.layout,
        )
        self.clipped_steps += clipped
        return loss

    def param_diff(self, model: nn.Module) -> tuple[float, bool]:
        ref = dict(self.model.named_parameters())
        pairs = [(p, ref[n]) for n, p in model.named_parameters()]
        return max(diff(a, b) for a, b in pairs), all(torch.equal(a, b) for a, b in pairs)

    def state_diff(self, dm: gf.DistModel) -> tuple[float, bool, int]:
        """This rank's slice@<fqn>.<state> views against the eager optimizer's full state."""
        names = [n for n, _ in self.model.named_parameters()]
        trained = dict(zip(names, self.masters if self.masters is not None else self.model.parameters()))
        worst, equal, n = 0.0, True, 0
        for name, view in dm.named_slices():
            fqn, _, state = name.removeprefix("slice@").rpartition(".")
            if fqn not in trained:
                continue  # slice@<fqn> itself: the parameter, compared as a whole
            sl = next(s for s in dm.layout.bucket_of(fqn).slices(dm.rank) if s.fqn == fqn)
            full = trained[fqn] if state == "master" else self.optimizer.state[trained[fqn]][state]
            expect = full.detach().reshape(-1)[sl.param_start : sl.param_start + sl.numel]
            worst, equal, n = max(worst, diff(view, expect)), equal and torch.equal(view, expect), n + 1
        return worst, equal, n


def run_scenario(rank: int, world: int, model_kind: str, optim_kind: str, dtype=torch.float32, **strategy) -> dict:
    torch.manual_seed(0)
    model = (MLP() if model_kind == "mlp" else GPT(GPT_CFG)).to(dtype)
    loss_fn = mlp_loss if model_kind == "mlp" else gpt_loss
    batches = mlp_batches(rank, dtype) if model_kind == "mlp" else gpt_batches(rank)
    st = gf.Strategy(bucket_size_mb=BUCKET_MB[model_kind], **strategy)
    ref = Reference(model, optim_kind, st.master_dtype)
    dm = gf.compile(model, make_optimizer(optim_kind, model.parameters()), loss_fn, batches[0], strategy=st)
    # With 3+ ranks, a per-parameter all_reduce sums each element in another order than the
    # bucket-wide reduce-scatter; this second reference reduces whole buckets (as graphfuse does).
    bucket_ref = Reference(model, optim_kind, st.master_dtype, dm.layout) if world > 2 else None

    out = {"loss_diff": 0.0, "losses_equal": True, "padding_zero": True, "bucket_ref_equal": True}
    for i, batch in enumerate(batches):
        ref_loss = ref.step(loss_fn, batch, st)
        loss = dm(batch)
        out["loss_diff"] = max(out["loss_diff"], diff(loss, ref_loss) / abs(ref_loss.item()))
        out["losses_equal"] &= torch.equal(loss, ref_loss)
        out["padding_zero"] &= padding_is_zero(dm)
        if bucket_ref is not None:
            out["bucket_ref_equal"] &= torch.equal(loss, bucket_ref.step(loss_fn, batch, st))
        if i == 0:
            out["step1_param_diff"] = ref.param_diff(model)[0]
    out["param_diff"], out["params_equal"] = ref.param_diff(model)
    out["state_diff"], out["states_equal"], out["n_state_slices"] = ref.state_diff(dm)
    if bucket_ref is not None:
        out["bucket_ref_equal"] &= bucket_ref.param_diff(model)[1] and bucket_ref.state_diff(dm)[1]
    out["clipped_steps"] = ref.clipped_steps

    # Optimizer-state memory this rank holds (its SHARD tensors) against the unsharded total.
    shards = {s.name for s in dm.program.signature.inputs if s.role == "shard"}
    out["shard_bytes"] = sum(t.numel() * t.element_size() for n, t in dm.tensors.items() if n in shards)
    per_elem = sum(
        torch.empty((), dtype=getattr(torch, dm.program.inputs_meta[n].dtype)).element_size()
        for n in shards
        if n.startswith("bucket0.")
    )
    out["unsharded_bytes"] = sum(p.numel() for p in model.parameters()) * per_elem
    out["padding_bytes"] = sum(b.size - sum(s.numel for s in b.slots) for b in dm.layout.buckets) * per_elem
    out["buckets"] = len(dm.layout.buckets)
    return out


SCENARIOS = {
    "mlp_adamw": dict(model_kind="mlp", optim_kind="adamw"),
    "gpt_adamw": dict(model_kind="gpt", optim_kind="adamw"),
    "mlp_sgd": dict(model_kind="mlp", optim_kind="sgd"),
    "gpt_sgd": dict(model_kind="gpt", optim_kind="sgd"),
    "mlp_bf16_master": dict(model_kind="mlp", optim_kind="adamw", dtype=torch.bfloat16, master_dtype=torch.float32),
    # SGD: clipping's own rounding differences stay at their size (Adam would amplify them).
    "mlp_clip": dict(model_kind="mlp", optim_kind="sgd", max_grad_norm=0.3),
    "gpt_accumulation": dict(model_kind="gpt", optim_kind="adamw", grad_accumulation=2),
}


# To keep the suite short, 3 ranks skip one GPT scenario (SGD is run on the MLP there).
SKIP_AT_3_AND_4 = {"gpt_sgd"}


def scenarios_at(world: int) -> list[str]:
    return [n for n in SCENARIOS if world < 3 or n not in SKIP_AT_3_AND_4]


def all_scenarios(rank: int, world: int) -> dict:
    return {name: run_scenario(rank, world, **SCENARIOS[name]) for name in scenarios_at(world)}


@functools.cache
def results(world: int) -> list[dict]:
    return run_ranks(all_scenarios, world)


def measured(world: int, scenario: str) -> list[dict]:
    return [r[scenario] for r in results(world)]


WORLDS = [1, 2, 3]  # 4 ranks on 2 cores cost 23 s; tests/checkpoint/test_checkpoint_reshard.py trains at 4


def scenario_params(names=None):
    names = names or list(SCENARIOS)
    return [pytest.param(w, n, id=f"{n}-{w}ranks") for w in WORLDS for n in names if n in scenarios_at(w)]


EXACT_EVERYWHERE = ["mlp_bf16_master"]
EXACT_UP_TO_2_RANKS = ["mlp_adamw", "gpt_adamw", "mlp_sgd", "gpt_sgd", "gpt_accumulation"]


@pytest.mark.parametrize("world,scenario", scenario_params(EXACT_UP_TO_2_RANKS + EXACT_EVERYWHERE))
def test_training_matches_eager_data_parallel(world, scenario):
    for r in measured(world, scenario):
        exact = world <= 2 or scenario in EXACT_EVERYWHERE
        if exact:
            # Losses, parameters and every state slice equal eager DP to the bit. bf16 + fp32
            # master is exact at every world size: the fp32 sum of 3 or 4 bf16 gradients is exact
            # (8-bit mantissas), so the order of the reduction cannot change it.
            assert r["losses_equal"] and r["params_equal"] and r["states_equal"], r
        else:
            # 3+ ranks: Gloo's reduce_scatter sums each element in the order of a ring over the
            # flat bucket; a per-parameter all_reduce chunks each tensor differently, so fp32 sums
            # of 3 or 4 terms round differently (measured: 1e-9..3e-7 after one step). Reducing
            # whole buckets in the reference (bucket_ref) makes it bitwise again, which shows that
            # the reduction order is the only difference.
            assert r["bucket_ref_equal"], r
            assert r["step1_param_diff"] <= 1e-6, r  # measured up to 2.6e-7 (Adam, near-zero gradients)
            assert r["loss_diff"] <= 1e-6, r  # relative, every step
            # After 20 steps SGD stays within 1e-7 (measured 6e-8). AdamW divides by sqrt(v):
            # for elements whose gradient is nearly zero (a sum that cancels) an ulp of the
            # gradient is a large relative change that Adam turns into an O(lr) step, and the
            # GPT then trains along a slightly different path (measured 1e-4..3e-4 at lr 1e-2;
            # the MLP stays at 6e-8).
            limit = 1e-3 if scenario.startswith("gpt") and "sgd" not in scenario else 1e-6
            assert r["param_diff"] <= limit and r["state_diff"] <= 1e-6, r
        assert r["n_state_slices"] > 0 or world > 1


@pytest.mark.parametrize("world,scenario", scenario_params(["mlp_clip"]))
def test_grad_clipping_matches_clip_grad_norm(world, scenario):
    for r in measured(world, scenario):
        # clip_grad_norm_ takes one vector_norm per parameter and then the norm of those norms;
        # graphfuse sums squares over flat shards and all-reduces the sum (one collective), so
        # the norm differs in its last bits; the scaled gradients then differ by about an ulp.
        assert r["clipped_steps"] >= 10, "max_grad_norm must actually clip in this test"
        assert r["loss_diff"] <= 1e-6 and r["param_diff"] <= 1e-6 and r["state_diff"] <= 1e-6, r


@pytest.mark.parametrize("world", WORLDS)
def test_padding_stays_zero_after_every_step(world):
    for name in scenarios_at(world):
        for r in measured(world, name):
            assert r["padding_zero"], name


@pytest.mark.parametrize("world", WORLDS)
def test_optimizer_state_per_rank_is_a_world_size_share(world):
    for name in scenarios_at(world):
        for r in measured(world, name):
            # Each rank holds bucket.size / N elements per state: the unsharded state divided by N,
            # plus its share of the alignment padding, and nothing more.
            bound = r["unsharded_bytes"] / world + r["padding_bytes"] / world
            assert r["shard_bytes"] <= bound, (name, r)
            assert r["shard_bytes"] == bound, (name, r)
    # GPT: padding costs under 15% on top of a 1/N share.
    gpt = measured(world, "gpt_adamw")[0]
    assert gpt["shard_bytes"] <= 1.15 * gpt["unsharded_bytes"] / world, gpt
