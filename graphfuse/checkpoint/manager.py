"""`Checkpointer`: numbered checkpoints on gf.save/gf.load for a job that may be restarted (torchrun
--max-restarts): save every N steps, keep the newest k, and resume from the newest complete one
with the LR scheduler, the data position and every rank's random generators as they were."""

from __future__ import annotations

import base64
import io
import logging
import os
import random
import re
import sys
from pathlib import Path

import torch

from graphfuse.atomic_dir import MARKER
from graphfuse.checkpoint import directory, record
from graphfuse.checkpoint.agree import exchange
from graphfuse.checkpoint.loading import load
from graphfuse.checkpoint.saving import SaveHandle, join, save
from graphfuse.checkpoint.training_state import TrainingState, expect_training_state
from graphfuse.errors import CheckpointError
from graphfuse.ranks import FAILURES

log = logging.getLogger("graphfuse")
FORMAT = 1  # of the `extra` a Checkpointer saves: {"checkpointer", "step", "scheduler", "ranks"}
_NAME = re.compile(r"step-(\d+)(\.old)?")


def step_name(step: int) -> str:
    """The directory of step `step`: step-000120 (six digits at least, so that names sort)."""
    return f"step-{step:06d}"


def _is_complete(d: Path) -> bool:
    """Whether `d` is a whole checkpoint: graphfuse.json sealed (its own CRC-32), no staging
    marker, and every file it records present at its recorded size. gf.save writes graphfuse.json
    last and publishes by a rename, so anything less was not written by a finished save."""
    if (d / MARKER).exists():
        return False
    try:
        rec = record.read(d)
    except CheckpointError as e:
        log.warning("graphfuse: Checkpointer skips %s: %s", d, e)
        return False
    if rec is None:
        return False
    for name, meta in rec.files.items():
        f = d / name
        if not f.is_file() or f.stat().st_size != meta["bytes"]:
            log.warning("graphfuse: Checkpointer skips %s: %s is missing or not %d bytes", d, name, meta["bytes"])
            return False
    return True


def complete_steps(root: str | os.PathLike) -> list[int]:
    """The steps of every complete checkpoint under `root`, oldest first: `step-N` (or, after
    a save killed between its two renames, `step-N.old` with no `step-N`; gf.load falls back to
    it). Staging directories (`step-N.saving`) and half-written ones are never listed."""
    root, found = Path(root), set()
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:
        m = _NAME.fullmatch(e.name)
        if m is None or e.name.removesuffix(".old") != step_name(int(m.group(1))):
            continue
        if m.group(2) and os.path.lexists(root / m.group(0).removesuffix(".old")):
            continue
        if e.is_dir(follow_symlinks=False) and _is_complete(Path(e.path)):
            found.add(int(m.group(1)))
    return sorted(found)


