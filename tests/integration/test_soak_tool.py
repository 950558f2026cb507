"""tools/soak.py end to end, briefly (2 Gloo ranks, a few steps): the tool runs, its GPT has
the several buckets the soak needs, and the default strategy on Gloo is bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak", os.path.join(str(ROOT), "tools", "soak.py"))
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    soak._heartbeat(str(tmp_path), 0, 1234)
    reached = soak._progress(str(tmp_path), 2)
    assert reached[0].startswith("step 1234, ") and reached[0].endswith("s ago")
    assert reached[1] == "no step finished"
