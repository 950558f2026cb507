"""`GraphfuseTrainer`: Hugging Face's `Trainer` with graphfuse as its data parallelism: the optimizer
(Trainer's own, or the one passed in `optimizers`) sharded over the placed model, no DDP, the model
compiled with backend="graphfuse" on request, clipping and the logged `grad_norm` by the global norm
across shards, and checkpoints written and resumed by gf.save/gf.load on every rank."""

from __future__ import annotations

import os
from typing import TypeVar

import torch
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from graphfuse.checkpoint import load, save
from graphfuse.errors import UnsupportedError
from graphfuse.frontends.sharded_optimizer import ShardedOptimizer
from graphfuse.integrations.accelerate import install, place, prepare_model, prepare_optimizer, shard, sharded_of
from graphfuse.strategy import Strategy

STATE_DIR = "graphfuse"  # in each checkpoint-<step>: the optimizer state and weights, balanced (any world size)
T = TypeVar("T")
COMPILE_BACKENDS = (None, "graphfuse", "inductor")  # TrainingArguments fills in "inductor" for torch_compile=True


class GraphfuseTrainer(Trainer):
    """`Trainer` whose data parallelism is graphfuse's ZeRO-1, at any number of ranks (torchrun).

    `strategy`: the gf.Strategy of the sharded optimizer. `compile`: compile the model with
    `model.compile(backend="graphfuse")`, whose backward reduce-scatters the gradients (default:
    `args.torch_compile`). Everything else is Trainer's: `max_grad_norm` clips by the global norm
    across shards (logged as `grad_norm`), and `resume_from_checkpoint` resumes at the same or
    another world size from the checkpoint's `graphfuse` directory, written by every rank.
    """

    def __init__(self, *args, strategy: Strategy | None = None, compile: bool | None = None, **kwargs) -> None:
        self.strategy = strategy
        self._compile = compile
        super().__init__(*args, **kwargs)
        if self.args.fp16:
            raise UnsupportedError(
                "GraphfuseTrainer: fp16 needs a GradScaler, whose step skipped for an overflow on one rank only would "
                "leave the others waiting in the sharded optimizer's collectives; train with bf16=True"
            )
        if self._compile is None:
            self._compile = self.args.torch_compile
        if self._compile and self.args.torch_compile_backend not in COMPILE_BACKENDS:
            raise UnsupportedError(
                f"GraphfuseTrainer compiles with backend='graphfuse', not torch_compile_backend="
                f"{self.args.torch_compile_backend!r}; leave it unset, or set compile=False"
            )

    @property
    def sharded_optimizer(self) -> ShardedOptimizer | None:
        """The gf.shard_optimizer under Trainer's `optimizer` (None before training starts)."""
        return sharded_of(self.optimizer)

    def _build_accelerator_args(self, **kwargs) -> dict:
        # accelerate knows no backend "graphfuse" (it refuses the name), and must not compile the model
        # itself: graphfuse compiles it in create_optimizer, once its optimizer owns the parameters.
        backend, self.args.torch_compile_backend = self.args.torch_compile_backend, "no"
        try:
            return super()._build_accelerator_args(**kwargs)
        finally:
            self.args.torch_compile_backend = backend

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        place(model, device)  # "cpu:0" copies a model on "cpu", and the optimizer's buckets would stay behind

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Trainer's optimizer (or the one passed in `optimizers`), sharded over the placed model and
        wrapped by accelerate without its state_dict round trip; the model compiled if asked. Called
        again (a second train()), each step finds its work done."""
        placed = _made(self.model, "model (pass model= or model_init=)")
        sharded = shard(super().create_optimizer(model), placed, self.strategy)
        if self._compile and getattr(placed, "_compiled_call_impl", None) is None:
            placed.compile(backend="graphfuse")  # in place: Trainer still reads forward's signature
        self.optimizer = prepare_optimizer(self.accelerator, sharded)
        install(self.accelerator)  # Trainer clips, and norms what it logs, with accelerator.clip_grad_norm_
        return self.optimizer

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader=None) -> torch.nn.Module:
        if self.args.n_gpu > 1:
            raise UnsupportedError(
                f"GraphfuseTrainer: this process sees {self.args.n_gpu} GPUs and Trainer would wrap the model in "
                "nn.DataParallel; launch one process per GPU (torchrun --nproc-per-node N)"
            )
        return prepare_model(self.accelerator, model)  # marked prepared: Trainer's accelerator.prepare adds no DDP

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(
            _made(self.sharded_optimizer, "optimizer"), os.path.join(output_dir, STATE_DIR), mode="balanced"
        )  # every rank
        if self.args.should_save:
            torch.save(_made(self.lr_scheduler, "lr_scheduler").state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """graphfuse's checkpoint (any world size), or a plain Trainer's optimizer.pt (torch.optim's form)."""
        if checkpoint is None:
            return
        optimizer = _made(self.sharded_optimizer, "optimizer")
        if os.path.isdir(os.path.join(checkpoint, STATE_DIR)):
            load(optimizer, os.path.join(checkpoint, STATE_DIR))
        elif os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
            optimizer.load_state_dict(state)
        else:
            return
        if os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
            scheduler = _made(self.lr_scheduler, "lr_scheduler")
            scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _made(value: T | None, what: str) -> T:
    """`value`, which Trainer sets before it saves, loads or builds the optimizer."""
    if value is None:
        raise UnsupportedError(
            f"GraphfuseTrainer: no {what} yet; Trainer makes it in train() (create_optimizer_and_scheduler) "
            "before it saves or resumes a checkpoint: call train() rather than these methods directly"
        )
    return value
