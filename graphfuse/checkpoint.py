"""Checkpoints of a DistModel, executed from the serializer pass's `StatePlan`: `state_dict` /
`load_state_dict` in memory, `save` / `load` on torch.distributed.checkpoint (DCP).

Every load validates all keys, shapes, dtypes, the layout and the files first, then copies
into the live buffers (`copy_`), so every view of them stays valid."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from graphfuse import optim as gopt
from graphfuse import signature as sig
from graphfuse.checkpoint_cli import cli_convert, cli_info
from graphfuse.checkpoint_io import (
    EXTRA_FILE,
    FORMAT,
    META_FILE,
    Chunks,
    LoadPlanner,
    SavePlanner,
    check_files,
    file_records,
    read_dcp_metadata,
    read_meta,
    tensor_md,
)
from graphfuse.errors import CheckpointError, CheckpointMismatchError, UnsupportedError
from graphfuse.passes import serializer
from graphfuse.passes.serializer import MASTER, Piece, StatePlan

MODES = ("unbalanced", "balanced")

__all__ = ["MODES", "cli_convert", "cli_info", "load", "load_state_dict", "save", "state_dict"]


# ---- the plan, executed -------------------------------------------------------------
def _plan(dm) -> StatePlan:
    plan = dm.program.state_plan
    return plan if plan is not None else serializer.run(dm.program).state_plan  # a program saved before the pass


def _mode(dm, mode: str | None) -> str:
    mode = mode or dm.strategy.checkpoint_mode
    if mode not in MODES:
        raise CheckpointError(f"checkpoint mode {mode!r} is not one of {MODES}")
    return mode


def _view(dm, p: Piece) -> torch.Tensor:
    return dm.tensors[p.tensor][p.start : p.stop].view(p.sizes)


def _by_key(pieces: Iterable[Piece]) -> dict[tuple[str, ...], list[Piece]]:
    out: dict[tuple[str, ...], list[Piece]] = {}
    for p in pieces:
        out.setdefault(p.path, []).append(p)
    return out


def _value(dm, pieces: list[Piece]) -> torch.Tensor | Chunks:
    """A plain view when this rank holds the whole tensor, else its chunks."""
    p = pieces[0]
    if len(pieces) == 1 and p.sizes == p.shape:
        return _view(dm, p)
    return Chunks(p.shape, getattr(torch, p.dtype), [(q.offsets, q.sizes, _view(dm, q)) for q in pieces])


def _set(d: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _other_model_entries(dm) -> dict[str, torch.Tensor]:
    """Frozen parameters and persistent buffers: whole on every rank, saved as plain tensors."""
    planned = set(dm.layout.fqns) | set(dm.program.signature.aliases)
    return {k: v.detach() for k, v in dm.model.state_dict().items() if k not in planned}


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    return v


def _param_groups(dm, plan: StatePlan) -> list[dict]:
    """optim.param_groups as get_state_dict lays them out: hyper-parameters and FQNs."""
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(plan.groups[i])}
        for i, g in enumerate(dm.optimizer.param_groups)
    ]


def _meta(dm, plan: StatePlan, mode: str) -> dict:
    program = dm.program
    return {
        "format": FORMAT,
        "mode": mode,
        "world_size": dm.world_size,
        "fingerprint": plan.fingerprint,
        "layout": dm.layout.to_json(),
        "shards": {n: program.inputs_meta[n].dtype for n in program.signature.names(sig.SHARD)},
        "aliases": dict(program.signature.aliases),
        "groups": [list(g) for g in plan.groups],
        "step_groups": list(plan.step_groups),
        "steps": list(dm.steps),
        "param_groups": [{k: _jsonable(v) for k, v in g.items()} for g in _param_groups(dm, plan)],
        "torch": torch.__version__,
    }


def state_dict(dm, mode: str | None = None) -> dict:
    """This rank's training state in `mode`, as views of the live buffers (no copy).

    balanced: {"model", "optim"} as get_state_dict lays them out, a tensor this rank holds
    only in part being a `Chunks`; unbalanced: the same but for the optimizer states, which
    are `slice@<fqn>.<state>@rank<r>` at the top level. "graphfuse" holds the record."""
    mode, plan = _mode(dm, mode), _plan(dm)
    sd: dict = {"model": {}, "optim": {"state": {}}}
    for path, pieces in _by_key(plan.saved(mode)).items():
        _set(sd, path, _value(dm, pieces))
    sd["model"].update(_other_model_entries(dm))
    for g in plan.step_groups:
        for fqn in plan.groups[g]:
            sd["optim"]["state"].setdefault(fqn, {})["step"] = torch.tensor(float(dm.steps[g]))
    sd["optim"]["param_groups"] = _param_groups(dm, plan)
    sd["graphfuse"] = _meta(dm, plan, mode)
    return sd


# ---- validation, shared by both loads -----------------------------------------------
def _check_layout(dm, plan: StatePlan, meta: dict, where: str) -> None:
    """An unbalanced checkpoint fits only the world size and layout it was saved with."""
    if meta["mode"] != "unbalanced":
        return
    saved, diffs = meta["layout"], []
    if meta["world_size"] != dm.world_size:
        diffs.append(f"world size {meta['world_size']} (this run: {dm.world_size})")
    if saved["bucket_bytes"] != dm.layout.bucket_bytes:
        diffs.append(
            f"bucket size {saved['bucket_bytes'] / 2**20:g} MiB (this run: {dm.layout.bucket_bytes / 2**20:g} MiB)"
        )
    if saved["align_bytes"] != dm.layout.align_bytes:
        diffs.append(f"alignment {saved['align_bytes']} B (this run: {dm.layout.align_bytes} B)")
    if meta["fingerprint"] != plan.fingerprint:
        diffs.append(f"layout fingerprint {meta['fingerprint']} (this run: {plan.fingerprint})")
    if diffs:
        raise CheckpointMismatchError(
            f"{where}: an unbalanced checkpoint loads only into the layout it was saved with, and it differs in "
            + "; ".join(diffs)
            + f". Convert it offline (`graphfuse ckpt convert {where} DST --to balanced`) and gf.load DST, "
            "or save in balanced mode (gf.save(dm, path, mode='balanced')), which loads at any world size"
        )


def _targets(dm, plan: StatePlan, mode: str, has: callable) -> tuple[dict, list[tuple[Piece, Piece]]]:
    """{checkpoint key: live tensor or Chunks} to fill, and the master shards to derive from
    the weights because the checkpoint has none (one saved without master weights)."""
    targets: dict = {}
    derived: list[tuple[Piece, Piece]] = []
    model = {(p.path[1], p.offsets): p for p in plan.saved(mode) if p.path[0] == "model"}
    for path, pieces in _by_key(plan.loaded(mode)).items():
        key = ".".join(path)
        if mode == "balanced" and path[-1] == MASTER and not has(key):
            derived += [(p, model[(p.path[2], p.offsets)]) for p in pieces]
            continue
        targets[key] = _value(dm, pieces)
    for k, v in _other_model_entries(dm).items():
        targets[f"model.{k}"] = v
    return targets, derived


def _check_tensor(key: str, target, shape: tuple, dtype: torch.dtype, where: str) -> None:
    if tuple(target.size()) != tuple(shape):
        raise CheckpointMismatchError(
            f"{where}: key {key!r} has shape {tuple(shape)}, this model expects {tuple(target.size())}"
        )
    want = target.dtype
    if dtype != want:
        raise CheckpointMismatchError(f"{where}: key {key!r} has dtype {dtype}, this model expects {want}")


def _check_groups(dm, plan: StatePlan, saved: list[dict], where: str) -> list[dict]:
    """The hyper-parameters to restore into optimizer.param_groups, refused (before anything
    changes) when the groups hold other parameters or change a value traced into the graph."""
    if len(saved) != len(dm.optimizer.param_groups):
        raise CheckpointMismatchError(
            f"{where}: {len(saved)} param groups saved, the optimizer has {len(dm.optimizer.param_groups)}"
        )
    fqns, out = set(dm.layout.fqns), []
    for g, (s, group, spec) in enumerate(zip(saved, dm.optimizer.param_groups, dm.program.optim.groups)):
        names = [n for n in s.get("params", []) if n in fqns]
        if names != list(plan.groups[g]):
            raise CheckpointMismatchError(
                f"{where}: param group {g} holds {names}, the optimizer's holds {list(plan.groups[g])}"
            )
        values = {k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in s.items() if k != "params"}
        try:
            gopt.check_group_unchanged(spec, {**group, **values}, g)
        except UnsupportedError as e:
            raise CheckpointMismatchError(f"{where}: {e}") from None
        out.append(values)
    return out


def _steps_from_states(plan: StatePlan, read_step, has: callable) -> list[int]:
    """Step counters of a checkpoint graphfuse did not write: Adam's "step" state, and for
    SGD 1 when a momentum buffer exists (all its update needs to know)."""
    steps = []
    for g, fqns in enumerate(plan.groups):
        if g in plan.step_groups:
            steps.append(int(read_step(f"optim.state.{fqns[0]}.step")) if fqns else 0)
        else:
            steps.append(int(any(has(f"optim.state.{f}.momentum_buffer") for f in fqns)))
    return steps


def _apply(dm, derived: list[tuple[Piece, Piece]], steps: list[int], groups: list[dict]) -> None:
    with torch.no_grad():
        for master, weight in derived:
            _view(dm, master).copy_(_view(dm, weight))
    dm.steps = list(steps)
    for group, values in zip(dm.optimizer.param_groups, groups):
        group.update(values)


# ---- in memory ------------------------------------------------------------------------
def _lookup(sd: dict, key_path: tuple[str, ...]):
    d = sd
    for k in key_path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _split(key: str) -> tuple[str, ...]:
    """A target key back into its state-dict path: "model.<fqn>", "optim.state.<fqn>.<s>" or "slice@..."."""
    if key.startswith("model."):
        return ("model", key[6:])
    if key.startswith("optim.state."):
        fqn, state = key[12:].rsplit(".", 1)
        return ("optim", "state", fqn, state)
    return (key,)


def _pairs(key: str, target, source, where: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source tensor) pairs that fill `target` from an in-memory value."""
    tchunks = target.chunks if isinstance(target, Chunks) else [((0,) * target.dim(), tuple(target.shape), target)]
    if isinstance(source, torch.Tensor):
        return [(view, source[tuple(slice(o, o + s) for o, s in zip(off, sz))]) for off, sz, view in tchunks]
    held = {(tuple(off), tuple(sz)): t for off, sz, t in source.chunks}
    out = []
    for off, sz, view in tchunks:
        src = held.get((tuple(off), tuple(sz)))
        if src is None:
            raise CheckpointMismatchError(
                f"{where}: key {key!r} lacks the chunk at offsets {tuple(off)} of size {tuple(sz)} this rank holds; "
                "an in-memory state dict loads only at the layout it came from; use gf.save and gf.load to reshard"
            )
        out.append((view, src))
    return out


