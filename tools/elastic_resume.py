"""Elastic resume (issue 30): under `torchrun --max-restarts 1 --nproc-per-node 2` (CPU, Gloo) a
rank SIGKILLs itself at a random step between two saves (`--kill between`) or at a random point of
a save (`--kill during`: before its files are written, after, or before rank 0 publishes); torchrun
restarts the job, each case resumes with gf.Checkpointer from its newest complete checkpoint, and
its final state (weights and optimizer shards) must be bitwise that of a run with no kill.

Four cases train interleaved in one job: unbalanced and balanced checkpoints, sync and async saves.
Each has its own process group (its collectives and rank agreement apart from the others') and its
own random generators, data position and LR scheduler, which the checkpoints carry; so one kill
finds every case at another point of its saves.

    python tools/elastic_resume.py --kill between --seed 1
    python tools/elastic_resume.py --trials 10 --kill between,during    # the longer matrix

Prints a line per trial, a table, and a JSON line. CPU (Gloo) only."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [("unbalanced", False), ("balanced", True), ("balanced", False), ("unbalanced", True)]  # (mode, async save)
STEPS, EVERY, KEEP = 8, 2, 2
POINTS = ("write", "written", "publish")  # where in a save `--kill during` strikes


# ---- the job, run by torchrun (both generations) ---------------------------------------------
class Stream:
    """One case's random generators, swapped in around its work (the cases share one process)."""

    def __init__(self, seed: int) -> None:
        import torch

        from graphfuse.checkpoint import rng_state

        torch.manual_seed(seed)
        random.seed(seed)
        self.state = rng_state()

    @contextlib.contextmanager
    def active(self):
        from graphfuse.checkpoint import rng_state, set_rng_state

        set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = rng_state()