# ---- what a checkpoint carries besides the training state -----------------------------------
def rng_state() -> dict:
    """This process's random generators: torch's CPU one, every CUDA device's (once CUDA is in
    use), Python's `random`, and numpy's global one if numpy is imported; as plain data and
    tensors, which torch.load(weights_only=True) reads back."""
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return out


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` gave (a generator this process lacks is left as it is)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _encode(value) -> str:
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:
        raise CheckpointError(f"extra: cannot be saved ({type(e).__name__}: {e}); pass plain data") from None
    return base64.b64encode(buf.getvalue()).decode()


def _decode(blob: bytes, where: Path):
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{where}: a rank's state in extra.pt is unreadable ({type(e).__name__}: {e})") from None


def _warn_of_a_shared_store() -> None:
    """torchrun (torch 2.13) shares its rendezvous store with the job across restarts by default;
    a restarted job may then read the killed one's keys: init_process_group fails to connect to a
    dead rank's address, and rank agreement could read stale statuses (pytorch/pytorch#135712)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        log.warning(
            "graphfuse: torchrun runs this job with --max-restarts %d on a store shared across restarts; a restarted "
            "job may read the killed one's keys: launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "(README: Resuming after a lost rank)",
            restarts,
        )


class Checkpointer:
    """Numbered checkpoints of `dm` (a DistModel or ShardedOptimizer) under the directory `root`:
    `root/step-000120/`, each a gf.save checkpoint. `maybe_save(step)` saves every `every` steps;
    the newest `keep` complete ones stay, older ones are removed only once a newer one is complete.
    `load_latest()` loads the newest complete one found by reading `root` and returns its step.

    Each checkpoint's `extra` carries, besides the step: `scheduler`'s state (an LR scheduler), and
    for every rank its random generators (torch, CUDA, Python, numpy; `rng=False` leaves them out),
    the state of `data` (an object with state_dict/load_state_dict: a stateful sampler or data
    loader) and the `extra` passed to save; load_latest restores them, `extra` as `self.extra`.
    `async_=True` writes in the background (the next save, load or `wait()` joins it). Every
    rank calls every method: they meet, and a failure on one raises a CheckpointError on all."""

    def __init__(
        self,
        root: str | os.PathLike,
        dm: TrainingState,
        scheduler=None,
        *,
        every: int = 1,
        keep: int = 2,
        async_: bool = False,
        data=None,
        rng: bool = True,
        mode: str | None = None,
        timeout: float | None = None,
    ) -> None:
        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"Checkpointer({str(root)!r}): {name} must be a whole number >= 1, got {value!r}")
        if data is not None and not (hasattr(data, "state_dict") and hasattr(data, "load_state_dict")):
            raise CheckpointError(
                f"Checkpointer({str(root)!r}): data must have state_dict() and load_state_dict() (a stateful "
                f"sampler or "
                f"data loader), got {type(data).__name__}; pass the step as the data position instead"
            )
        self.root, self.scheduler, self.data = Path(root).absolute(), scheduler, data
        self.dm = expect_training_state(dm, f"Checkpointer({str(root)!r})")
        self.every, self.keep, self.async_, self.rng, self.mode, self.timeout = every, keep, async_, rng, mode, timeout
        self.extra = None  # this rank's `extra` of the checkpoint load_latest loaded
        self._handle: SaveHandle | None = None
        _warn_of_a_shared_store()

    def path(self, step: int) -> Path:
        """Where step `step` is (or would be) saved."""
        return self.root / step_name(step)

    def maybe_save(self, step: int, extra=None) -> bool:
        """Save when `step` is a multiple of `every`; returns whether it saved. Call it after the
        step's update and its scheduler.step(), before drawing the next step's data."""
        if step % self.every:
            return False
        self.save(step, extra)
        return True

    def save(self, step: int, extra=None) -> None:
        """Save the training state after step `step` as `root/step-<step>`; `extra` is this rank's
        plain data, given back by load_latest as `self.extra`."""
        self.wait()
        blobs = self._gather(step, extra)
        state = {
            "checkpointer": FORMAT,
            "step": step,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "ranks": [base64.b64decode(b) for b in blobs],
        }
        self._handle = save(self.dm, self.path(step), self.mode, state, self.timeout, self.async_)
        if self._handle is None:
            self._prune()

    def _gather(self, step: int, extra) -> list[str]:
        """Every rank's own state (random generators, data position, `extra`), encoded; rank 0
        refuses a step older than one already in `root`, which would make it the newest no more."""
        error, mine = None, None
        try:
            own = {"rng": rng_state() if self.rng else None, "extra": extra}
            own["data"] = None if self.data is None else self.data.state_dict()
            mine = _encode(own)
            if self.dm.rank == 0:
                newer = [s for s in complete_steps(self.root) if s > step]
                if newer:
                    raise CheckpointError(
                        f"{self.path(newer[-1])}: is newer than step {step}, which would not be the checkpoint to "
                        "resume from; call load_latest() before training to resume, or save into another directory"
                    )
        except FAILURES as e:
            error = e
        return exchange(self.dm, self.timeout)("Checkpointer.save (gather)", error, mine)

    def wait(self) -> None:
        """Join the save in flight (its error is raised here), then remove what `keep` leaves out;
        and other models' saves in flight, before the ranks meet again (saving.join)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.wait()
            self._prune()
        join(self.dm)

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, as rank 0 reads `root` (the same on every rank)."""
        error, found = None, None
        try:
            if self.dm.rank == 0:
                steps = complete_steps(self.root)
                found = steps[-1] if steps else None
        except FAILURES as e:
            error = e
        return exchange(self.dm, self.timeout)("Checkpointer.latest", error, found)[0]

    def load_latest(self) -> int | None:
        """Load the newest complete checkpoint and restore the scheduler, the data position, the
        random generators and `self.extra`; returns its step, or None when there is none (then
        nothing changes). Resume with the step after it."""
        self.wait()
        step = self.latest()
        if step is None:
            self.extra = None
            return None
        where = self.path(step)
        try:
            saved = load(self.dm, where, self.timeout)
        except CheckpointError as e:
            e.add_note(
                f"graphfuse: {where} is the newest complete checkpoint in {self.root}; move it away to resume "
                f"from the one before"
            )
            raise
        self._restore(saved, step, where)
        return step

    def _restore(self, saved, step: int, where: Path) -> None:
        if not isinstance(saved, dict) or saved.get("checkpointer") != FORMAT or saved.get("step") != step:
            raise CheckpointError(
                f"{where}: its extra.pt is not a Checkpointer's of step {step}; load it with gf.load, or move "
                f"it out of {self.root}"
            )
        if self.scheduler is not None:
            if saved["scheduler"] is None:
                raise CheckpointError(
                    f"{where}: saved without an LR scheduler; build the Checkpointer as the job that saved it did"
                )
            self.scheduler.load_state_dict(saved["scheduler"])
        ranks = saved["ranks"]
        if len(ranks) != self.dm.world_size:
            log.warning(
                "graphfuse: %s was saved by %d ranks, this job has %d: each rank's random generators, data position "
                "and extra are not restored",
                where,
                len(ranks),
                self.dm.world_size,
            )
            self.extra = None
            return
        own = _decode(ranks[self.dm.rank], where)
        if self.data is not None and own["data"] is not None:
            self.data.load_state_dict(own["data"])
        if self.rng and own["rng"] is not None:
            set_rng_state(own["rng"])
        self.extra = own["extra"]

    def _prune(self) -> None:
        """Rank 0: remove the complete checkpoints older than the newest `keep`, and what killed
        saves left of steps older than the newest (staging and previous directories). Called only
        after a save completed, so the newest is whole; a removal refused (a directory graphfuse did
        not write) is logged, never raised, since the other ranks are training on."""
        if self.dm.rank != 0:
            return
        steps = complete_steps(self.root)
        if not steps:
            return
        stale = steps[: -self.keep]
        stale += [s for s in _staged_steps(self.root) if s < steps[-1] and s not in steps[-self.keep :]]
        for s in sorted(set(stale)):
            final = self.path(s)
            for p in (final, *directory.siblings(final)):
                try:
                    directory.remove(p)
                except (CheckpointError, OSError) as e:
                    log.warning("graphfuse: Checkpointer could not remove %s: %s", p, e)


def _staged_steps(root: Path) -> list[int]:
    """Steps with a staging or previous directory (`step-N.saving`, `step-N.old`) under `root`."""
    out = []
    for name in os.listdir(root):
        m = re.fullmatch(r"step-(\d+)\.(saving|old)", name)
        if m and name.rsplit(".", 1)[0] == step_name(int(m.group(1))):
            out.append(int(m.group(1)))
    return out
