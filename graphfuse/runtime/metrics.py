"""What a trainer logs after each step, read from a DistModel without a synchronisation of its
own: `dm.metrics` (a `StepMetrics`) and `dm.grad_norm`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepMetrics:
    """One step's numbers. Times are the host's: the time between this step's call and the
    previous one's, which in a steady loop is the step time (a CUDA host runs at most a few
    steps ahead of the device); nothing here waits for the device. `grad_norm` is a tensor
    (reading its value with .item() waits for the step), None without Strategy.max_grad_norm."""

    step: int
    step_time_s: float | None  # None at the first step (it includes the compile)
    samples: int | None  # the first batch leaf's leading size
    tokens: int | None  # elements of the first integer batch leaf (token ids), None without one
    tokens_per_s: float | None
    peak_memory_bytes: int | None  # torch.cuda.max_memory_allocated() on CUDA, None on CPU
    grad_norm: torch.Tensor | None

    def as_dict(self) -> dict:
        """Plain numbers for a logger (the norm read with .item(), which waits for the step)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "grad_norm"}
        out["grad_norm"] = None if self.grad_norm is None else self.grad_norm.item()
        return out


def measure(
    step: int, called: float, previous: float | None, leaves: list, grad_norm: torch.Tensor | None
) -> StepMetrics:
    """The metrics of the step called at `called` (perf_counter), after one called at `previous`."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    samples = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else None
    ids = next((x for x in tensors if not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool), None)
    tokens = None if ids is None else ids.numel()
    elapsed = None if previous is None else called - previous
    on_cuda = any(x.is_cuda for x in tensors)
    return StepMetrics(
        step=step,
        step_time_s=elapsed,
        samples=samples,
        tokens=tokens,
        tokens_per_s=None if tokens is None or not elapsed else tokens / elapsed,
        peak_memory_bytes=torch.cuda.max_memory_allocated() if on_cuda else None,
        grad_norm=grad_norm,
    )


__all__ = ["StepMetrics", "measure"]
