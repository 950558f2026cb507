"""graphfuse in a plain accelerate loop: `prepare(accelerator, model, optimizer, ...)` in place of
`accelerator.prepare`. The model is placed before the optimizer's buckets bind it and kept out of DDP
(graphfuse's optimizer averages the gradients); `accelerator.clip_grad_norm_` gives the global norm
across shards, and `save_state` writes every weight."""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import torch
from accelerate import Accelerator
from accelerate.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME, DistributedType
from safetensors.torch import load_file
from torch.nn.modules.module import _IncompatibleKeys

from graphfuse.errors import UnsupportedError
from graphfuse.frontends.sharded_optimizer import ShardedOptimizer, shard_optimizer
from graphfuse.strategy import Strategy

_MODELS: weakref.WeakSet = weakref.WeakSet()  # models whose parameters are views into a sharded optimizer's buckets
_OTHERS = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)


def sharded_of(optimizer) -> ShardedOptimizer | None:
    """The ShardedOptimizer `optimizer` is, or wraps (accelerate's AcceleratedOptimizer), or None."""
    while optimizer is not None and not isinstance(optimizer, ShardedOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def place(model: torch.nn.Module, device: torch.device | str) -> None:
    """Move `model` to `device` unless it is there. `cpu` and `cpu:0` are one device, yet `.to("cpu:0")`
    copies every parameter, which after gf.shard_optimizer would leave the buckets behind."""
    device = torch.device(device)

    def there(t: torch.Tensor) -> bool:
        return t.device.type == device.type and (device.type == "cpu" or device.index in (None, t.device.index))

    if not all(there(t) for t in (*model.parameters(), *model.buffers())):
        model.to(device)


def shard(optimizer: torch.optim.Optimizer, model: torch.nn.Module, strategy: Strategy | None) -> ShardedOptimizer:
    """`optimizer` sharded over `model`'s parameters; one already sharded is checked instead (a
    model moved after it was built is refused here, naming the way out, not at the first step)."""
    sharded = sharded_of(optimizer)
    if sharded is None:
        return shard_optimizer(optimizer, strategy, model=model)
    sharded._snapshot.check()
    return sharded


def prepare_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """accelerate's preparation of `model` less the move and the DDP wrapper (mixed-precision autocast
    stays): graphfuse's optimizer averages the gradients, a DDP would reduce them a second time."""
    _MODELS.add(model)
    if getattr(model, "_is_accelerate_prepared", False):
        return model
    if accelerator.state.dynamo_plugin.backend.value != "NO":
        raise UnsupportedError(
            f"the Accelerator compiles models with "
            f"dynamo_backend={accelerator.state.dynamo_plugin.backend.value.lower()}; "
            "graphfuse compiles its model itself: build the Accelerator without dynamo_backend and pass compile=True"
        )
    return accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)


def prepare_optimizer(accelerator: Accelerator, sharded: ShardedOptimizer):
    """accelerate's optimizer wrapper around `sharded`, without its device placement (a state_dict
    round trip, a collective on every rank for nothing), marked prepared so `prepare` keeps it."""
    for opt in accelerator._optimizers:
        if sharded_of(opt) is sharded:
            return opt
    opt = accelerator.prepare_optimizer(sharded, device_placement=False)
    opt._is_accelerate_prepared = True
    return opt


def whole_weights(state_dict: dict) -> OrderedDict:
    """A copy of a model's `state_dict` whose tensors share memory only where they are one tensor
    (tied parameters), not merely views into one bucket, which safetensors writers take for tied
    weights and keep one of."""
    copies: dict = {}
    out = OrderedDict()
    for name, t in state_dict.items():
        if isinstance(t, torch.Tensor):
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            t = copies.setdefault(key, t.detach().clone())
        out[name] = t
    return out


def _save_whole_weights(models: list, weights: list, output_dir: str) -> None:
    """accelerate's save_state pre-hook: each graphfuse model's weights, every one of them."""
    for i, (model, sd) in enumerate(zip(models, weights)):
        if model in _MODELS:
            weights[i] = whole_weights(sd)


class _Loaded(torch.nn.Module):
    """Stands in, in load_state's list, for a graphfuse model the pre-hook loaded: accelerate's own
    loader (safetensors' load_model) refuses parameters that share one bucket's storage."""

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return _IncompatibleKeys([], [])


