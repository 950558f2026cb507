"""The README's main job, `graphfuse demo`, end to end through the console script."""

import subprocess
import sys


def test_demo_trains_checks_and_resumes_both_checkpoint_modes(tmp_path):
    cmd = [sys.executable, "-m", "graphfuse.cli", "demo", "--steps", "6", "--layers", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = " ".join(done.stdout.split())  # rich wraps long lines
    assert "loss curves: bitwise equal" in out
    assert "checkpoint unbalanced: save at step 3, reload into a fresh model, resume: bitwise equal" in out
    assert "checkpoint balanced: save at step 3, reload into a fresh model, resume: bitwise equal" in out
    assert "(1/N = 0.500)" in out
    assert (tmp_path / "ckpt-unbalanced").is_dir() and (tmp_path / "ckpt-balanced").is_dir()


def test_cli_reports_a_missing_checkpoint_as_an_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "graphfuse.cli", "ckpt", "info", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "graphfuse: error:" in done.stderr and "nope" in done.stderr
