"""A captured training step run by gf.compile is bitwise equal to eager torch.optim
(foreach=False) over 20 steps: loss, every parameter, buffer and optimizer state.

The models and the comparison helper live here; test_capture_*.py and test_signature.py
import them."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens

STEPS = 20


# ---- models -----------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 24, d_out: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d_hidden)
        self.hidden = nn.Linear(d_hidden, d_hidden)
        self.out = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.hidden(torch.tanh(self.inp(x)))))


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross entropy of model(x) against class labels y (the MLP and the conv net)."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def mlp_batches(steps: int, batch_size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, 12, generator=g), torch.randint(0, 5, (batch_size,), generator=g))
        for _ in range(steps)
    ]


class ConvNet(nn.Module):
    """Conv + BatchNorm: the forward updates running_mean, running_var and num_batches_tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8, momentum=0.2)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def conv_batches(steps: int, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(steps)]


def tiny_llama(tie: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def hf_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def token_batches(steps: int, vocab: int = 96, batch_size: int = 2, seq: int = 16, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
        out.append((ids, ids.clone()))
    return out


def small_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))


# ---- optimizers: two param groups and a warm-up schedule -----------------------------------
def two_groups(model: nn.Module, decay: float = 0.1) -> list[dict]:
    """Matrices with weight decay (lr 1e-2), vectors without (lr 3e-3); frozen ones are kept out."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3},
    ]


def warmup(optimizer: torch.optim.Optimizer, steps: int = 5) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / steps))


def adamw(model: nn.Module, **kw) -> torch.optim.Optimizer:
    return torch.optim.AdamW(two_groups(model), lr=1e-2, betas=(0.9, 0.95), foreach=False, **kw)


def adam_amsgrad(model: nn.Module, **kw) -> torch.optim.Optimizer:
    return torch.optim.Adam(two_groups(model, decay=0.01), lr=1e-2, amsgrad=True, foreach=False, **kw)


def sgd_nesterov(model: nn.Module, **kw) -> torch.optim.Optimizer:
    return torch.optim.SGD(two_groups(model, decay=1e-3), lr=5e-2, momentum=0.9, nesterov=True, foreach=False, **kw)


def sgd_dampening(model: nn.Module, **kw) -> torch.optim.Optimizer:
    groups = two_groups(model, decay=1e-3)
    groups[1]["momentum"] = 0.0  # one group without a momentum buffer
    return torch.optim.SGD(groups, lr=5e-2, momentum=0.8, dampening=0.3, foreach=False, **kw)


# ---- the comparison -----------------------------------------------------------------------
# Per-parameter 0-d states torch.optim keeps that graphfuse computes on the host from the
# step count (the group's step, compared below; NAdam's mu_product and ASGD's eta and mu, which
# the parameters check; test_optimizers.py compares ASGD's too).
HOST_STATES = ("step", "mu_product", "eta", "mu")


def assert_same_state(
    m_eager: nn.Module, o_eager: torch.optim.Optimizer, m_gf: nn.Module, dm: gf.DistModel, when: str
) -> None:
    """Every parameter, buffer and optimizer state of the eager run equals graphfuse's, bit for bit."""
    eager_params = dict(m_eager.named_parameters(remove_duplicate=False))
    gf_params = dict(m_gf.named_parameters(remove_duplicate=False))
    assert eager_params.keys() == gf_params.keys()
    for fqn, p in eager_params.items():
        assert torch.equal(p, gf_params[fqn]), f"{when}: parameter {fqn} differs"
    eager_bufs = dict(m_eager.named_buffers())
    gf_bufs = dict(m_gf.named_buffers())
    assert eager_bufs.keys() == gf_bufs.keys()
    for fqn, b in eager_bufs.items():
        assert b.dtype == gf_bufs[fqn].dtype and torch.equal(b, gf_bufs[fqn]), f"{when}: buffer {fqn} differs"

    slices = dict(dm.named_slices())
    canonical = dict(m_eager.named_parameters())  # first FQN of each Parameter, as capture names it
    n_states = 0
    for fqn, p in canonical.items():
        state = o_eager.state.get(p, {})
        if not p.requires_grad:
            assert not state and f"slice@{fqn}" not in slices, f"frozen {fqn} has optimizer state"
            continue
        assert torch.equal(slices[f"slice@{fqn}"], p.detach().flatten()), f"{when}: slice@{fqn} differs"
        for name, value in state.items():
            if name in HOST_STATES:
                continue
            n_states += 1
            assert torch.equal(slices[f"slice@{fqn}.{name}"], value.flatten()), f"{when}: state {fqn}.{name} differs"
        own = {k.removeprefix(f"slice@{fqn}.") for k in slices if k.startswith(f"slice@{fqn}.")}
        if state:
            assert own == {k for k in state if k not in HOST_STATES}, (
                f"{fqn}: graphfuse states {own}, eager {set(state)}"
            )
        else:  # before the first step torch.optim has no state yet; graphfuse's starts at zero
            assert all(not slices[f"slice@{fqn}.{k}"].any() for k in own), f"{when}: {fqn} starts with nonzero state"
    if any(o_eager.state.values()):
        assert n_states > 0
    for g, group in enumerate(o_eager.param_groups):
        steps = {int(o_eager.state[p]["step"]) for p in group["params"] if "step" in o_eager.state.get(p, {})}
        assert steps <= {dm.steps[g]}, f"group {g}: eager step {steps}, graphfuse {dm.steps[g]}"