def load_state_dict(dm, sd: dict) -> None:
    """Copy `sd` (from state_dict, or a plain {"model", "optim"} of full tensors) into the
    live buffers, after validating every key, shape, dtype and the layout."""
    where = "state dict"
    plan, meta = _plan(dm), sd.get("graphfuse")
    mode = meta["mode"] if meta else "balanced"
    if meta:
        _check_layout(dm, plan, meta, where)

    def has(key: str) -> bool:
        return _lookup(sd, _split(key)) is not None

    targets, derived = _targets(dm, plan, mode, has)
    pairs = []
    for key, target in targets.items():
        source = _lookup(sd, _split(key))
        if not isinstance(source, (torch.Tensor, Chunks)):
            raise CheckpointError(
                f"{where}: key {key!r} is missing" if source is None else f"{where}: key {key!r} is not a tensor"
            )
        _check_tensor(key, target, tuple(source.size()), source.dtype, where)
        pairs += _pairs(key, target, source, where)
    for dst, src in pairs:
        if dst.shape != src.shape:
            raise CheckpointMismatchError(
                f"{where}: a chunk of shape {tuple(src.shape)} cannot fill one of {tuple(dst.shape)}"
            )
    if meta:
        steps = meta["steps"]
    else:
        steps = _steps_from_states(plan, lambda k: _lookup(sd, _split(k)), has)
    saved_groups = meta["param_groups"] if meta else (_lookup(sd, ("optim", "param_groups")) or [])
    groups = _check_groups(dm, plan, saved_groups, where)
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
    _apply(dm, derived, steps, groups)


