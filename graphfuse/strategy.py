"""`Strategy`: the single configuration object of graphfuse."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from graphfuse.errors import UnsupportedError

CheckpointMode = Literal["unbalanced", "balanced"]
CompileMode = Literal["eager", "inductor"]
MASTER_DTYPES = (None, torch.float32)
# Collectives in flight per backend when Strategy.max_inflight_collectives is "auto". Gloo
# crashed (SIGSEGV, heap corruption, livelock) with several collectives in flight on torch
# 2.13, also at 2 (issue 11; docs/gloo-inflight.md); one at a time still overlaps compute.
# NCCL overlaps freely.
INFLIGHT_BY_BACKEND: dict[str, int | None] = {"gloo": 1, "nccl": None}


@dataclass(frozen=True)
class Strategy:
    """How a training step is fused, sharded, checkpointed and executed.

    The defaults follow PaddlePaddle's sharding stage 1 with tensor fusion, except that
    alignment is counted in bytes and buckets follow the order of the backward pass.
    """

    bucket_size_mb: float = 256.0
    """Cap on a bucket's padded size in MiB (Paddle: comm_buffer_size_MB); a larger parameter gets
    a bucket of its own."""
    align_bytes: int = 256
    """Every parameter starts on this byte boundary in its bucket (a power of two); padding is zero."""
    checkpoint_mode: CheckpointMode = "unbalanced"
    """The default mode of gf.save and state_dict: "unbalanced" (each rank's fused shards, same world size
    and layout only) or "balanced" (every parameter in its own shape: any world size, plain PyTorch)."""
    overlap: bool = True
    """Issue each collective as soon as its input exists and wait for it as late as possible (passes/overlap.py)."""
    master_dtype: torch.dtype | None = None
    """torch.float32: fp32 master shards for bf16/fp16 parameters (gradients averaged in fp32); None: none."""
    grad_accumulation: int = 1
    """Micro-batches per step in gf.compile (the batch's leading dimension is split); gradients reduced once."""
    max_grad_norm: float | None = None
    """Clip gradients by their global norm across shards (as torch.nn.utils.clip_grad_norm_); the norm
    before clipping is then DistModel.grad_norm. None: no clipping."""
    compile: CompileMode = "eager"
    """How the program runs: "eager" (the FX graph as it is, bitwise with eager PyTorch where the math is
    the same) or "inductor" (compiled, writing buckets and shards in place)."""
    max_inflight_collectives: int | None | Literal["auto"] = "auto"
    """At most this many collectives issued and not yet waited for (the overlap pass waits for the oldest
    earlier when a new one would exceed it); None: no bound. "auto": chosen by the runtime from the process
    group's backend (INFLIGHT_BY_BACKEND); a program built without a runtime keeps no bound."""
    program_cache_size: int = 8
    """Programs traced for distinct batch keys (shapes, dtypes, non-tensor leaf values) kept at once, least
    recently used dropped first, with a warning."""
    stage_collectives_on_host: bool | Literal["auto"] = "auto"
    """Copy each collective's input to the host and its result back (passes/stage_on_host.py). "auto": on
    for a Gloo group over CUDA tensors (ranks sharing one GPU, where NCCL refuses two ranks and Gloo's
    functional collectives on CUDA tensors crashed on torch 2.11), off otherwise and without a runtime."""
    overlap_param_gather: bool | Literal["auto"] = False
    """Defer each bucket's parameter all-gather to the head of the next step, waited for just before the
    bucket's first use in the forward (passes/defer_gather.py): the step ends with the updated shards and
    the model's views of other ranks' shards are one step old until `DistModel.sync()`. "auto": on for NCCL
    (collectives overlap compute), off for Gloo (one collective in flight: the gathers would run back to
    back at the head) and without a runtime. Default False until GPU measurements (docs/benchmarks.md) decide."""
    fuse_loss: bool = False
    """Compute the output projection and the cross-entropy a chunk of tokens at a time (passes/fuse_loss.py)
    where the step shows them (mm by a parameter, optional cast, log_softmax + nll_loss, mean or sum, no class
    weights): the full [tokens, vocab] logits and their fp32 copy never exist, and the head weight's and the
    hidden states' gradients are made chunk by chunk. The loss and the hidden states' gradient are the unfused
    step's to the bit on CPU; the head weight's gradient is summed over chunks in another order (docs/design.md
    gives the measured difference). Off: the eager program then stays bitwise with eager PyTorch."""
    loss_chunk_tokens: int | Literal["auto"] = "auto"
    """Tokens per chunk of fuse_loss. "auto": tokens / ceil(vocab / hidden size), rounded up to a multiple
    of 8, so that a chunk's logits are about as large as the hidden states (Liger-Kernel's rule)."""
    cuda_graphs: bool = False
    """Experimental: replay the whole inductor-compiled step from one CUDA graph per traced batch key
    (graphfuse/compiler/cuda_graph.py), for steps bound by kernel launches (small models). Needs compile="inductor",
    the model on one CUDA device and, above one rank, an NCCL group."""
    align_buckets_to_blocks: bool | Literal["auto"] = False
    """Give each repeated block (the first numbered module of an FQN, e.g. transformer layer "h.3") buckets
    of its own, split by bucket_size_mb where larger: identical blocks then lie at identical bucket offsets
    and inductor compiles their kernels once instead of once per block (graphfuse/ir/layout.py). More buckets.
    "auto": only blocks that repeat and hold at least 1 MiB (graphfuse/ir/blocks.py). Off: on one H200 it did
    not shorten the start and made the step 6% slower (GPT-2 small, 25 MB buckets, one run); it pays when
    compiling on few CPU cores (docs/benchmarks.md)."""
    compile_workers: int | Literal["auto"] = "auto"
    """Processes besides this one that compile the step with inductor at the first step: the step is cut
    into compile_workers + 1 pieces (graphfuse/compiler/pieces.py), compiled at once and handed over through
    inductor's on-disk caches (graphfuse/compiler/workers.py). 0: one graph, compiled here. An int > 0 needs
    compile="inductor". "auto": by the cores of this rank's share of the host, with inductor on CUDA only
    (compile_workers.how_many: 3 with 16 cores a rank, 1 with 8, 0 with 4 or on the CPU), chosen again in
    every process that compiles, also from a program file. Pieces are fused apart at their cuts: the step
    is close to, not bitwise with, the one compiled whole; 0 gives one graph on every machine."""

    def __post_init__(self) -> None:
        if not self.bucket_size_mb > 0:
            raise UnsupportedError(f"Strategy.bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        a = self.align_bytes
        if not isinstance(a, int) or a <= 0 or a & (a - 1):
            raise UnsupportedError(f"Strategy.align_bytes must be a power of two, got {a!r}")
        if self.checkpoint_mode not in get_args(CheckpointMode):
            raise UnsupportedError(
                f"Strategy.checkpoint_mode={self.checkpoint_mode!r}; choose one of {get_args(CheckpointMode)}"
            )
        if self.master_dtype not in MASTER_DTYPES:
            raise UnsupportedError(f"Strategy.master_dtype={self.master_dtype!r}; use None or torch.float32")
        if not isinstance(self.grad_accumulation, int) or self.grad_accumulation < 1:
            raise UnsupportedError(f"Strategy.grad_accumulation must be an int >= 1, got {self.grad_accumulation!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise UnsupportedError(f"Strategy.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.compile not in get_args(CompileMode):
            raise UnsupportedError(f"Strategy.compile={self.compile!r}; choose one of {get_args(CompileMode)}")
        k = self.max_inflight_collectives
        if not (k is None or k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and k >= 1)):
            raise UnsupportedError(f"Strategy.max_inflight_collectives must be an int >= 1, None or 'auto', got {k!r}")

        if self.stage_collectives_on_host not in (True, False, "auto"):
            raise UnsupportedError(
                f"Strategy.stage_collectives_on_host must be True, False or 'auto', got "
                f"{self.stage_collectives_on_host!r}"
            )
        if self.overlap_param_gather not in (True, False, "auto"):
            raise UnsupportedError(
                f"Strategy.overlap_param_gather must be True, False or 'auto', got {self.overlap_param_gather!r}"
            )
        if not (isinstance(self.align_buckets_to_blocks, bool) or self.align_buckets_to_blocks == "auto"):
            raise UnsupportedError(
                f"Strategy.align_buckets_to_blocks must be True, False or 'auto', got {self.align_buckets_to_blocks!r}"
            )
        if not isinstance(self.fuse_loss, bool):
            raise UnsupportedError(f"Strategy.fuse_loss must be True or False, got {self.fuse_loss!r}")
        c = self.loss_chunk_tokens
        if c != "auto" and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise UnsupportedError(f"Strategy.loss_chunk_tokens must be an int >= 1 or 'auto', got {c!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise UnsupportedError(f"Strategy.cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.cuda_graphs and self.compile != "inductor":
            raise UnsupportedError(
                f"Strategy.cuda_graphs=True replays the inductor-compiled step, but compile={self.compile!r}; "
                "set compile='inductor', or cuda_graphs=False"
            )
        w = self.compile_workers
        if w != "auto" and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise UnsupportedError(f"Strategy.compile_workers must be an int >= 0 or 'auto', got {w!r}")
        if w != "auto" and w and self.compile != "inductor":
            raise UnsupportedError(
                f"Strategy.compile_workers={w} compiles the step with inductor in several processes, but "
                f"compile={self.compile!r}; set compile='inductor', or compile_workers=0"
            )
        if not isinstance(self.program_cache_size, int) or self.program_cache_size < 1:
            raise UnsupportedError(f"Strategy.program_cache_size must be an int >= 1, got {self.program_cache_size!r}")

    def for_backend(self, backend: str | None, device_type: str = "cpu") -> Strategy:
        """This strategy with "auto" settings resolved for a process group of `backend`
        (None: no process group) over tensors of `device_type`."""
        resolved = self
        if self.max_inflight_collectives == "auto":
            bound = INFLIGHT_BY_BACKEND.get(backend) if backend else None
            resolved = dataclasses.replace(resolved, max_inflight_collectives=bound)
        if self.stage_collectives_on_host == "auto":
            stage = backend == "gloo" and device_type != "cpu"
            resolved = dataclasses.replace(resolved, stage_collectives_on_host=stage)
        if self.overlap_param_gather == "auto":
            resolved = dataclasses.replace(resolved, overlap_param_gather=backend == "nccl")
        return resolved

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * 2**20)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["master_dtype"] = None if self.master_dtype is None else str(self.master_dtype).removeprefix("torch.")
        return d

    @classmethod
    def from_json(cls, d: dict) -> Strategy:
        d = dict(d)
        if d.get("master_dtype") is not None:
            d["master_dtype"] = getattr(torch, d["master_dtype"])
        return cls(**d)
