"""Exit soak (issue 30): run a small torchrun training script again and again and count the runs
that do not end cleanly: exit code 0, every rank's result printed, and no process group alive
after `destroy_process_group()` nor at exit. A group kept alive past it (as DistModel once did)
keeps Gloo's threads, and some exits then abort (`terminate called without an active exception`,
exit -6: 5 of 120 runs in the issue).

    python tools/exit_soak.py --runs 100 --ranks 2 --parallel 2     # the issue's check, under load
    python tools/exit_soak.py --runs 4 --ranks 1,2,3 --parallel 2 --save
    python tools/exit_soak.py --runs 10 --ranks 2 --no-destroy       # the script never destroys its group
    python tools/exit_soak.py --runs 10 --ranks 2 --late-import      # graphfuse imported after init_process_group
    python tools/exit_soak.py --runs 10 --ranks 2 --plain --hold-group  # torch alone, a group held: aborts

Prints a line per run that failed, a table, and a JSON line. CPU (Gloo) only."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

RESULT = re.compile(r"exit-soak rank=\d+ mean_loss=\S+? after_destroy=-?\d+ at_exit=-?\d+ pending_work=\d+")
ABORT_SIGNS = ("terminate called", "Fatal Python error", "SIGABRT", "exitcode  : -6")
_KEEP: list = []  # what a script's globals hold until the interpreter shuts down


# ---- the training script, run by torchrun ---------------------------------------------------
def child(args: argparse.Namespace) -> None:
    """What a new user writes: gf.compile, a few steps, (an async save), the mean loss over the
    ranks, destroy, print; the objects stay referenced to the end, as a script's globals are.
    The result line is printed at exit, by the first exit hook (so the last to run): it counts
    the groups alive after the destroy and at exit, after graphfuse's and torch's own hooks.
    `--plain`: torch alone (all-reduces for steps), the control that shows what the soak detects."""
    import atexit

    report: dict = {}
    atexit.register(lambda: _report(report))
    import torch
    import torch.distributed as dist

    if not (args.plain or args.late_import):
        import graphfuse  # noqa: F401 (imported first, as scripts do)
    dist.init_process_group("gloo")
    loss = _plain(args) if args.plain else _graphfuse(args)
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # the last collective before the destroy, on a tensor the script keeps
    _KEEP.extend([loss, mean] + [dist.group.WORLD] * args.hold_group)
    report.update(
        rank=os.environ["RANK"],
        mean=float(mean) / dist.get_world_size(),
        after_destroy=-1,
        groups=_weak_groups(),
        pending=torch._C._distributed_c10d._get_work_registry_size(),
    )
    if not args.no_destroy:
        dist.destroy_process_group()
        report["after_destroy"] = sum(r() is not None for r in report["groups"])


def _weak_groups() -> list:
    import weakref

    import torch.distributed as dist

    return [weakref.ref(pg) for pg in dist.distributed_c10d._world.pg_map]


def _report(report: dict) -> None:
    at_exit = sum(r() is not None for r in report.get("groups", []))
    print(
        f"\nexit-soak rank={report.get('rank')} mean_loss={report.get('mean', 0.0):.6f} after_destroy="
        f"{report.get('after_destroy', -1)} at_exit={at_exit} pending_work={report.get('pending', 0)}",
        flush=True,
    )


def _graphfuse(args: argparse.Namespace):
    import torch
    import torch.distributed as dist

    import graphfuse as gf

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    batch = (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
    dm = gf.compile(model, opt, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), batch)
    for _ in range(args.steps):
        loss = dm(batch)
    if args.save_dir:
        gf.save(dm, os.path.join(args.save_dir, "ckpt"), async_=True).wait()
    _KEEP.extend([model, opt, dm])
    return loss


def _plain(args: argparse.Namespace):
    import torch
    import torch.distributed as dist

    loss = torch.full((1000,), float(dist.get_rank()))
    for _ in range(args.steps):
        dist.all_reduce(loss)
    return loss[0]


# ---- the soak -------------------------------------------------------------------------------
@dataclass
class Run:
    ranks: int
    index: int
    outcome: str  # clean, abort, failed, timeout
    rc: int | None
    seconds: float
    detail: str = ""


def _command(ranks: int, args: argparse.Namespace, save_dir: str | None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        __file__,
        "--child",
    ]
    cmd += ["--steps", str(args.steps)]
    for flag in ("hold_group", "no_destroy", "plain", "late_import"):
        cmd += [f"--{flag.replace('_', '-')}"] * getattr(args, flag)
    return cmd + (["--save-dir", save_dir] if save_dir else [])


def _judge(ranks: int, index: int, rc: int | None, out: str, seconds: float, args: argparse.Namespace) -> Run:
    """A run is clean when torchrun exits 0, every rank printed its line, and no process group is
    alive at exit, nor (when graphfuse was imported first) right after the destroy."""
    lines = RESULT.findall(out)  # the ranks' lines may interleave on torchrun's one pipe
    if rc is None:
        return Run(ranks, index, "timeout", rc, seconds, out[-2000:])
    if any(s in out for s in ABORT_SIGNS):
        return Run(
            ranks, index, "abort", rc, seconds, next(ln for ln in out.splitlines() if any(s in ln for s in ABORT_SIGNS))
        )
    if rc != 0 or len(lines) != ranks:
        errors = [ln for ln in out.splitlines() if re.search(r"\w+(Error|Exception)\b", ln) and "Traceback" not in ln]
        return Run(ranks, index, "failed", rc, seconds, "\n".join(errors[:3]) + "\n" + out[-1500:])
    if not args.hold_group and any(" at_exit=0 " not in ln for ln in lines):
        return Run(ranks, index, "failed", rc, seconds, "a process group was alive at exit: " + "; ".join(lines))
    if not (args.hold_group or args.no_destroy or args.late_import) and any(
        " after_destroy=0 " not in ln for ln in lines
    ):
        return Run(
            ranks, index, "failed", rc, seconds, "a process group outlived destroy_process_group(): " + "; ".join(lines)
        )
    return Run(ranks, index, "clean", rc, seconds)


def soak(args: argparse.Namespace) -> list[Run]:
    """Every (ranks, run) job, `args.parallel` at a time (running several at once is the load)."""
    jobs = [(r, i) for r in args.ranks for i in range(args.runs)]
    runs, active = [], []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="exit-soak-") as tmp:
        while jobs or active:
            while jobs and len(active) < args.parallel:
                ranks, index = jobs.pop(0)
                save_dir = os.path.join(tmp, f"{ranks}-{index}") if args.save else None
                if save_dir:
                    os.makedirs(save_dir)
                out = tempfile.TemporaryFile("w+")
                proc = subprocess.Popen(
                    _command(ranks, args, save_dir), stdout=out, stderr=subprocess.STDOUT, text=True, env=env
                )
                active.append((ranks, index, proc, out, time.monotonic()))
            time.sleep(0.1)
            for job in list(active):
                ranks, index, proc, out, t0 = job
                late = time.monotonic() - t0 > args.timeout
                if proc.poll() is None and not late:
                    continue
                if late and proc.poll() is None:
                    proc.kill()
                    proc.wait()
                active.remove(job)
                out.seek(0)
                run = _judge(ranks, index, None if late else proc.returncode, out.read(), time.monotonic() - t0, args)
                out.close()
                runs.append(run)
                if run.outcome != "clean":
                    print(f"ranks={ranks} run {index}: {run.outcome} (rc {run.rc}): {run.detail[-600:]}", flush=True)
    return runs


def report(runs: list[Run], args: argparse.Namespace, wall: float) -> dict:
    rows = []
    for ranks in args.ranks:
        mine = [r for r in runs if r.ranks == ranks]
        counts = {k: sum(r.outcome == k for r in mine) for k in ("clean", "abort", "failed", "timeout")}
        secs = [r.seconds for r in mine] or [0.0]
        rows.append(
            {
                "ranks": ranks,
                "runs": len(mine),
                **counts,
                "mean_s": round(sum(secs) / len(secs), 2),
                "max_s": round(max(secs), 2),
            }
        )
    head = ("ranks", "runs", "clean", "abort", "failed", "timeout", "mean_s", "max_s")
    print(" ".join(f"{h:>8}" for h in head))
    for row in rows:
        print(" ".join(f"{row[h]:>8}" for h in head))
    options = {
        k: getattr(args, k) for k in ("steps", "parallel", "save", "hold_group", "no_destroy", "plain", "late_import")
    }
    from _bench import machine_facts  # here: it imports torch, which this parent process needs only now

    result = {
        "tool": "exit_soak",
        "machine": machine_facts(),
        "options": options,
        "wall_s": round(wall, 1),
        "rows": rows,
        "all_clean": all(r.outcome == "clean" for r in runs),
        "failures": [asdict(r) for r in runs if r.outcome != "clean"][:10],
    }
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100, help="runs per rank count")
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2], help="e.g. 2 or 1,2,3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--parallel", type=int, default=1, help="jobs at once (the load)")
    p.add_argument("--save", action="store_true", help="an async gf.save before the destroy (its side group too)")
    p.add_argument(
        "--hold-group", action="store_true", help="keep the group referenced to the end, as DistModel once did"
    )
    p.add_argument("--no-destroy", action="store_true", help="the script never calls destroy_process_group()")
    p.add_argument("--plain", action="store_true", help="torch alone, no graphfuse (a control for --hold-group)")
    p.add_argument("--late-import", action="store_true", help="import graphfuse after init_process_group()")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    t0 = time.monotonic()
    return 0 if report(soak(args), args, time.monotonic() - t0)["all_clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
