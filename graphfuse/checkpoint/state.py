"""A DistModel's training state executed from its `StatePlan`: `state_dict` / `load_state_dict`
in memory, and the checks both loads (memory and disk) run before anything changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from graphfuse import optim as gopt
from graphfuse.checkpoint import carried
from graphfuse.checkpoint.plan import plan_of
from graphfuse.checkpoint.record import FORMAT, MODES, Record
from graphfuse.checkpoint.storage import Chunks
from graphfuse.checkpoint.training_state import TrainingState
from graphfuse.errors import CheckpointError, CheckpointMismatchError, UnsupportedError
from graphfuse.ir import signature as sig
from graphfuse.ir.state_plan import MASTER, Piece, StatePlan
from graphfuse.optim import torch_host_states

SCHEDULER_KEYS = {"initial_lr"}  # hyper-parameters torch's LR schedulers add to any optimizer's groups


# ---- the plan, executed -------------------------------------------------------------
def plan(dm: TrainingState) -> StatePlan:
    p = dm.program.state_plan
    return p if p is not None else plan_of(dm.program)  # a program saved before the serializer pass


def mode_of(dm: TrainingState, mode: str | None) -> str:
    mode = mode or dm.strategy.checkpoint_mode
    if mode not in MODES:
        raise CheckpointError(f"checkpoint mode {mode!r} is not one of {MODES}")
    return mode


def view(dm: TrainingState, p: Piece) -> torch.Tensor:
    return dm.tensors[p.tensor][p.start : p.stop].view(p.sizes)


def _by_key(pieces: Iterable[Piece]) -> dict[tuple[str, ...], list[Piece]]:
    out: dict[tuple[str, ...], list[Piece]] = {}
    for p in pieces:
        out.setdefault(p.path, []).append(p)
    return out


def _value(dm: TrainingState, pieces: list[Piece]) -> torch.Tensor | Chunks:
    """A plain view when this rank holds the whole tensor, else its chunks."""
    p = pieces[0]
    if len(pieces) == 1 and p.sizes == p.shape:
        return view(dm, p)
    return Chunks(p.shape, getattr(torch, p.dtype), [(q.offsets, q.sizes, view(dm, q)) for q in pieces])


def _set(d: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _other_model_entries(dm: TrainingState) -> dict[str, torch.Tensor]:
    """Frozen parameters and persistent buffers: whole on every rank, saved as plain tensors."""
    planned = set(dm.layout.fqns) | set(dm.program.signature.aliases)
    return {k: v.detach() for k, v in dm.model.state_dict().items() if k not in planned}


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    return v


def _param_groups(dm: TrainingState, p: StatePlan) -> list[dict]:
    """optim.param_groups as get_state_dict lays them out: hyper-parameters and FQNs (frozen too)."""
    params = carried.group_params(dm, p.groups)
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": params[i]}
        for i, g in enumerate(dm.optimizer.param_groups)
    ]


def saved_steps(dm: TrainingState, p: StatePlan) -> list[int]:
    """Each group's step counter to save: a group that trains nothing keeps its frozen
    parameters' carried step (its own counter runs on with nothing to count)."""
    held = carried.held(dm)
    steps = list(dm.steps)
    for g in p.step_groups:
        values = set(carried.step_of_group(dm, g, lambda k: held[k].item(), held.__contains__))
        if not p.groups[g] and len(values) == 1:
            steps[g] = int(next(iter(values)))
    return steps


