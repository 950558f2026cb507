"""The README's main job, `graphfuse demo`, end to end through the console script."""

import os
import re
import subprocess
import sys
from pathlib import Path


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
        [sys.executable, "-m", "graphfuse.cli", "ckpt", "info", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "graphfuse: error:" in done.stderr and "nope" in done.stderr


def test_demo_says_what_it_does_and_removes_its_temporary_directory(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "graphfuse",
        "demo",
        "--world-size",
        "1",
        "--steps",
        "2",
        "--layers",
        "1",
        "--d-model",
        "16",
    ]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where tempfile puts the demo's directory
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "graphfuse demo: loading torch and graphfuse"  # before the seconds torch takes to import
    for stage in (
        "eager data-parallel reference",
        "tracing the training step",
        "training",
        "saving to",
        "loading into a freshly built model",
    ):
        assert stage in done.stdout, stage
    assert re.search(r"trace and rewrite [\d.]+ s; first step [\d.]+ s; then [\d.]+ ms per step", done.stdout)
    written = re.search(r"checkpoints were written to (\S+) and removed", done.stdout)
    assert written and Path(written.group(1)).parent == tmp_path
    assert not any(p.name.startswith("graphfuse-demo-") for p in tmp_path.iterdir())