class Case:
    """One model, optimizer, scheduler and loader, compiled on a group of its own; with a
    Checkpointer under `root` (None: the reference, with no checkpoints and no kill)."""

    def __init__(self, mode: str, async_: bool, root: Path | None, env: dict) -> None:
        import torch
        import torch.distributed as dist

        import graphfuse as gf
        from graphfuse.checkpoint import Checkpointer  # gf.Checkpointer once the face exports it
        from graphfuse.testing.models import SeededLoader

        self.name, self.env = f"{mode}-{'async' if async_ else 'sync'}", env
        self.stream = Stream(seed=0)
        with self.stream.active():
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
            opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
            self.sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            self.loader = SeededLoader(dist.get_rank(), stride=1000)
            group = dist.new_group(list(range(dist.get_world_size())))
            batch = self.loader.next()
            self.loader.pos = 0
            strategy = gf.Strategy(checkpoint_mode=mode)
            self.dm = gf.compile(
                model, opt, lambda m, b: (m(b[0]) - b[1]).square().mean(), batch, strategy=strategy, group=group
            )
            self.ckpt = (
                None
                if root is None
                else Checkpointer(
                    root / self.name, self.dm, self.sched, every=EVERY, keep=KEEP, async_=async_, data=self.loader
                )
            )
            self.start = 0 if self.ckpt is None else (self.ckpt.load_latest() or 0)

    def step(self, step: int) -> None:
        with self.stream.active():
            self.dm(self.loader.next())
            self.sched.step()
            if self.ckpt is not None:
                _maybe_kill(self.env, "between", self.name, step)
                self.ckpt.maybe_save(step)

    def digest(self) -> str:
        """SHA-256 of this rank's buckets and state shards, after the last save ended."""
        if self.ckpt is not None:
            self.ckpt.wait()
        self.dm.sync()
        import torch

        h = hashlib.sha256()
        for name in sorted(self.dm.tensors):
            if name.startswith("bucket"):
                h.update(name.encode() + self.dm.tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _maybe_kill(env: dict, kind: str, case: str, step: int, point: str | None = None) -> None:
    """SIGKILL this rank if it is the one chosen, in the first generation, at the chosen moment."""
    if env["restart"] or env["rank"] != env["kill_rank"] or env["kill"] != kind:
        return
    if case == env["kill_case"] and step == env["kill_step"] and (point is None or point == env["kill_point"]):
        os.kill(os.getpid(), signal.SIGKILL)


def _arm_save_kill(env: dict) -> None:
    """`--kill during`: wrap the stages of gf.save (this rank's DCP write; rank 0's verify and
    publish) so that the chosen case's save of the chosen step kills this rank there."""
    from graphfuse.checkpoint import saving

    def which(path) -> tuple[str, int] | None:
        p = Path(str(path))
        if not p.name.endswith(".saving"):
            return None
        return p.parent.name, int(p.name.removesuffix(".saving").removeprefix("step-"))

    write, finish = saving.dcp_save, saving._finish

    def dcp_save(sd, writer, planner, group, single):
        at = which(writer.path)
        if at:
            _maybe_kill(env, "during", *at, point="write")
        write(sd, writer, planner, group, single)
        if at:
            _maybe_kill(env, "during", *at, point="written")

    def _finish(rec, tmp, final, files, blob, save_id):
        at = which(tmp)
        if at:
            _maybe_kill(env, "during", *at, point="publish")  # rank 0 alone publishes
        finish(rec, tmp, final, files, blob, save_id)

    saving.dcp_save, saving._finish = dcp_save, _finish


def job() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    env = json.loads(os.environ["ELASTIC_RESUME"])
    env.update(rank=dist.get_rank(), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    _arm_save_kill(env)
    root = Path(env["dir"])
    cases = [Case(mode, async_, root, env) for mode, async_ in CASES]
    for step in range(1, STEPS + 1):
        for case in cases:
            if step > case.start:
                case.step(step)
    out = {c.name: {"digest": c.digest(), "resumed_from": c.start} for c in cases}
    for mode in sorted({m for m, _ in CASES}):
        ref = Case(mode, False, None, env)
        for step in range(1, STEPS + 1):
            ref.step(step)
        out[f"reference-{mode}"] = {"digest": ref.digest()}
    result = {"rank": env["rank"], "restart": env["restart"], "cases": out}
    (root / f"result-rank{env['rank']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------
def choose(kill: str, seed: int) -> dict:
    """The moment of the kill, drawn from `seed`: a step between two saves (after its update, before
    its save), or a point of one case's save of a save step (the first one included)."""
    rng = random.Random(f"elastic-{kill}-{seed}")
    case = rng.choice([f"{m}-{'async' if a else 'sync'}" for m, a in CASES])
    if kill == "between":
        step, point = rng.randint(2, STEPS - 1), None
    else:
        step, point = rng.choice(range(EVERY, STEPS, EVERY)), rng.choice(POINTS)
    rank = rng.randint(0, 1)
    if point == "publish" and rank != 0:
        point = "written"  # only rank 0 publishes
    return {"kill": kill, "kill_rank": rank, "kill_case": case, "kill_step": step, "kill_point": point}


def trial(kill: str, seed: int, timeout: float) -> dict:
    """One torchrun job with one kill; returns what it showed."""
    with tempfile.TemporaryDirectory(prefix="elastic-resume-") as tmp:
        plan = {**choose(kill, seed), "dir": tmp}
        env = {**os.environ, "ELASTIC_RESUME": json.dumps(plan), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        # A store of its own for each generation: torch 2.13's torchrun shares one store across
        # restarts, and a restarted job may read the killed one's keys (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--monitor-interval=0.2",
            __file__,
            "--job",
        ]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = None, str(e.stdout or "") + str(e.stderr or "")
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("result-rank*.json"))]
    return judge(plan, rc, log, results, time.monotonic() - t0)


def judge(plan: dict, rc: int | None, log: str, results: list[dict], seconds: float) -> dict:
    """Bitwise when each case's digest equals its mode's reference on both ranks, after a restart."""
    problems = [] if rc == 0 else [f"torchrun exited {rc}"]
    if len(results) != 2:
        problems.append(f"{len(results)} of 2 ranks wrote a result")
    resumed = {}
    for r in results:
        if r["restart"] != 1:
            problems.append(f"rank {r['rank']} finished in generation {r['restart']}, not after one restart")
        for name, c in r["cases"].items():
            if name.startswith("reference-"):
                continue
            resumed[name] = c["resumed_from"]
            if c["digest"] != r["cases"][f"reference-{name.split('-')[0]}"]["digest"]:
                problems.append(f"rank {r['rank']} {name}: final state differs from the run with no kill")
    plan = {k: v for k, v in plan.items() if k != "dir"}
    return {
        **plan,
        "seconds": round(seconds, 1),
        "resumed_from": resumed,
        "bitwise": not problems,
        "problems": problems,
        "log": "" if not problems else log[-3000:],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kill", default="between", help="between, during, or both: between,during")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--trials", type=int, default=1, help="jobs per kind of kill, seeds seed, seed+1, ...")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        job()
        return 0
    t0, trials = time.monotonic(), []
    for kill in args.kill.split(","):
        for seed in range(args.seed, args.seed + args.trials):
            t = trial(kill, seed, args.timeout)
            trials.append(t)
            print(
                f"{kill:8} seed {seed}: rank {t['kill_rank']} killed at step {t['kill_step']} of {t['kill_case']}"
                f"{' (' + t['kill_point'] + ')' if t['kill_point'] else ''}; resumed from {t['resumed_from']}; "
                f"{'bitwise' if t['bitwise'] else 'NOT bitwise: ' + '; '.join(t['problems'])} ({t['seconds']} s)",
                flush=True,
            )
            if t["log"]:
                print(t["log"], flush=True)
    print(f"{'kill':>8} {'trials':>7} {'bitwise':>8}")
    for kill in args.kill.split(","):
        mine = [t for t in trials if t["kill"] == kill]
        print(f"{kill:>8} {len(mine):>7} {sum(t['bitwise'] for t in mine):>8}")
    from _bench import machine_facts  # here: it imports torch, which this parent process needs only now

    summary = {
        "tool": "elastic_resume",
        "machine": machine_facts(),
        "steps": STEPS,
        "every": EVERY,
        "keep": KEEP,
        "wall_s": round(time.monotonic() - t0, 1),
        "all_bitwise": all(t["bitwise"] for t in trials),
        "trials": [{k: v for k, v in t.items() if k != "log"} for t in trials],
    }
    print(json.dumps(summary))
    return 0 if summary["all_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
