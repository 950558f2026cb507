"""Write the program-file fixture of the current format version, tests/fixtures/program_v<N>/:
an MLP trained with SGD (momentum) compiled for 2 Gloo CPU ranks, each rank's saved program,
and the data and losses a loaded program must reproduce. Run once per format version and
commit the output; the fixtures of older versions stay, so that the tests keep loading them.

    python tools/make_program_fixture.py [--out tests/fixtures/program_v<N>]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file

from graphfuse.testing.launch import run_ranks

WORLD_SIZE, STEPS, LR, MOMENTUM = 2, 4, 0.05, 0.9


def mlp() -> nn.Module:
    """The fixture's model; tests/program_files/test_program_io.py builds the same one."""
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _rank(rank: int, world: int, out: str) -> None:
    """One rank's part (graphfuse.testing.launch.run_ranks made its Gloo group, one thread)."""
    import graphfuse as gf

    g = torch.Generator().manual_seed(1234)
    model = mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    initial = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    data = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(STEPS * WORLD_SIZE)]
    batches = data[rank::WORLD_SIZE]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    dm = gf.compile(model, opt, mse, batches[0], strategy=gf.Strategy(bucket_size_mb=0.0005, align_bytes=64))
    gf.save_program(dm.program, Path(out) / f"rank{rank}")
    losses = [dm(b).item() for b in batches]
    if rank == 0:
        tensors = dict(initial)
        for i, (x, y) in enumerate(data):
            tensors[f"batch.{i}.x"], tensors[f"batch.{i}.y"] = x, y
        tensors.update({f"final.{n}": p.detach().clone() for n, p in model.named_parameters()})
        save_file(tensors, str(Path(out) / "data.safetensors"))
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        expected = {
            "world_size": WORLD_SIZE,
            "steps": STEPS,
            "optimizer": {"cls": "SGD", "lr": LR, "momentum": MOMENTUM},
            "batches": "rank r takes batch.{r}, batch.{r + world_size}, ... of data.safetensors",
            "losses": gathered,
            "made_with": {"torch": torch.__version__, "graphfuse": gf.__version__, "machine": platform.machine()},
        }
        (Path(out) / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from graphfuse.program_files import FORMAT_VERSION

    default = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / f"program_v{FORMAT_VERSION}"
    parser.add_argument("--out", default=str(default))
    out = parser.parse_args().out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run_ranks(_rank, WORLD_SIZE, out)
    total = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    print(f"wrote {out} ({total / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
