"""Gradients in any memory layout pack into the buckets (issue 13, defect 2): a ConvNeXt-like
downsampling conv in channels_last gets its weight gradient from convolution_backward in
channels_last strides, and the step stays bitwise equal to eager torch.optim at 1 rank."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.capture.test_capture import adamw, run_bitwise


class DownsamplingConvNet(nn.Module):
    """A stem, a ConvNeXt-style downsampling conv (kernel 2, stride 2) and a depthwise conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 4, stride=4)
        self.down = nn.Conv2d(8, 16, 2, stride=2)
        self.dw = nn.Conv2d(16, 16, 7, padding=3, groups=16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dw(self.down(F.gelu(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


def channels_last_model() -> nn.Module:
    return DownsamplingConvNet().to(memory_format=torch.channels_last)


def channels_last_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 4, (2,), generator=g)) for _ in range(steps)]


def test_channels_last_weight_gradients_are_channels_last_in_eager():
    """The premise: eager autograd hands back channels_last (non-contiguous) conv weight gradients."""
    model = channels_last_model()
    channels_last_loss(model, batches(1)[0]).backward()
    assert not model.down.weight.grad.is_contiguous()
    assert model.down.weight.grad.is_contiguous(memory_format=torch.channels_last)


def test_channels_last_conv_model_trains_bitwise_like_eager():
    run_bitwise(channels_last_model, adamw, channels_last_loss, batches(4))
