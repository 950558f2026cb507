"""The model zoo: common architectures (transformers 5.x from tiny configs, plain torch) train
bitwise like eager PyTorch under gf.compile (3 AdamW steps, every loss, parameter, buffer and
optimizer state compared), four of them also at 2 Gloo ranks against eager data parallelism,
three also run on from their saved program files; models whose step reads tensor values on
the host are refused naming the op and the module.
No downloads: every model is built from a config with random weights. docs/models.md."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphfuse as gf
from tests._common import run_ranks
from tests.capture.test_capture import assert_same_state

pytest.importorskip("transformers", reason="the zoo's transformers models need the `transformers` package (test extra)")
STEPS = 3
VOCAB, SEQ, BATCH = 64, 8, 2


# ---- models: name -> (make the model, loss_fn, batch of one step and rank) ----------------
def _hf(cls_name: str, cfg_name: str, **cfg):
    import transformers

    return getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**cfg))


_DEC = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    use_cache=False,
)


def lm_loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def tokens(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, ids.clone()


def gpt2(dropout: float = 0.0, checkpointing: bool = False):
    model = _hf(
        "GPT2LMHeadModel",
        "GPT2Config",
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
    )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.transformer.h[0].mlp.requires_grad_(False)  # frozen, next to the tied wte/lm_head
    return model


def seq2seq_tokens(step: int, rank: int):
    g = torch.Generator().manual_seed(2000 * rank + step)
    return torch.randint(2, VOCAB, (BATCH, SEQ), generator=g), torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=g)


def images(step: int, rank: int, size: int = 16):
    g = torch.Generator().manual_seed(3000 * rank + step)
    return torch.randn(BATCH * 2, 3, size, size, generator=g), torch.randint(0, 5, (BATCH * 2,), generator=g)


def vit_loss(model, batch):
    return model(pixel_values=batch[0], labels=batch[1]).loss


class ResNet(nn.Module):
    """Two BatchNorm'd residual blocks in channels_last, as vision training runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
        )
        self.down = nn.Conv2d(8, 16, 2, stride=2)
        self.head = nn.Linear(16, 5)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        x = self.stem(x.contiguous(memory_format=torch.channels_last))
        x = F.relu(x + self.block(x))
        return self.head(self.down(x).mean(dim=(2, 3)))


def classify_loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


