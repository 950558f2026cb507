"""graphfuse.testing.launch: ranks meet without racing for a port, and a failure is reported from the
rank that caused it (real Gloo groups, real exceptions)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from graphfuse.errors import GraphfuseError
from graphfuse.testing import launch
from tests._common import ROOT

HERE = str(ROOT)  # on sys.path of the child, which imports this module as tests.integration.test_launch


def _sum_of_ranks(rank: int, world: int, offset: int) -> float:
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises_while_rank0_waits(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(1.0)  # rank 0 is inside the all_reduce by now
        raise ValueError("rank 1's own bug")
    dist.all_reduce(torch.ones(4))


def _peer_error_reported_first(rank: int, world: int) -> None:
    """Rank 1 leaves the group (rank 0's collective fails at once with a lost connection), and
    only then raises its own error: the launcher must still name rank 1."""
    if rank == 1:
        time.sleep(1.0)
        dist.destroy_process_group()
        time.sleep(2.0)
        raise ValueError("rank 1's own bug, reported late")
    dist.all_reduce(torch.ones(4))


def _rank0_hangs_rank1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("rank 1's own bug")
    time.sleep(120)  # stuck, never reports: must not hold the report past the grace period


def _sleeps(rank: int, world: int) -> None:
    time.sleep(120)


def test_a_rank_past_the_timeout_is_a_rank_failure_not_an_assertion():
    with pytest.raises(launch.RankFailure) as info:
        launch.run_ranks(_sleeps, 1, timeout=3)
    assert info.value.rank == 0 and "still running after the 3s timeout" in info.value.traceback
    # a crash or a hang is not a failed assertion: `except AssertionError` must not swallow it
    assert isinstance(info.value, GraphfuseError) and not isinstance(info.value, AssertionError)


def test_a_hung_peer_does_not_hold_the_report_past_the_grace_period(monkeypatch):
    monkeypatch.setattr(launch, "GRACE_S", 2.0)  # the launcher reads it at each call (10 s by default)
    t0 = time.monotonic()
    with pytest.raises(launch.RankFailure) as info:
        launch.run_ranks(_rank0_hangs_rank1_raises, 2, timeout=300)
    assert info.value.rank == 1 and "KeyError" in info.value.traceback
    assert "ranks [0] had not finished 2s later" in str(info.value)
    assert time.monotonic() - t0 < 60


def test_concurrent_jobs_meet_without_a_port_even_when_free_port_is_taken(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # if rendezvous still used free_port()+tcp, both jobs would meet on a port someone else owns
        monkeypatch.setattr(launch, "free_port", lambda: taken.getsockname()[1])
        results: dict[int, list] = {}

        def job(offset: int) -> None:
            results[offset] = launch.run_ranks(_sum_of_ranks, 2, offset, timeout=120)

        threads = [threading.Thread(target=job, args=(o,)) for o in (0, 10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == {0: [1.0, 1.0], 10: [21.0, 21.0]}


def test_failing_rank_is_named_not_the_peer_stuck_in_a_collective():
    with pytest.raises(launch.RankFailure) as info:
        launch.run_ranks(_rank1_raises_while_rank0_waits, 2, timeout=120)
    assert info.value.rank == 1
    assert "ValueError: rank 1's own bug" in str(info.value)
    assert str(info.value).startswith("rank 1 failed:")


def test_root_cause_wins_over_a_peer_error_that_arrived_first():
    with pytest.raises(launch.RankFailure) as info:
        launch.run_ranks(_peer_error_reported_first, 2, timeout=120)
    assert info.value.rank == 1, str(info.value)
    assert "ValueError: rank 1's own bug, reported late" in info.value.traceback
    # rank 0 failed too, with a lost connection, and is listed as a consequence
    assert [o.rank for o in info.value.others] == [0] and info.value.others[0].peer


def test_root_cause_orders_own_failures_before_lost_peers():
    own = launch.Outcome(2, False, "ValueError", at=5.0)
    lost = launch.Outcome(0, False, "Connection reset by peer", at=1.0, peer=True)
    earlier_own = launch.Outcome(1, False, "KeyError", at=3.0)
    cause, others = launch.root_cause([own, lost, earlier_own])
    assert cause is earlier_own and others == [own, lost]
    assert launch.is_peer_error(
        "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"
    )
    assert not launch.is_peer_error("ValueError: rank 1's own bug")


def _write_pid_and_sleep(rank: int, world: int, root: str) -> None:
    with open(os.path.join(root, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie not yet reaped counts as ended)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_ranks_die_with_a_killed_launcher(tmp_path, sig):
    """A launcher killed by SIGTERM (a scheduler's cancel) or SIGKILL left its ranks running."""
    code = (
        f"import sys; sys.path.insert(0, {HERE!r}); from graphfuse.testing import launch; import "
        f"tests.integration.test_launch as t; "
        f"launch.run_ranks(t._write_pid_and_sleep, 2, {str(tmp_path)!r}, timeout=600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        time.sleep(0.2)  # the pid files are written whole
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        proc.send_signal(sig)
        proc.wait()
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(p) for p in pids), f"ranks {[p for p in pids if not _gone(p)]} outlived the launcher"
    finally:
        proc.kill()
        for r in range(2):
            f = tmp_path / f"pid{r}"
            if f.exists() and not _gone(int(f.read_text() or 0)):
                os.kill(int(f.read_text()), signal.SIGKILL)


def _env_and_parent(rank: int, world: int, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getppid()


def test_ranks_see_the_callers_environment_also_when_it_changed_after_the_forkserver_started(monkeypatch):
    """Ranks fork from a server that imported torch once; a variable set after the server started
    reaches them anyway (the server restarts in the caller's environment), and so does its removal."""
    name = "GRAPHFUSE_TEST_LAUNCH_ENV"
    before = launch.run_ranks(_env_and_parent, 2, name)
    monkeypatch.setenv(name, "set after the server started")
    changed = launch.run_ranks(_env_and_parent, 2, name)
    monkeypatch.delenv(name)
    again = launch.run_ranks(_env_and_parent, 2, name)
    assert [v for v, _ in before] == [None, None] and [v for v, _ in again] == [None, None]
    assert [v for v, _ in changed] == ["set after the server started"] * 2
    if sys.platform.startswith("linux"):  # forked by a server, a new one for each environment
        servers = [{p for _, p in run} for run in (before, changed, again)]
        assert all(len(s) == 1 and os.getpid() not in s for s in servers), servers
        assert servers[0] != servers[1] != servers[2], servers
