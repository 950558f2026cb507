"""tools/bench_muon.py's plan (issue 32's check at 8 ranks, traced without a process group): GPT-2
small's 48 block matrices under Muon, the rest under AdamW. The timed rows need CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

from tests._common import ROOT


def test_the_plan_at_8_ranks_balances_newton_schulz_work_and_adds_no_padding():
    run = subprocess.run(
        [sys.executable, "tools/bench_muon.py", "--plan-only", "--plan-world", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout.splitlines()[-1])["plan"]
    assert plan["world_size"] == 8 and plan["matrices"] == 48 and len(plan["cost_per_rank"]) == 8
    assert plan["busiest_over_mean"] <= 1.15, plan  # the bound
    assert plan["padding_share_of_all_buckets"] < 0.02, plan
    assert all(c > 0 for c in plan["cost_per_rank"]), plan  # every rank owns matrices
