"""Sharded update: replace the per-parameter optimizer update with ONE fused elementwise
update per bucket shard, over flat state shards (and fp32 master shards where the strategy
asks). Each parameter's part of a shard is its `slice@<fqn>` view (see BucketLayout.slices).
A group whose update reads each parameter whole (Muon, Adafactor) runs it once per parameter the
rank owns; a state not shaped like its parameter (Adafactor's factors) has a shard laid out
apart (Program.state_layout).
Reads the `grad_shards` hand-off; hands on `param_shards` (the updated shard in the bucket's
dtype) for the all-gather."""

from __future__ import annotations

import torch

from graphfuse import optim as gopt
from graphfuse.capture.tracing import dtype_name, reads_whole, update_function
from graphfuse.errors import GraphfuseError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program, TensorMeta
from graphfuse.ir.state_plan import MASTER

from ._contract import always, expect
from .graph import (
    add_input,
    aten,
    call,
    eliminate_dead_code,
    inline,
    input_nodes,
    outputs,
    placeholders,
    remove_input,
    set_outputs,
    sync_inputs,
)

NAME = "sharded_update"
NEEDS = ("grad_shards",)
PROVIDES = ("param_shards",)


applies = always  # every program


def requires(program: Program) -> None:
    expect(program, NAME, not program.signature.names(sig.SHARD), "no state shard inputs yet")


def shard_dtype(program: Program, bucket) -> str:
    m = program.strategy.master_dtype
    return bucket.dtype if m is None else dtype_name(m)


def uses_master(program: Program, bucket) -> bool:
    return shard_dtype(program, bucket) != bucket.dtype


def whole_update_function(spec: gopt.GroupSpec, bucket, rank: int, batched: bool = False, states=None):
    """The update of rank `rank`'s shard of a bucket laid out whole (graphfuse.ir.ownership):
    `gopt.update` of each parameter the rank owns, on its whole-matrix views of the shard, with
    the padding passed through; `fn(param, grad, *states, *scalars) -> [new param, *new states]`.
    `states` (name -> the layout of its shard, Program.state_layout; by default every state of
    the group, shaped like the bucket) says where each member's state lies: a state not shaped
    like its parameter (Adafactor's row and column factors) has a layout of its own.
    `batched` (CUDA): an update that takes stacks (`gopt.takes_stacks`: Muon's) runs once per
    stack of same-shape matrices instead (`stacked_update_function`)."""
    slices = bucket.slices(rank)
    for s in slices:
        slot = bucket.slot(s.fqn)
        if s.param_start != 0 or s.numel != slot.numel:
            raise GraphfuseError(
                f"{bucket.name}: rank {rank}'s shard holds elements [{s.param_start}, {s.param_start + s.numel}) of "
                f"{s.fqn} (of {slot.numel}), but its {spec.kind} update reads the parameter whole; plan the layout "
                "with graphfuse.ir.layout.plan_buckets(whole=...)"
            )
    if batched and gopt.takes_stacks(spec):
        return stacked_update_function(spec, bucket, rank)
    layouts = dict.fromkeys(spec.state_names, bucket) if states is None else states
    names = tuple(layouts)

    def fn(p, g, *rest):
        flats = dict(zip(names, rest[: len(names)]))
        scalars = dict(zip(spec.scalar_names, rest[len(names) :]))
        done: dict[str, list[tuple[int, int, torch.Tensor]]] = {"param": [], **{n: [] for n in names}}
        for s in slices:

            def view(t, layout, s=s):
                slot = layout.slot(s.fqn)
                lo = slot.offset - layout.shard_range(rank)[0]
                return lo, lo + slot.numel, t[lo : lo + slot.numel].view(slot.shape)

            mine = [n for n in names if s.fqn in layouts[n].fqns]
            at = {n: view(flats[n], layouts[n]) for n in mine}
            new_p, new = gopt.update(spec, view(p, bucket)[2], view(g, bucket)[2], {n: at[n][2] for n in mine}, scalars)
            done["param"].append((s.shard_start, s.shard_end, new_p.reshape(-1)))
            for n in mine:
                done[n].append((at[n][0], at[n][1], new[n].reshape(-1)))
        return [_cover(p, done["param"])] + [_cover(flats[n], done[n]) for n in names]

    return fn