def record_of(
    dm: TrainingState, p: StatePlan, mode: str, files: dict | None = None, save_id: str | None = None
) -> Record:
    program = dm.program
    return Record(
        format=FORMAT,
        mode=mode,
        world_size=dm.world_size,
        fingerprint=p.fingerprint,
        layout=dm.layout.to_json(),
        shards={n: program.inputs_meta[n].dtype for n in program.signature.names(sig.SHARD)},
        aliases=dict(program.signature.aliases),
        groups=[list(g) for g in p.groups],
        step_groups=list(p.step_groups),
        steps=saved_steps(dm, p),
        param_groups=[{k: _jsonable(v) for k, v in g.items()} for g in _param_groups(dm, p)],
        files=files or {},
        torch=str(torch.__version__),  # a plain str: torch.load(weights_only=True) refuses TorchVersion
        optimizer=dm.program.optim.cls_name,  # the class, or "Muon+AdamW" for several optimizers
        save_id=save_id,
        state_shapes={n: {f: list(s) for f, s in m.items()} for n, m in program.state_shapes.items()},
    )


def _whole_weights(dm: TrainingState, p: StatePlan) -> dict[str, torch.Tensor]:
    """Every trained parameter whole, as a view of its bucket (tied names too): every rank holds
    all the weights, so an in-memory state dict loads into any rank of any world size."""
    whole = {q.path[1]: view(dm, q) for q in p.loaded("balanced") if q.path[0] == "model"}
    whole.update(
        {alias: whole[canonical] for alias, canonical in dm.program.signature.aliases.items() if canonical in whole}
    )
    return whole


def state_dict(dm: TrainingState, mode: str | None = None, *, whole_weights: bool = False) -> dict:
    """This rank's training state in `mode`, as views of the live buffers (no copy).

    balanced: {"model", "optim"} as get_state_dict lays them out, a tensor this rank holds
    only in part being a `Chunks`; unbalanced: the same but for the optimizer states, which
    are `slice@<fqn>.<state>@rank<r>` at the top level. "graphfuse" holds the record.
    The weights are the chunks of this rank's shard (what it writes to disk), or, with
    `whole_weights` (the in-memory state dict), each parameter whole."""
    mode, p = mode_of(dm, mode), plan(dm)
    sd: dict = {"model": {}, "optim": {"state": {}}}
    saved = p.saved(mode)
    if whole_weights:
        saved = tuple(q for q in saved if q.path[0] != "model")
        sd["model"].update(_whole_weights(dm, p))
    for path, pieces in _by_key(saved).items():
        _set(sd, path, _value(dm, pieces))
    sd["model"].update(_other_model_entries(dm))
    carried.add_to(sd, dm)
    for g in p.step_groups:
        # torch.optim's 0-d states that graphfuse computes on the host (NAdam's mu_product, ASGD's
        # eta and mu): saved so that plain torch.optim resumes exactly; loading reads back what
        # the last step carried (ASGD's eta) and derives the rest from the step.
        lr = float(dm.optimizer.param_groups[g]["lr"])
        host = torch_host_states(dm.program.optim.groups[g], dm.steps[g], dm.carried[g], lr)
        for fqn in p.groups[g]:
            sd["optim"]["state"].setdefault(fqn, {}).update(
                step=torch.tensor(float(dm.steps[g])), **{k: v.clone() for k, v in host.items()}
            )
    sd["optim"]["param_groups"] = _param_groups(dm, p)
    sd["graphfuse"] = dataclasses.asdict(record_of(dm, p, mode))
    return sd


# ---- validation, shared by both loads -----------------------------------------------
def check_layout(dm: TrainingState, p: StatePlan, record: Record, where: str) -> None:
    """An unbalanced checkpoint fits only the world size and layout it was saved with."""
    if record.mode != "unbalanced":
        return
    saved, diffs = record.layout, []
    if record.world_size != dm.world_size:
        diffs.append(f"world size {record.world_size} (this run: {dm.world_size})")
    if saved["bucket_bytes"] != dm.layout.bucket_bytes:
        diffs.append(
            f"bucket size {saved['bucket_bytes'] / 2**20:g} MiB (this run: {dm.layout.bucket_bytes / 2**20:g} MiB)"
        )
    if saved["align_bytes"] != dm.layout.align_bytes:
        diffs.append(f"alignment {saved['align_bytes']} B (this run: {dm.layout.align_bytes} B)")
    if record.fingerprint != p.fingerprint:
        diffs.append(f"layout fingerprint {record.fingerprint} (this run: {p.fingerprint})")
    if diffs:
        raise CheckpointMismatchError(
            f"{where}: an unbalanced checkpoint loads only into the layout it was saved with, and it differs in "
            + "; ".join(diffs)
            + f". Convert it offline (`graphfuse ckpt convert {where} DST --to balanced`) and gf.load DST, "
            "or save in balanced mode (gf.save(dm, path, mode='balanced')), which loads at any world size"
        )