# ---- on disk --------------------------------------------------------------------------
def _agree(dm, error: Exception | None) -> None:
    """Raise on every rank when any rank found a problem, so none starts a load alone."""
    if dm.world_size > 1:
        errors: list = [None] * dm.world_size
        dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)), group=dm.group)
        if error is None:
            for r, e in enumerate(errors):
                if e is not None:
                    cls = CheckpointMismatchError if e[0] == "CheckpointMismatchError" else CheckpointError
                    raise cls(f"rank {r}: {e[1]}")
    if error is not None:
        raise error


def _barrier(dm) -> None:
    if dm.world_size > 1:
        dist.barrier(group=dm.group)


def save(dm, path: str | os.PathLike, mode: str | None = None, extra: dict | None = None) -> None:
    """Save `dm` to directory `path` atomically: every rank writes into `<path>.saving`, and
    rank 0 renames it into place only after all ranks finished; `extra` is the caller's
    plain data (e.g. {"scheduler": sched.state_dict()}), returned by `load`."""
    sd = state_dict(dm, mode)
    meta = sd.pop("graphfuse")
    final = Path(path).absolute()
    tmp, old = final.with_name(final.name + ".saving"), final.with_name(final.name + ".old")
    if dm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(dm)
    dcp.save(
        sd, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=1), planner=SavePlanner(), process_group=dm.group
    )
    files = file_records(tmp, dm.rank)
    if dm.world_size > 1:
        gathered: list = [None] * dm.world_size
        dist.all_gather_object(gathered, files, group=dm.group)
        files = {k: v for f in gathered for k, v in f.items()}
    if dm.rank == 0:
        meta["files"] = files
        if extra is not None:
            torch.save(extra, tmp / EXTRA_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)  # between these two renames, `load` falls back to <path>.old
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(dm)


