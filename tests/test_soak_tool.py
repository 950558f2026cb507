"""tools/soak.py end to end, briefly (2 Gloo ranks, a few steps): the tool runs, its GPT has
the several buckets the soak needs, and the default strategy on Gloo is bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_soak_reports_each_run_with_the_gloo_bound():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(ROOT, "tools", "soak.py"), "--ranks", "2", "--runs", "1", "--steps", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["failed"] == 0 and len(record["results"]) == 1
    run = record["results"][0]
    assert run["ok"] and run["buckets"] >= 6 and run["max_inflight"] == 1