def targets(dm: TrainingState, p: StatePlan, mode: str, has: Callable) -> tuple[dict, list[tuple[Piece, Piece]]]:
    """{checkpoint key: live tensor or Chunks} to fill, and the master shards to derive from
    the weights because the checkpoint has none (one saved without master weights)."""
    out: dict = {}
    derived: list[tuple[Piece, Piece]] = []
    model = {(q.path[1], q.offsets): q for q in p.saved(mode) if q.path[0] == "model"}
    for path, pieces in _by_key(p.loaded(mode)).items():
        key = ".".join(path)
        if mode == "balanced" and path[-1] == MASTER and not has(key):
            derived += [(q, model[(q.path[2], q.offsets)]) for q in pieces]
            continue
        out[key] = _value(dm, pieces)
    for k, v in _other_model_entries(dm).items():
        out[f"model.{k}"] = v
    return out, derived


def step_keys(p: StatePlan) -> list[str]:
    """The `step` states of every parameter of the groups that have one (Adam, AdamW)."""
    return [f"optim.state.{fqn}.step" for g in p.step_groups for fqn in p.groups[g]]


def check_tensor(key: str, target, shape: tuple, dtype: torch.dtype, where: str) -> None:
    if tuple(target.size()) != tuple(shape):
        raise CheckpointMismatchError(
            f"{where}: key {key!r} has shape {tuple(shape)}, this model expects {tuple(target.size())}"
        )
    if dtype != target.dtype:
        raise CheckpointMismatchError(f"{where}: key {key!r} has dtype {dtype}, this model expects {target.dtype}")


def check_optimizer(dm: TrainingState, record: Record | None, where: str) -> None:
    live = dm.program.optim.cls_name
    if record is not None and record.optimizer is not None and record.optimizer != live:
        raise CheckpointMismatchError(
            f"{where}: saved from a {record.optimizer} optimizer, this one is {live}; "
            f"compile with {record.optimizer} to load it"
        )


def check_groups(dm: TrainingState, p: StatePlan, saved: list[dict], where: str) -> list[dict]:
    """The hyper-parameters to restore into optimizer.param_groups, refused (before anything
    changes) when the groups hold other parameters, name hyper-parameters this optimizer
    lacks (another optimizer's checkpoint), or change a value traced into the graph."""
    live = dm.program.optim.cls_name
    if len(saved) != len(dm.optimizer.param_groups):
        raise CheckpointMismatchError(
            f"{where}: {len(saved)} param groups saved, the optimizer has {len(dm.optimizer.param_groups)}"
        )
    fqns, out = set(dm.layout.fqns), []
    for g, (s, group, spec) in enumerate(zip(saved, dm.optimizer.param_groups, dm.program.optim.groups)):
        names = [n for n in s.get("params", []) if n in fqns]
        if names != list(p.groups[g]):
            raise CheckpointMismatchError(
                f"{where}: param group {g} holds {names}, the optimizer's holds {list(p.groups[g])}"
            )
        foreign = sorted(set(s) - set(group) - SCHEDULER_KEYS - {"params"})
        if foreign:
            raise CheckpointMismatchError(
                f"{where}: param group {g} has hyper-parameters {foreign} that {live} does not have; "
                "the checkpoint was saved from another optimizer"
            )
        values = {k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in s.items() if k != "params"}
        try:
            gopt.check_group_unchanged(spec, {**group, **values}, g)
        except UnsupportedError as e:
            raise CheckpointMismatchError(f"{where}: {e}") from None
        out.append(values)
    return out


