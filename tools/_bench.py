"""What the benchmarks in tools/ share: the machine they ran on, a device synchronise, timed steps,
and the report every bench prints (a rich table, then one JSON line that scripts read)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist


def machine(device: str = "cpu", *, collectives: bool = False) -> str:
    """One line naming where a bench ran. CUDA: the GPU's name and count, torch and CUDA (with
    `collectives`, NCCL's version and NCCL_NVLS_ENABLE too); CPU: the processor, its cores, the
    OS and torch (with `collectives`, "Gloo")."""
    if device == "cuda":
        gpus = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
        line = f"{gpus}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        if collectives:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            line += f", NCCL {nccl}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}"
        return line
    cpu = f"{platform.processor() or platform.machine()} {os.cpu_count()} cores"
    line = f"{cpu}, {platform.system()}, torch {torch.__version__}"
    return line + (", Gloo" if collectives else "")


def machine_facts() -> dict:
    """The machine as JSON fields, for tools whose record is read by scripts: host, processor,
    cores, torch's threads, load, Python and torch."""
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a clock read after it counts it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable, batches: Iterable, warmup: int, device: torch.device | str) -> list[float]:
    """Seconds of `step(b)` for each batch after the first `warmup`, the device synchronised
    around each; in a process group every rank starts each step together (a barrier), so that
    a step's time is not another rank's lateness."""
    times = []
    for i, b in enumerate(batches):
        if dist.is_initialized():
            dist.barrier()
        sync(device)
        t = time.perf_counter()
        step(b)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def print_report(tables: list, record: dict, width: int | None = None) -> None:
    """The bench's rich tables, then its record as one JSON line: the last line of stdout, which
    scripts and tests read (`json.loads(out.splitlines()[-1])`)."""
    from rich.console import Console  # here: the benches that time start-up import nothing they do not print

    console = Console(width=width) if width else Console()
    for table in tables:
        console.print(table)
    print(json.dumps(record), flush=True)


def torch_step(
    model: torch.nn.Module,
    forward: Callable,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable,
    masters: list[torch.Tensor] | None = None,
) -> Callable:
    """A plain torch training step, the peer graphfuse is measured against: `loss_fn(forward,
    batch).backward()` and `optimizer.step()`; with `masters` (fp32 copies of bf16 parameters,
    which the optimizer updates) the gradients are copied into them and their values back."""

    def step(batch):
        loss = loss_fn(forward, batch)
        loss.backward()
        if masters is not None:
            for p, m in zip(model.parameters(), masters, strict=True):
                m.grad = p.grad.float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if masters is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
        return loss.detach()

    return step


def gpt2_small_args(ap) -> None:
    """The GPT's shape and batch as options (--layers --embd --heads --batch --block --vocab),
    GPT-2 small with batch 8 x 1024 by default: the shape the GPU benches compare at."""
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