def _resolve(path: str | os.PathLike) -> Path:
    p = Path(path).absolute()
    old = p.with_name(p.name + ".old")
    if not p.exists() and old.exists():
        return old  # a save was interrupted between its two renames
    if not p.is_dir():
        raise CheckpointError(f"{p}: no checkpoint directory here")
    return p


def load(dm, path: str | os.PathLike):
    """Load the checkpoint at `path` into `dm` in place and return the `extra` it was saved
    with. A graphfuse checkpoint of either mode, or a plain DCP checkpoint of {"model",
    "optim"} from get_state_dict. Nothing changes unless every rank validated all of it."""
    plan, error = _plan(dm), None
    try:
        where = _resolve(path)
        meta = read_meta(where)
        md = read_dcp_metadata(where, meta)
        mode = meta["mode"] if meta else "balanced"
        if meta:
            _check_layout(dm, plan, meta, str(where))

        def has(key: str) -> bool:
            return key in md.state_dict_metadata

        targets, derived = _targets(dm, plan, mode, has)
        for key, target in targets.items():
            entry = tensor_md(md, key, where)
            _check_tensor(key, target, tuple(entry.size), entry.properties.dtype, str(where))
        steps, saved_groups, small = None, None, {}
        if meta:
            steps, saved_groups = meta["steps"], meta["param_groups"]
        else:  # read the small things first: they are validated before any buffer changes
            for key in md.state_dict_metadata:
                if key.startswith("optim.param_groups."):
                    small[key] = None
            for g in plan.step_groups:
                if plan.groups[g]:
                    key = f"optim.state.{plan.groups[g][0]}.step"
                    small[key] = torch.zeros(tuple(tensor_md(md, key, where).size))
        check_files(where, md, meta, set(targets) | set(small))
        extra = _read_extra(where)
    except CheckpointError as e:
        error = e
    _agree(dm, error)
    if small:
        dcp.load(small, storage_reader=dcp.FileSystemReader(str(where)), planner=LoadPlanner(), process_group=dm.group)
        steps = _steps_from_states(plan, lambda k: small[k].item(), has)
        saved_groups = []
        for key, value in small.items():
            if key.startswith("optim.param_groups."):
                g, name = key[len("optim.param_groups.") :].split(".", 1)
                while len(saved_groups) <= int(g):
                    saved_groups.append({})
                saved_groups[int(g)][name] = value
    elif not meta:
        steps, saved_groups = _steps_from_states(plan, lambda k: 0, has), []
    try:
        groups = _check_groups(dm, plan, saved_groups, str(where))
    except CheckpointError as e:
        error = e
    _agree(dm, error)
    dcp.load(targets, storage_reader=dcp.FileSystemReader(str(where)), planner=LoadPlanner(), process_group=dm.group)
    _apply(dm, derived, steps, groups)
    return extra


def _read_extra(where: Path):
    f = where / EXTRA_FILE
    if not f.exists():
        return None
    try:
        return torch.load(f, weights_only=True)
    except Exception as e:  # truncated zip, unpickling refused, ...
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