def steps_of(
    p: StatePlan, record: Record | None, read_step: Callable, has: Callable, where: str, frozen_steps: Callable
) -> list[int]:
    """Each group's step counter, taken from the data (Adam's `step` states) and checked
    against graphfuse.json; for SGD, the record's, or 1 when a momentum buffer exists. A group
    that trains nothing takes its frozen parameters' steps (`frozen_steps(g)`), else the record's."""
    steps = []
    for g, fqns in enumerate(p.groups):
        if g in p.step_groups:
            seen = {float(read_step(f"optim.state.{f}.step")) for f in fqns} or set(frozen_steps(g))
            if not seen:
                steps.append(record.steps[g] if record is not None else 0)
                continue
            value = next(iter(seen)) if len(seen) == 1 else None
            if value is None or not value.is_integer() or value < 0:
                raise CheckpointError(
                    f"{where}: param group {g}'s step states are not one whole number: {sorted(seen)}; graphfuse "
                    "keeps one step per param group (a parameter frozen for a while and trained again needs a "
                    "param group of its own)"
                )
            if record is not None and record.steps[g] != int(value):
                raise CheckpointError(
                    f"{where}: graphfuse.json says step {record.steps[g]} for param group {g}, the data says "
                    f"{int(value)}; the checkpoint is damaged"
                )
            steps.append(int(value))
        elif record is not None:
            steps.append(record.steps[g])
        else:
            steps.append(int(any(has(f"optim.state.{f}.momentum_buffer") for f in fqns)))
    return steps


def carried_keys(dm: TrainingState, p: StatePlan) -> list[str]:
    """The per-parameter states that hold what the last step carried (ASGD's `eta`)."""
    specs = dm.program.optim.groups
    return [
        f"optim.state.{fqn}.{name}" for g in p.step_groups for name in specs[g].carried_names for fqn in p.groups[g]
    ]


def carried_of(
    dm: TrainingState, p: StatePlan, steps: list[int], groups: list[dict], read: Callable, has: Callable, where: str
) -> list[dict]:
    """What each group's last step carried to the next (ASGD's eta), one value per group, read
    from its parameters' states. A checkpoint without them (ASGD saved by a graphfuse that
    refused lr changes, so at a constant lr) derives them from the restored lr, as that run did."""
    out: list[dict] = []
    for g, (spec, fqns) in enumerate(zip(dm.program.optim.groups, p.groups)):
        values: dict[str, float] = {}
        if steps[g] == 0 or not spec.carried_names:  # nothing carried before the first step
            out.append(values)
            continue
        for name in spec.carried_names:
            seen = {float(read(k)) for f in fqns if has(k := f"optim.state.{f}.{name}")}
            if len(seen) > 1:
                raise CheckpointError(
                    f"{where}: param group {g}'s {name} states are not one value: {sorted(seen)}; graphfuse keeps "
                    f"one {name} per param group (its parameters step together)"
                )
            if seen:
                values[name] = seen.pop()
        if len(values) < len(spec.carried_names):
            hyper = {**dm.optimizer.param_groups[g], **groups[g]}
            values = spec.carried_after(float(hyper["lr"]), float(hyper.get("weight_decay", 0.0)), steps[g])
        out.append(values)
    return out


def apply(
    dm: TrainingState, derived: list[tuple[Piece, Piece]], steps: list[int], groups: list[dict], carried: list[dict]
) -> None:
    with torch.no_grad():
        for master, weight in derived:
            view(dm, master).copy_(view(dm, weight))
    dm.steps = list(steps)
    dm.carried = [dict(c) for c in carried]
    for group, values in zip(dm.optimizer.param_groups, groups):
        group.update(values)
