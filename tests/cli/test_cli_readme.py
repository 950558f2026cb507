"""The README's restart snippet, run as written on 2 Gloo ranks: the restarted job continues
bit for bit."""

import os
import re

import torch

import graphfuse as gf
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens
from tests._common import ROOT, run_ranks

README = ROOT / "README.md"
RESTART_MARK = "# after the restart"


def restart_snippet() -> tuple[str, str]:
    """(the part before a restart, the part after) of the README's restart code block."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if "gf.DistModel.from_program" in b]
    before, after = block.split(RESTART_MARK)
    return before, after.split("\n", 1)[1]  # the rest of the comment line goes too


def _fresh():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    return model, optimizer, scheduler


def _rank(rank: int, world_size: int, workdir: str) -> tuple[list[float], list[float]]:
    os.chdir(workdir)  # the snippet's relative paths, shared by the ranks
    batches = list(synthetic_tokens(GPTConfig(vocab_size=32, block_size=8), 4, 4, seed=10 + rank))
    model, optimizer, scheduler = _fresh()
    dm = gf.compile(model, optimizer, gpt_loss, batches[0])
    for b in batches[:2]:
        dm(b)
        scheduler.step()
    before, after = restart_snippet()
    names = {"gf": gf, "torch": torch, "dm": dm, "scheduler": scheduler}  # imported earlier in the README
    exec(before, names)
    expected = []
    for b in batches[2:]:
        expected.append(dm(b).item())
        scheduler.step()
    names["model"], names["optimizer"], names["scheduler"] = _fresh()
    exec(after, names)
    resumed = []
    for b in batches[2:]:
        resumed.append(names["dm"](b).item())
        names["scheduler"].step()
    return expected, resumed


def test_the_readme_restart_snippet_resumes_bitwise_at_2_ranks(tmp_path):
    for expected, resumed in run_ranks(_rank, 2, str(tmp_path)):
        assert resumed == expected
    assert sorted(p.name for p in (tmp_path / "step.program").iterdir()) == ["rank0", "rank1"]
