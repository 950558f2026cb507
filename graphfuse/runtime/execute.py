"""Running a program: bind its buckets and shards, fill the host scalars, call it, write its
outputs back in place. The one runtime that `DistModel` and the `ShardedOptimizer` share."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist

from graphfuse import optim as gopt
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program
from graphfuse.ir.state_plan import MASTER
from graphfuse.passes.graph import is_collective
from graphfuse.ranks import backend_of as backend_of  # moved to ranks.py; importers here keep working
from graphfuse.ranks import group_info as group_info
from graphfuse.runtime.param_state import destination


def rebind_group(program: Program, group_name: str) -> Program:
    """The same program with its collectives on the process group named `group_name` (a
    restarted job's group may be named differently from the one the program was built on)."""
    gm = torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph))
    for node in gm.graph.nodes:
        if is_collective(node):
            node.args = tuple(group_name if a == program.group_name else a for a in node.args)
    gm.recompile()
    return program.with_(graph_module=gm, group_name=group_name)


def bind_tensors(
    program: Program,
    params: dict[str, torch.nn.Parameter],
    buffers: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    scalar_device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Allocate the program's buckets and shards, fill them from `params`, and point every
    parameter at its view in its bucket. Returns every persistent input by name. The host
    scalars are 0-d CPU tensors, or 0-d tensors on `scalar_device` for a step replayed from a
    CUDA graph (Strategy.cuda_graphs), which would bake a CPU scalar's value in at capture."""
    layout, tensors = program.bucket_layout, {}
    buckets = {b.name: b for b in layout.buckets}
    with torch.no_grad():
        for bucket in layout.buckets:
            device = params[bucket.slots[0].fqn].device
            flat = torch.zeros(bucket.size, dtype=getattr(torch, bucket.dtype), device=device)
            for s in bucket.slots:
                flat[slice(*s.data_range)].copy_(params[s.fqn].detach().reshape(-1))
            if layout.world_size > 1:  # every rank starts from rank 0's weights, as DDP does
                dist.broadcast(flat, group=group, group_src=0)
            for s in bucket.slots:
                params[s.fqn].data = flat[slice(*s.data_range)].view(s.shape)
            tensors[bucket.name] = flat
        for spec in program.signature.inputs:
            m = program.inputs_meta[spec.name]
            dtype = getattr(torch, m.dtype)
            if spec.role == sig.SHARD:
                bucket_name, what = spec.name.split(".", 1)
                flat = tensors[bucket_name]
                if what == MASTER:
                    lo, hi = buckets[bucket_name].shard_range(program.rank)
                    tensors[spec.name] = flat[lo:hi].to(dtype, copy=True)
                else:
                    tensors[spec.name] = torch.zeros(m.shape, dtype=dtype, device=flat.device)
            elif spec.role == sig.FROZEN:
                tensors[spec.name] = params[spec.name].detach()
            elif spec.role == sig.BUFFER:
                tensors[spec.name] = buffers[spec.name]
            elif spec.role == sig.SCALAR:
                tensors[spec.name] = torch.zeros((), dtype=dtype, device=scalar_device)
    return tensors


def arguments(program: Program, tensors: dict[str, torch.Tensor], per_call: list[torch.Tensor]) -> list[torch.Tensor]:
    """The program's inputs in order: persistent tensors by name, and the per-call tensors
    (batch leaves, or gradients for an update-only program) in their order."""
    it = iter(per_call)
    return [next(it) if spec.role in (sig.BATCH, sig.GRAD) else tensors[spec.name] for spec in program.signature.inputs]


def run_step(
    program: Program,
    fn: Callable,
    tensors: dict[str, torch.Tensor],
    param_groups: list[dict],
    steps: list[int],
    carried: list[dict[str, float]],
    per_call: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Fill the host scalars of step `steps` (from each group's lr and what the previous step
    `carried`), run the program, copy every output into the input it replaces, and replace
    `carried[g]` by what this step leaves for the next (ASGD's eta). All outputs exist before
    any state is written: a failed step changes nothing. Returns the outputs written back
    nowhere (the loss, then the gradient norm if the program clips), in signature order."""
    for g, (spec, group) in enumerate(zip(program.optim.groups, param_groups)):
        gopt.check_group_unchanged(spec, group, g)  # all groups first: a refused step writes nothing
    hyper = [(float(group["lr"]), float(group.get("weight_decay", 0.0))) for group in param_groups]
    for g, spec in enumerate(program.optim.groups):
        for name, value in spec.host_scalars(*hyper[g], steps[g], carried[g]).items():
            tensors[f"group{g}.{name}"].fill_(value)
    # Grad mode on, as the step was traced: some kernels differ with it off (oneDNN's LSTM,
    # mkldnn_rnn_layer, returns no workspace for its backward). No input requires grad, so
    # autograd records nothing.
    with torch.enable_grad():
        outs = fn(*arguments(program, tensors, per_call))
    if not getattr(fn, "writes_in_place", False):
        with torch.no_grad():
            for output, out in zip(program.signature.outputs, outs):
                if output.target is not None:
                    destination(program, tensors, output).copy_(out)
        outs = [out for output, out in zip(program.signature.outputs, outs) if output.target is None]
    carried[:] = [spec.carried_after(*hyper[g], steps[g]) for g, spec in enumerate(program.optim.groups)]
    return outs


def refresh_masters(program: Program, tensors: dict[str, torch.Tensor], fqns: set[str]) -> None:
    """Copy the weights of `fqns` into this rank's fp32 master shards (weights loaded by a plain
    model.load_state_dict, which the update would otherwise overwrite from the old masters)."""
    with torch.no_grad():
        for bucket in program.bucket_layout.buckets:
            master = tensors.get(f"{bucket.name}.{MASTER}")
            if master is None:
                continue
            for s in bucket.slices(program.rank):
                if s.fqn in fqns:
                    master[slice(*s.shard_range)].copy_(
                        tensors[bucket.name][slice(*bucket.bucket_range(program.rank, s))]
                    )