def stacked_update_function(spec: gopt.GroupSpec, bucket, rank: int):
    """Muon's update of rank `rank`'s shard as CUDA runs it: Newton-Schulz once per stack, a
    (k, m, n) view of the shard holding k same-shape matrices that lie next to each other
    (plan_buckets keeps a rank's same-shape members together), as batched products (not bitwise
    with one matrix at a time: other products and roundings, graphfuse/optim/matrix.py). The
    momentum and the new parameter are each one elementwise expression over the whole shard,
    reading the old shard at the element it writes, so inductor writes them in place, in one
    kernel each (a cat of new pieces would be copied); `fn(param, grad, momentum, *scalars)`."""
    if spec.state_names != ("momentum_buffer",):
        raise GraphfuseError(f"stacked_update_function: a {spec.kind} update has states {spec.state_names}")
    runs: list[list] = []  # [start, end, shape, k]: same-shape members with no gap between them; shape None: a gap
    for s in bucket.slices(rank):
        shape = bucket.slot(s.fqn).shape
        if len(shape) != 2:
            raise GraphfuseError(f"{s.fqn}: Muon updates 2-D parameters, got one of shape {shape}")
        if runs and runs[-1][2] == shape and runs[-1][1] == s.shard_start:
            runs[-1][1], runs[-1][3] = s.shard_end, runs[-1][3] + 1
            continue
        if s.shard_start > (runs[-1][1] if runs else 0):
            runs.append([runs[-1][1] if runs else 0, s.shard_start, None, 0])
        runs.append([s.shard_start, s.shard_end, shape, 1])
    if not runs or runs[-1][1] < bucket.shard_size:
        runs.append([runs[-1][1] if runs else 0, bucket.shard_size, None, 0])

    def fn(p, g, m, *rest):
        scalars = dict(zip(spec.scalar_names, rest))

        def flat(member, gap):  # one flat tensor over the shard from a piece per run
            return torch.cat([member(a, b, shape, k) if shape else gap(p[a:b]) for a, b, shape, k in runs])

        # Constants are made *_like the inputs: a factory would fix the device at trace time.
        mine = flat(
            lambda a, b, *_: torch.ones_like(p[a:b], dtype=torch.bool), lambda t: torch.zeros_like(t, dtype=torch.bool)
        )
        new_m = torch.where(mine, gopt.muon_momentum(spec, m, g), m)

        def update(a, b, shape, k):
            return gopt.muon_orthogonal(spec, g[a:b].view(k, *shape), new_m[a:b].view(k, *shape)).reshape(-1)

        def lr(a, b, shape, k):
            return torch.ones_like(p[a:b]) * gopt.muon_lr(spec, scalars, shape)  # on p's device: lr is a host scalar

        bf16_zeros = lambda t: torch.zeros_like(t, dtype=torch.bfloat16)  # noqa: E731
        new_p = gopt.muon_apply(p, flat(update, bf16_zeros), flat(lr, torch.zeros_like), scalars)
        return [torch.where(mine, new_p, p), new_m]

    return fn


