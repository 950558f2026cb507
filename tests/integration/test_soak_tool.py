"""tools/soak.py end to end, briefly (2 Gloo ranks, a few steps): the tool runs, its GPT has
the several buckets the soak needs, and the default strategy on Gloo is bounded; and the
per-rank progress files (graphfuse.testing.progress) it reports a timed-out run with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from graphfuse.testing.progress import heartbeat, reached
from tests._common import ROOT


def test_soak_reports_each_run_with_the_gloo_bound():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(str(ROOT), "tools", "soak.py"), "--ranks", "2", "--runs", "1", "--steps", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["failed"] == 0 and len(record["results"]) == 1
    run = record["results"][0]
    assert run["ok"] and run["buckets"] >= 6 and run["max_inflight"] == 1


def test_a_run_past_its_timeout_reports_how_far_each_rank_got(tmp_path):
    heartbeat(tmp_path, 0, 1234)
    got = reached(tmp_path, 2)
    assert got[0].startswith("step 1234, ") and got[0].endswith("s ago")
    assert got[1] == "no step finished"
    heartbeat(tmp_path, 0, 1300)  # a later step replaces the earlier one whole
    assert reached(tmp_path, 1)[0].startswith("step 1300, ") and not list(tmp_path.glob("*.tmp"))
