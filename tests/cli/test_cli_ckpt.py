"""`graphfuse ckpt info`, `graphfuse inspect CHECKPOINT` and `graphfuse ckpt convert` in a
subprocess, on a small checkpoint: damage is found and named, wrong field types are one line,
an existing destination is refused before any work, and keys are printed whole in a pipe."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import graphfuse as gf
from graphfuse.checkpoint.record import _seal
from tests.cli.test_cli import assert_one_line_error, graphfuse_batch


def _loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An unbalanced checkpoint of a model with long parameter names, at world size 1."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("an_unusually_long_module_name_that_a_table_would_cut", nn.Linear(8, 8))
    model.add_module("head", nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(4, 8), torch.randn(4, 2))
    dm = gf.compile(model, opt, _loss, batch, strategy=gf.Strategy(bucket_size_mb=0.0005, align_bytes=64))
    dm(batch)
    gf.save(dm, root / "unbalanced", mode="unbalanced")
    return root / "unbalanced"


def _copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "copy")


def test_info_checks_every_file_and_prints_keys_whole(saved, tmp_path):
    bad = _copy(saved, tmp_path)
    data = sorted(bad.glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.truncate(100)
    ok, cut, unverified, as_json = graphfuse_batch(
        ["ckpt", "info", str(saved)],
        ["ckpt", "info", str(bad)],
        ["ckpt", "info", str(bad), "--no-verify"],
        ["inspect", str(bad), "--json"],
    )
    assert ok.returncode == 0, ok.stderr
    keys = json.loads(as_json.stdout)["tensors"]
    long_keys = [k["key"] for k in keys if "an_unusually_long_module_name" in k["key"]]
    assert long_keys and all(re.search(rf"│ {re.escape(k)} +│", ok.stdout) for k in long_keys)
    assert "ok (size and CRC-32)" in ok.stdout
    assert_one_line_error(cut, 1, data.name, "100 bytes", "cut short", "damaged")
    assert unverified.returncode == 0 and "not verified" in unverified.stdout
    assert as_json.returncode == 1
    damaged = [f for f in json.loads(as_json.stdout)["files"] if f["damage"]]
    assert [(f["file"], f["bytes"]) for f in damaged] == [(data.name, 100)]


@pytest.mark.parametrize("field, value", [("world_size", "two"), ("steps", "many"), ("files", 3)])
def test_a_record_with_wrong_types_is_one_line(saved, tmp_path, field, value):
    bad = _copy(saved, tmp_path)
    record = json.loads((bad / "graphfuse.json").read_text())
    record.pop("crc32")
    record[field] = value
    record["crc32"] = _seal(record)  # sealed again: only the type is wrong
    (bad / "graphfuse.json").write_text(json.dumps(record))
    (done,) = graphfuse_batch(["ckpt", "info", str(bad)])
    assert_one_line_error(done, 1, "graphfuse.json", field)  # a damaged file: the command failed


def test_convert_refuses_an_existing_destination_before_any_work(saved, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "mine.txt").write_text("keep me")
    exists, fresh = graphfuse_batch(
        ["ckpt", "convert", str(saved), str(tmp_path / "dst")], ["ckpt", "convert", str(saved), str(tmp_path / "fresh")]
    )
    assert_one_line_error(exists, 2, "exists", "nothing was written")
    assert exists.stdout == ""  # not even "reading..."
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "fresh"]  # no dst.saving left
    assert (tmp_path / "dst" / "mine.txt").read_text() == "keep me"
    assert fresh.returncode == 0 and "wrote balanced checkpoint" in fresh.stdout, fresh.stderr


def test_what_is_not_a_checkpoint_is_a_usage_error_in_info_inspect_and_convert(saved, tmp_path):
    """ckpt info, inspect and ckpt convert agree: a path that is neither a program nor a
    checkpoint is a usage error (2), never "damaged"; a checkpoint with a damaged record is 1."""
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    (tmp_path / "program").mkdir()
    (tmp_path / "program" / "manifest.json").write_text("{}")
    bad = _copy(saved, tmp_path)
    (bad / "graphfuse.json").write_text("not json")
    paths = [str(tmp_path / n) for n in ("notes.txt", "photos")]
    runs = graphfuse_batch(
        *(["ckpt", "info", p] for p in paths),
        *(["inspect", p] for p in paths),
        ["ckpt", "convert", paths[0], str(tmp_path / "out")],
        ["ckpt", "info", str(tmp_path / "program")],
        ["ckpt", "info", str(bad)],
        ["inspect", str(bad)],
    )
    *neither, program, damaged_info, damaged_inspect = runs
    for done in neither:
        assert_one_line_error(
            done, 2, done.args[-2 if done.args[1] == "convert" else -1], "not a program directory", "or a checkpoint"
        )
        assert "damaged" not in done.stderr
    assert_one_line_error(program, 2, "is a program directory, not a checkpoint", "graphfuse inspect")
    for done in (damaged_info, damaged_inspect):
        assert_one_line_error(done, 1, "graphfuse.json", "damaged")
    assert not (tmp_path / "out").exists()


def test_a_closed_stdout_stops_quietly_with_status_141(saved):
    """`graphfuse inspect --json CKPT | head` and `graphfuse ckpt info CKPT | head` when head has
    quit: no traceback, no message, 141 (the Python docs' recipe; the status of `cat`)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "graphfuse", *argv, str(saved)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for argv in (["inspect", "--json"], ["ckpt", "info"])
    ]
    for p in procs:
        p.stdout.close()  # the reader quits before the command writes anything: every write fails
    for p in procs:
        err = p.communicate(timeout=120)[1]
        assert (p.returncode, err) == (141, b""), (p.args, p.returncode, err.decode())