def _cover(flat: torch.Tensor, pieces: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """`flat` with each piece `(start, end, values)` (in order, not overlapping) written over
    its run, the rest (padding, what the pieces leave) passed through: one cat (a new tensor,
    never a view of `flat`)."""
    out, at = [], 0
    for a, b, values in [*pieces, (flat.numel(), flat.numel(), None)]:
        if at < a:
            out.append(flat[at:a])
        if values is not None:
            out.append(values)
        at = b
    return torch.cat(out)


def run(program: Program) -> Program:
    graph, layout = program.graph, program.bucket_layout
    rank = program.rank
    # The traced update's outputs (per-parameter states, whole new buckets) go; once the fused update reads the
    # gradient shards,
    # dead-code elimination removes the ops only the old outputs needed.
    new_outputs = [(s, n) for s, n in outputs(program) if s.role not in (sig.NEW_BUCKET, sig.NEW_STATE)]
    out_node = graph.output_node()
    inputs = input_nodes(program)
    param_shards = []
    grad_shards = program.handoffs.grad_shards
    assert grad_shards is not None  # NEEDS grad_shards: run_pass checked that an earlier pass set them
    for bucket, grad in zip(layout.buckets, grad_shards):
        spec = program.optim.groups[bucket.group]
        dtype = shard_dtype(program, bucket)
        meta = TensorMeta((bucket.shard_size,), dtype, bucket.device)
        states = {s: program.state_layout(bucket, s) for s in program.bucket_states(bucket)}
        state_metas = [TensorMeta((layout.shard_size,), dtype, bucket.device) for layout in states.values()]
        state_nodes = [
            add_input(program, sig.InputSpec(sig.SHARD, f"{bucket.name}.{s}"), m) for s, m in zip(states, state_metas)
        ]
        master = uses_master(program, bucket)
        if master:
            master_node = add_input(program, sig.InputSpec(sig.SHARD, f"{bucket.name}.{MASTER}"), meta)
        scalar_nodes = [inputs[sig.InputSpec(sig.SCALAR, f"group{bucket.group}.{s}")] for s in spec.scalar_names]
        scalar_metas = [program.inputs_meta[f"group{bucket.group}.{s}"] for s in spec.scalar_names]
        bucket_node = inputs[sig.InputSpec(sig.BUCKET, bucket.name)]
        lo, hi = bucket.shard_range(rank)
        with graph.inserting_before(out_node):
            param = (
                master_node if master else call(graph, aten.slice.Tensor, bucket_node, 0, lo, hi, phase=sig.OPTIMIZER)
            )
            batched = bucket.device == "cuda"  # same-shape matrices together, stacked
            if reads_whole(spec):
                fn = whole_update_function(spec, bucket, rank, batched, states)
            else:  # every state shaped like its parameter: one update of the flat shard
                fn = update_function(spec, tuple(states))
            new = inline(
                graph,
                fn,
                [param, grad, *state_nodes, *scalar_nodes],
                [meta, meta, *state_metas, *scalar_metas],
                sig.OPTIMIZER,
            )
            new_param, new_states = new[0], new[1:]
            if master:
                new_outputs.append(
                    (sig.OutputSpec(sig.NEW_SHARD, f"{bucket.name}.{MASTER}", f"{bucket.name}.{MASTER}"), new_param)
                )
                new_param = call(
                    graph, aten._to_copy.default, new_param, dtype=getattr(torch, bucket.dtype), phase=sig.OPTIMIZER
                )
        for s, n in zip(states, new_states):
            new_outputs.append((sig.OutputSpec(sig.NEW_SHARD, f"{bucket.name}.{s}", f"{bucket.name}.{s}"), n))
        param_shards.append(new_param)
    program = set_outputs(program, new_outputs).handing_off(param_shards=tuple(param_shards))
    eliminate_dead_code(program)
    for n in [n for n in placeholders(graph) if n.meta["gf_input"].role == sig.STATE]:
        remove_input(program, n)
    return sync_inputs(program)


def ensures(program: Program) -> None:
    expect(program, NAME, not program.signature.names(sig.STATE), "no per-parameter optimizer state input left")
    expect(
        program,
        NAME,
        not program.signature.output_names(sig.NEW_BUCKET),
        "no whole-bucket output left (the all-gather makes them)",
    )
    expected = sorted(f"{b.name}.{s}" for b in program.bucket_layout.buckets for s in program.bucket_states(b))
    states = sorted(n for n in program.signature.names(sig.SHARD) if not n.endswith(f".{MASTER}"))
    expect(program, NAME, states == expected, f"one state shard input per bucket and state, {expected}")
    shards = sorted(program.signature.names(sig.SHARD))
    expect(
        program,
        NAME,
        sorted(program.signature.output_names(sig.NEW_SHARD)) == shards,
        "a new-shard output for every shard input",
    )