def run_bitwise(
    make_model: Callable[[], nn.Module],
    make_optim: Callable[[nn.Module], torch.optim.Optimizer],
    loss_fn: Callable,
    batches: list,
    freeze: Callable[[nn.Module], None] | None = None,
) -> gf.DistModel:
    """Train a model eagerly and through gf.compile side by side; compare after every step."""
    torch.manual_seed(0)
    m_eager = make_model()
    if freeze is not None:
        freeze(m_eager)
    m_gf = copy.deepcopy(m_eager)
    o_eager, o_gf = make_optim(m_eager), make_optim(m_gf)
    s_eager, s_gf = warmup(o_eager), warmup(o_gf)
    frozen_before = {n: p.detach().clone() for n, p in m_eager.named_parameters() if not p.requires_grad}

    dm = gf.compile(m_gf, o_gf, loss_fn, batches[0])
    assert_same_state(m_eager, o_eager, m_gf, dm, "after compile")
    lrs = set()
    for i, batch in enumerate(batches):
        o_eager.zero_grad()
        loss = loss_fn(m_eager, batch)
        loss.backward()
        o_eager.step()
        s_eager.step()
        loss_gf = dm(batch)
        s_gf.step()
        lrs.add(o_gf.param_groups[0]["lr"])
        assert torch.equal(loss.detach(), loss_gf), f"step {i}: loss {loss.item()} vs {loss_gf.item()}"
        assert_same_state(m_eager, o_eager, m_gf, dm, f"step {i}")
    assert len(lrs) > 1, "the warm-up schedule changed the learning rate"
    for n, p in m_gf.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), f"frozen {n} changed"
    return dm


def freeze_first_layer(model: nn.Module) -> None:
    model.inp.requires_grad_(False)


# ---- the tests ----------------------------------------------------------------------------
@pytest.mark.parametrize("make_optim", [adamw, adam_amsgrad, sgd_nesterov, sgd_dampening], ids=lambda f: f.__name__)
def test_mlp_with_frozen_layer_is_bitwise_equal_to_eager(make_optim):
    run_bitwise(MLP, make_optim, mlp_loss, mlp_batches(STEPS), freeze=freeze_first_layer)


def test_mlp_adamw_maximize_is_bitwise_equal_to_eager():
    run_bitwise(MLP, lambda m: adamw(m, maximize=True), mlp_loss, mlp_batches(STEPS))


def test_gpt_with_tied_output_layer_is_bitwise_equal_to_eager():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    dm = run_bitwise(small_gpt, adamw, gpt_loss, synthetic_tokens(cfg, 2, STEPS, seed=4))
    assert dm.program.signature.aliases == {"lm_head.weight": "wte.weight"}


def test_gpt_with_sgd_nesterov_is_bitwise_equal_to_eager():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    run_bitwise(small_gpt, sgd_nesterov, gpt_loss, synthetic_tokens(cfg, 2, STEPS, seed=5))


def test_conv_net_with_batchnorm_updates_running_stats_bitwise():
    dm = run_bitwise(ConvNet, sgd_nesterov, mlp_loss, conv_batches(STEPS))
    assert int(dm.model.bn1.num_batches_tracked) == STEPS
    assert int(dm.model.bn2.num_batches_tracked) == STEPS


def test_conv_net_with_adamw_is_bitwise_equal_to_eager():
    run_bitwise(ConvNet, adamw, mlp_loss, conv_batches(STEPS, seed=6))


def freeze_llama_layer(model: nn.Module) -> None:
    model.model.layers[0].requires_grad_(False)


def test_transformers_llama_with_frozen_layer_is_bitwise_equal_to_eager():
    dm = run_bitwise(tiny_llama, adamw, hf_lm_loss, token_batches(STEPS), freeze=freeze_llama_layer)
    sig = dm.program.signature
    assert sig.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "model.layers.0.mlp.up_proj.weight" in sig.names("frozen")


def test_transformers_llama_without_cache_takes_eager_attention_path_bitwise():
    """Issue 13, defect 1: with use_cache=False transformers checks position_ids (an arange)
    for packed sequences on the host; capture answers that read from the constant's real
    value, so SDPA runs with is_causal and enable_gqa as in eager, not with a mask and repeat_kv."""

    def make():
        model = tiny_llama()
        model.config.use_cache = False
        return model

    dm = run_bitwise(make, adamw, hf_lm_loss, token_batches(4, seed=8))
    sdpa = [
        n
        for n in dm.program.graph_module.graph.nodes
        if "scaled_dot_product" in str(n.target) and "backward" not in str(n.target)
    ]
    assert sdpa and all(n.kwargs.get("is_causal") or (len(n.args) > 4 and n.args[4] is True) for n in sdpa), [
        n.format_node() for n in sdpa
    ]


def test_transformers_bert_is_bitwise_equal_to_eager():
    from transformers import BertConfig, BertForMaskedLM

    def make():
        cfg = BertConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        return BertForMaskedLM(cfg)

    run_bitwise(make, adam_amsgrad, hf_lm_loss, token_batches(STEPS, seed=7))
