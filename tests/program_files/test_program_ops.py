"""The program files' op allowlist covers what PyTorch users train: HF GPT-2 in its default
config (dropout), every normalisation, pooling, embedding, dropout and attention layer of
torch.nn, and every model of the zoo; it still refuses mutating, random, uninitialised and
unknown ops, and a refusal to save names the op and the layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphfuse as gf
from graphfuse.program_files import ops
from graphfuse.program_files.values import Malformed


class Layers(nn.Module):
    """One of each torch.nn normalisation (BatchNorm, InstanceNorm 1d/2d/3d, GroupNorm,
    LocalResponseNorm, LayerNorm, RMSNorm), pooling (max, average, adaptive, LP; 1d/2d/3d),
    embedding (Embedding, EmbeddingBag), dropout (every kind) and attention layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.conv3 = (
            nn.Conv1d(3, 8, 3, padding=1),
            nn.Conv2d(3, 8, 3, padding=1),
            nn.Conv3d(3, 8, 1),
        )
        self.norm1 = nn.Sequential(nn.BatchNorm1d(8), nn.InstanceNorm1d(8, affine=True), nn.Dropout1d(0.1))
        self.norm2 = nn.Sequential(
            nn.BatchNorm2d(8),
            nn.GroupNorm(2, 8),
            nn.InstanceNorm2d(8, affine=True),
            nn.LocalResponseNorm(2),
            nn.Dropout2d(0.1),
        )
        self.norm3 = nn.Sequential(nn.BatchNorm3d(8), nn.InstanceNorm3d(8, affine=True), nn.Dropout3d(0.1))
        self.pool1 = nn.ModuleList(
            [nn.MaxPool1d(2), nn.AvgPool1d(2), nn.AdaptiveAvgPool1d(3), nn.AdaptiveMaxPool1d(3), nn.LPPool1d(2, 2)]
        )
        self.pool2 = nn.ModuleList(
            [nn.MaxPool2d(2), nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(3), nn.AdaptiveMaxPool2d(3), nn.LPPool2d(2, 2)]
        )
        self.pool3 = nn.ModuleList([nn.MaxPool3d(2), nn.AvgPool3d(2), nn.AdaptiveAvgPool3d(1), nn.AdaptiveMaxPool3d(1)])
        self.emb, self.bag = nn.Embedding(16, 8), nn.EmbeddingBag(16, 8, mode="mean")
        self.tokens = nn.Sequential(
            nn.LayerNorm(8), nn.RMSNorm(8), nn.Dropout(0.1), nn.AlphaDropout(0.1), nn.FeatureAlphaDropout(0.1)
        )
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(4 * 8, 4)

    @staticmethod
    def _pooled(x: torch.Tensor, pools: nn.ModuleList) -> torch.Tensor:
        return sum(p(x).flatten(2).mean(-1) for p in pools)

    def forward(self, images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        f1 = self._pooled(self.norm1(self.conv1(images.flatten(2))), self.pool1)
        f2 = self._pooled(self.norm2(self.conv2(images)), self.pool2)
        f3 = self._pooled(
            self.norm3(self.conv3(images.unflatten(2, (4, 2)).unflatten(-1, (2, 4)).flatten(-2))), self.pool3
        )
        t = self.tokens(self.emb(ids) + self.bag(ids).unsqueeze(1))
        t = self.attn(t, t, t)[0]
        t = F.scaled_dot_product_attention(
            t.unsqueeze(1), t.unsqueeze(1), t.unsqueeze(1), dropout_p=0.1, is_causal=True
        )
        return self.head(torch.cat([f1, f2, f3, t.squeeze(1).mean(1)], -1))


def _layers_loss(model, batch):
    return F.mse_loss(model(batch[0], batch[1]), batch[2])


def _layers_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return (
        torch.randn(2, 3, 8, 8, generator=g),
        torch.randint(0, 16, (2, 6), generator=g),
        torch.randn(2, 4, generator=g),
    )


def _gpt2_default():
    """GPT-2 with every default of GPT2Config but the sizes: dropout 0.1 everywhere."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4))


def _gpt2_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def _tokens(step: int):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def _round_trip_trains_like_the_original(build, loss_fn, batch_of, tmp_path) -> None:
    """The program saved, loaded and run on a fresh model from the same weights: every step's
    loss (dropout masks from the same seeds), then every parameter and buffer, equal bitwise."""
    torch.manual_seed(0)
    model = build()
    dm = gf.compile(model, _adamw(model), loss_fn, batch_of(0))
    gf.save_program(dm.program, tmp_path / "program")
    torch.manual_seed(0)
    fresh = build()
    loaded = gf.DistModel.from_program(gf.load_program(tmp_path / "program"), fresh, _adamw(fresh))
    for step in range(2):
        torch.manual_seed(100 + step)
        expected = dm(batch_of(step))
        torch.manual_seed(100 + step)
        assert torch.equal(expected, loaded(batch_of(step))), f"step {step}"
    theirs = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, theirs[name]), name


def test_gpt2_in_its_default_config_round_trips_and_trains_like_the_original(tmp_path):
    pytest.importorskip("transformers")
    _round_trip_trains_like_the_original(_gpt2_default, _gpt2_loss, _tokens, tmp_path)


def test_every_torch_nn_norm_pool_embedding_dropout_and_attention_layer_round_trips(tmp_path):
    _round_trip_trains_like_the_original(Layers, _layers_loss, _layers_batch, tmp_path)


class LogCumSumExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(x * self.scale, dim=1)


def test_saving_an_operator_outside_the_allowlist_is_refused_naming_the_op_and_the_layer(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), LogCumSumExp(), nn.Linear(4, 2))
    dm = gf.compile(model, _adamw(model), lambda m, b: m(b).pow(2).mean(), torch.randn(3, 4))
    dm(torch.randn(3, 4))  # it trains
    with pytest.raises(gf.UnsupportedError) as info:
        gf.save_program(dm.program, tmp_path / "program")
    message = str(info.value)
    assert (
        "calls aten.logcumsumexp.default in the forward, in layer 1 (nearest parameters it reads: 1.scale)" in message
    ), message
    assert "still trains with gf.compile" in message and "issue" in message, message
    assert "add it there" not in message and "ops.py" not in message  # not the user's file to edit
    assert not (tmp_path / "program").exists()


# The overloads the zoo's models (tests/integration/test_zoo.py, GPT-2 in its default config too) contain
# after every pass, at 2 ranks (tools/list_program_ops.py, torch 2.13, CPU).
ZOO_OPS = """
    _c10d_functional.all_gather_into_tensor.default _c10d_functional.reduce_scatter_tensor.default
    _c10d_functional.wait_tensor.default _grouped_mm.default _log_softmax.default _log_softmax_backward_data.default
    _native_batch_norm_legit_functional.default _safe_softmax.default
    _scaled_dot_product_flash_attention_for_cpu.default
    _scaled_dot_product_flash_attention_for_cpu_backward.default _softmax.default _softmax_backward_data.default
    _to_copy.default _unsafe_view.default abs.default add.Tensor addcmul.default addmm.default alias.default
    arange.default arange.start bernoulli.p bmm.default cat.default clone.default constant_pad_nd.default
    convolution.default convolution_backward.default copy.default cos.default cumsum.default detach.default div.Scalar
    div.Tensor embedding.default embedding_dense_backward.default empty_like.default eq.Scalar expand.default
    fill.Tensor floor_divide.default full_like.default gather.default ge.Tensor gelu.default gelu_backward.default
    gt.Scalar histc.default index.Tensor index_put.default lerp.Scalar lift_fresh_copy.default log.default lt.Scalar
    masked_fill.Scalar mean.dim minimum.default mkldnn_rnn_layer.default mkldnn_rnn_layer_backward.default mm.default
    mul.Scalar mul.Tensor native_batch_norm_backward.default native_layer_norm.default
    native_layer_norm_backward.default
    neg.default new_zeros.default nll_loss_backward.default nll_loss_forward.default ones.default ones_like.default
    permute.default pow.Tensor_Scalar relu.default reshape.default rsqrt.default scalar_tensor.default scatter.src
    select.int select_backward.default select_scatter.default sigmoid.default sigmoid_backward.default silu.default
    silu_backward.default sin.default slice.Tensor slice_backward.default slice_scatter.default sort.default
    split.Tensor
    sqrt.default squeeze.dim stack.default sub.Tensor sum.dim_IntList t.default tanh.default tanh_backward.default
    threshold_backward.default topk.default transpose.int tril.default unbind.int unsqueeze.default view.default
    where.self zeros.default zeros_like.default
""".split()


def test_every_op_of_the_zoo_is_admitted():
    names = [n if n.startswith("_c10d") else f"aten.{n}" for n in ZOO_OPS]
    assert [str(ops.resolve_target(n)) for n in names] == names


@pytest.mark.parametrize(
    "name",
    [
        "aten.add.out",
        "aten.mul_.Tensor",
        "aten.copy_.default",
        "aten.index_put_.default",  # write into an argument
        "aten.bernoulli_.float",
        "aten.resize_.default",
        "aten.set_.source_Tensor",
        "aten.native_batch_norm.default",
        "aten.rand.default",
        "aten.randn.default",
        "aten.native_dropout.default",  # random, outside the explicit names
        "aten.empty.memory_format",
        "aten.empty_strided.default",
        "aten.as_strided.default",  # uninitialised, any stride
        "aten.nonzero.default",
        "aten._local_scalar_dense.default",
        "aten.sym_size.int",  # values read on the host
        "aten.from_file.default",
        "aten._print.default",
        "aten.logcumsumexp.default",  # I/O; in no family
        "aten.add.t",
        "aten.add.str",
        "aten.split.str",  # TorchScript's list and string overloads of admitted names
        "prims.view_of.default",
        "aten.__and__.Tensor",
        "aten.add.__class__",
    ],
)
def test_mutating_random_uninitialised_and_unlisted_overloads_are_refused(name):
    with pytest.raises(Malformed, match="unknown operator"):
        ops.resolve_target(name)


def test_families_admit_the_gradients_of_admitted_ops_and_list_what_they_admit():
    names, explicit = set(ops.admitted_names()), {f"{ns}.{op}" for ns, listed in ops.EXPLICIT.items() for op in listed}
    assert {
        "aten.native_group_norm_backward",
        "aten.avg_pool3d_backward",
        "aten.max_pool3d_with_indices_backward",
        "aten._embedding_bag_backward",
        "aten.upsample_bilinear2d_backward",
        "aten.glu_backward",
    } <= names
    by_family = names - explicit  # empty_like and new_empty are explicit: dropout's shape for bernoulli
    assert not {
        n
        for n in by_family
        if n.split(".")[1].startswith(("empty", "new_empty", "rand", "as_strided")) or n.endswith("_")
    }
    assert explicit <= names
