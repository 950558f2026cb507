"""Small models for the demo, the benchmarks and the tests: a GPT with a tied output layer."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """A GPT-2 shaped language model; `lm_head.weight` is `wte.weight` (tied)."""

    pos: torch.Tensor  # a buffer (register_buffer), which nn.Module's attribute typing cannot see

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(cfg.block_size), persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(self.pos[:t])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross entropy; `batch` is (tokens, targets), both (B, T) int64."""
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_tokens(cfg: GPTConfig, batch_size: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic batches of (tokens, tokens shifted by one) that a model can learn: each
    sequence counts up from a random start with a random stride of 1 to 4 (mod vocab_size)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    positions = torch.arange(cfg.block_size + 1)
    for _ in range(steps):
        start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=g)
        stride = torch.randint(1, 5, (batch_size, 1), generator=g)
        seq = (start + stride * positions) % cfg.vocab_size
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


class SeededLoader:
    """A rank's data position (batch `pos` of this rank) with a `state_dict`, as a resumable loader
    has; each batch also draws noise from the global generators (Python's and torch's), so a resume
    that restores the position or the generators wrongly is not bitwise. Batches: x [4, 8], y [4, 4];
    batch `pos` of rank `rank` is seeded `stride * rank + pos`."""

    def __init__(self, rank: int, stride: int = 100) -> None:
        self.rank, self.stride, self.pos = rank, stride, 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.stride * self.rank + self.pos)
        self.pos += 1
        x = torch.randn(4, 8, generator=g) + 0.1 * random.random() * torch.randn(4, 8)
        return x, torch.randn(4, 4, generator=g)