class RNN(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.rnn = cell(16, 24, num_layers=2, batch_first=True)
        self.out = nn.Linear(24, VOCAB)

    def forward(self, ids):
        return self.out(self.rnn(self.emb(ids))[0])


def rnn_loss(model, batch):
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


class Autocast(nn.Module):
    """A Llama whose forward runs under autocast(bfloat16), as mixed-precision training does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _hf("LlamaForCausalLM", "LlamaConfig", **_DEC)

    def forward(self, input_ids, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(input_ids=input_ids, labels=labels)


ZOO = {
    "gpt2_tied_frozen": (gpt2, lm_loss, tokens),
    "gpt2_dropout": (lambda: gpt2(dropout=0.1), lm_loss, tokens),
    "gpt2_checkpointing": (lambda: gpt2(checkpointing=True), lm_loss, tokens),
    "llama": (lambda: _hf("LlamaForCausalLM", "LlamaConfig", **_DEC), lm_loss, tokens),
    "mistral": (lambda: _hf("MistralForCausalLM", "MistralConfig", **_DEC), lm_loss, tokens),
    "qwen2": (lambda: _hf("Qwen2ForCausalLM", "Qwen2Config", **_DEC), lm_loss, tokens),
    "mixtral": (
        lambda: _hf("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2, **_DEC),
        lm_loss,
        tokens,
    ),
    "bert": (
        lambda: _hf(
            "BertForMaskedLM",
            "BertConfig",
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
        ),
        lm_loss,
        tokens,
    ),
    "t5": (
        lambda: _hf(
            "T5ForConditionalGeneration",
            "T5Config",
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            decoder_start_token_id=0,
            use_cache=False,
        ),
        lm_loss,
        seq2seq_tokens,
    ),
    "bart": (
        lambda: _hf(
            "BartForConditionalGeneration",
            "BartConfig",
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=32,
            use_cache=False,
        ),
        lm_loss,
        seq2seq_tokens,
    ),
    "vit": (
        lambda: _hf(
            "ViTForImageClassification",
            "ViTConfig",
            image_size=16,
            patch_size=4,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_labels=5,
        ),
        vit_loss,
        images,
    ),
    "resnet_bn_channels_last": (ResNet, classify_loss, images),
    "lstm": (lambda: RNN(nn.LSTM), rnn_loss, tokens),
    "gru": (lambda: RNN(nn.GRU), rnn_loss, tokens),
    "llama_autocast_bf16": (Autocast, lambda m, b: m(*b).loss, tokens),
}


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)


# Programs whose ops the allowlist gained for them (dropout, relative position buckets; the
# GRU cell; MoE routing and grouped_mm): saved after the steps above, loaded and run on.
SAVED_PROGRAMS = ("t5", "gru", "mixtral")


def _program_file_continues(name: str, dm: gf.DistModel, model: nn.Module, steps_done: int, tmp_path) -> None:
    """`dm`'s program file and a checkpoint, loaded into a fresh model (other weights) through
    gf.DistModel.from_program and gf.load: its next two steps equal `dm`'s, losses, parameters
    and buffers."""
    make, loss_fn, batch_of = ZOO[name]
    gf.save_program(dm.program, tmp_path / "program")
    gf.save(dm, tmp_path / "ckpt")
    torch.manual_seed(1)
    fresh = make()
    loaded = gf.DistModel.from_program(gf.load_program(tmp_path / "program"), fresh, adamw(fresh))
    gf.load(loaded, tmp_path / "ckpt")
    for step in (steps_done, steps_done + 1):
        torch.manual_seed(100 + step)  # the same dropout masks in both runs
        expected = dm(batch_of(step, 0))
        torch.manual_seed(100 + step)
        assert torch.equal(expected, loaded(batch_of(step, 0))), (
            f"{name} from its program file, step {step}: loss differs"
        )
    theirs = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
    assert all(torch.equal(t, theirs[n]) for n, t in [*model.named_parameters(), *model.named_buffers()]), name


# ---- one rank -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ZOO)
def test_model_trains_bitwise_like_eager(name, caplog, tmp_path):
    make, loss_fn, batch_of = ZOO[name]
    torch.manual_seed(0)
    m_eager = make()
    m_gf = copy.deepcopy(m_eager)
    o_eager, o_gf = adamw(m_eager), adamw(m_gf)
    with caplog.at_level("INFO", logger="graphfuse"):
        dm = gf.compile(m_gf, o_gf, loss_fn, batch_of(0, 0))
    fallback = [r.getMessage() for r in caplog.records if "tracing it as compiling" in r.getMessage()]
    assert not fallback, f"{name} was not traced on eager's path: {fallback}"
    if name == "mixtral":  # transformers' default experts, as eager runs them on the CPU
        assert any(n.target is torch.ops.aten._grouped_mm.default for n in dm.program.graph.nodes)
    for step in range(STEPS):
        batch = batch_of(step, 0)
        torch.manual_seed(100 + step)  # the same dropout masks in both runs
        o_eager.zero_grad()
        loss = loss_fn(m_eager, batch)
        loss.backward()
        o_eager.step()
        torch.manual_seed(100 + step)
        loss_gf = dm(batch)
        assert torch.equal(loss.detach(), loss_gf), f"{name} step {step}: loss {loss.item()} vs {loss_gf.item()}"
        assert_same_state(m_eager, o_eager, m_gf, dm, f"{name} step {step}")
    if name in SAVED_PROGRAMS:
        _program_file_continues(name, dm, m_gf, STEPS, tmp_path)


def test_reentrant_checkpointing_is_refused_by_name():
    model = gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(gf.UnsupportedError, match=re.escape("use_reentrant=False")):
        gf.compile(model, adamw(model), lm_loss, tokens(0, 0))


def test_moe_with_a_per_expert_loop_is_refused_naming_the_op_and_module():
    """transformers' "eager" experts loop over the experts that `nonzero` finds: a shape that
    depends on the routing, which a traced program cannot have."""
    model = _hf(
        "MixtralForCausalLM",
        "MixtralConfig",
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation="eager",
        **_DEC,
    )
    with pytest.raises(gf.UnsupportedError, match="reads a tensor's value on the host") as info:
        gf.compile(model, adamw(model), lm_loss, tokens(0, 0))
    assert "aten.nonzero" in str(info.value)
    assert "in module model.layers.0.mlp.experts" in str(info.value)


# ---- two ranks ----------------------------------------------------------------------------
DP_MODELS = ("gpt2_dropout", "qwen2", "resnet_bn_channels_last", "lstm")


def _data_parallel(rank: int, world: int, names: tuple[str, ...]) -> dict:
    """Each model trained by graphfuse and by an eager replica that averages gradients with
    all_reduce(AVG); returns, per model, whether every loss and parameter is equal."""
    out = {}
    for name in names:
        make, loss_fn, batch_of = ZOO[name]
        torch.manual_seed(0)
        m_ref = make()
        m_gf = copy.deepcopy(m_ref)
        o_ref = adamw(m_ref)
        dm = gf.compile(m_gf, adamw(m_gf), loss_fn, batch_of(0, rank))
        equal = True
        for step in range(STEPS):
            batch = batch_of(step, rank)
            torch.manual_seed(100 * rank + step)
            o_ref.zero_grad()
            loss = loss_fn(m_ref, batch)
            loss.backward()
            for p in m_ref.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            o_ref.step()
            torch.manual_seed(100 * rank + step)
            equal &= torch.equal(loss.detach(), dm(batch))
        ref = dict(m_ref.named_parameters())
        out[name] = equal and all(torch.equal(p, ref[n]) for n, p in m_gf.named_parameters())
        out[name + ".buffers"] = all(torch.equal(b, dict(m_ref.named_buffers())[n]) for n, b in m_gf.named_buffers())
    return out


def test_four_models_at_two_ranks_are_bitwise_like_eager_data_parallel():
    results = run_ranks(_data_parallel, 2, DP_MODELS, timeout=240)
    for rank, result in enumerate(results):
        assert all(result.values()), f"rank {rank}: {result}"
        assert set(result) == {n for name in DP_MODELS for n in (name, name + ".buffers")}