def load_whole_weights(model: torch.nn.Module, path: str) -> None:
    """Load a weights file save_state wrote (safetensors or torch) into `model` in place; a key
    left out may only be a tied alias of one loaded."""
    sd = load_file(path) if path.endswith(".safetensors") else torch.load(path, map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    live = model.state_dict()
    loaded = {(live[k].data_ptr(), live[k].shape, live[k].stride()) for k in sd if k in live}
    untied = [k for k in missing if (live[k].data_ptr(), live[k].shape, live[k].stride()) not in loaded]
    if untied or unexpected:
        raise UnsupportedError(f"{path} does not fit the model: missing {untied}, unexpected {list(unexpected)}")


def _load_whole_weights(models: list, input_dir: str) -> None:
    """accelerate's load_state pre-hook: each graphfuse model loaded here, in place."""
    for i, model in enumerate(models):
        if model not in _MODELS:
            continue
        names = [n if i == 0 else n.replace(".", f"_{i}.") for n in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME)]
        found = [os.path.join(input_dir, n) for n in names if os.path.isfile(os.path.join(input_dir, n))]
        if not found:
            raise UnsupportedError(f"accelerator.load_state: no {' or '.join(names)} in {input_dir} for model {i}")
        load_whole_weights(model, found[0])
        models[i] = _Loaded()


def _routed_clip(accelerator: Accelerator, original):
    """`accelerator.clip_grad_norm_` that, for a sharded optimizer's parameters, clips the averaged
    gradient shards by their global norm (ShardedOptimizer.clip_grad_norm_): a parameter's own .grad
    is this rank's unreduced gradient, or None on the graphfuse backend's path."""

    def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0):
        params = list(parameters)
        given = {id(p) for p in params}
        for opt in accelerator._optimizers:
            sharded = sharded_of(opt)
            if sharded is None:
                continue
            own = {id(p) for p in sharded.params.values() if p.requires_grad}
            if not own & given:
                continue
            if own - given:
                raise UnsupportedError(
                    "accelerator.clip_grad_norm_ was given part of a graphfuse optimizer's parameters; it clips by the "
                    "global norm of all of them across shards: pass model.parameters()"
                )
            return sharded.clip_grad_norm_(max_norm, norm_type)
        return original(params, max_norm, norm_type)

    return clip_grad_norm_


_installed: weakref.WeakSet[Accelerator] = weakref.WeakSet()  # the Accelerators install() routed


def install(accelerator: Accelerator) -> None:
    """Route `accelerator.clip_grad_norm_` and hook `save_state`, once per Accelerator."""
    if accelerator not in _installed:
        _installed.add(accelerator)
        accelerator.clip_grad_norm_ = _routed_clip(accelerator, accelerator.clip_grad_norm_)
        accelerator.register_save_state_pre_hook(_save_whole_weights)
        accelerator.register_load_state_pre_hook(_load_whole_weights)


def prepare(accelerator: Accelerator, *objects, strategy: Strategy | None = None, compile: bool = False):
    """`accelerator.prepare(*objects)` with graphfuse as the data parallelism: `objects` hold one
    model and its optimizer (plain, or from gf.shard_optimizer) and any data loaders and schedulers,
    returned prepared in the same order. The model is moved to `accelerator.device` first, the
    optimizer sharded over it (`strategy`), the model compiled with backend="graphfuse" if
    `compile`. Afterwards `accelerator.backward`, `accelerator.clip_grad_norm_(model.parameters(),
    ...)` (the global norm, a collective), `save_state` and `load_state` work as usual."""
    if accelerator.distributed_type in _OTHERS:
        raise UnsupportedError(
            f"graphfuse.integrations.accelerate.prepare: the Accelerator runs {accelerator.distributed_type.value}, "
            "another data parallelism; graphfuse is ZeRO-1 data parallelism itself: launch without DeepSpeed, "
            "FSDP or XLA"
        )
    models = [o for o in objects if isinstance(o, torch.nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if len(models) != 1 or len(optimizers) != 1:
        raise UnsupportedError(
            f"graphfuse.integrations.accelerate.prepare: pass one model and its optimizer (got {len(models)} models "
            f"and {len(optimizers)} optimizers), then any data loaders and schedulers"
        )
    (model,), (optimizer,) = models, optimizers
    place(model, accelerator.device)
    sharded = shard(optimizer, model, strategy)
    if compile and getattr(model, "_compiled_call_impl", None) is None:
        model.compile(backend="graphfuse")
    done = {id(model): prepare_model(accelerator, model), id(optimizer): prepare_optimizer(accelerator, sharded)}
    install(accelerator)
    return accelerator.prepare(*(done.get(id(o), o) for o in objects))
