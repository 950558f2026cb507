"""Checkpoints that never lose data or run code (issue 10), in one process: gf.save replaces only
its own directories, .metadata is never unpickled freely, a failed load changes nothing,
graphfuse.json is checked field by field and sealed, and every file is flushed before a rename."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import socket
import subprocess
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

import graphfuse as gf
from graphfuse.checkpoint import record
from graphfuse.cli import ckpt as checkpoint_cli
from graphfuse.ir.layout import BucketLayout
from tests.checkpoint.test_checkpoint import batch, compile_, make, snapshot, unchanged

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def trained(mode: str = "balanced", seed: int = 6, steps: int = 2, opt_cls=None):
    model, opt, _ = make(seed)
    if opt_cls is not None:
        opt = opt_cls(model.parameters())
    dm = compile_(0, model, opt, mode, torch.float32)
    for i in range(steps):
        dm(batch(0, i))
    return dm


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A balanced and an unbalanced checkpoint at world size 1, after 3 steps."""
    root = tmp_path_factory.mktemp("safety")
    out = {}
    for mode in ("balanced", "unbalanced"):
        out[mode] = root / mode
        gf.save(trained(mode, steps=3), out[mode], extra={"note": 1})
    return out


def copy_of(src: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def refused(dm, path, cls=gf.CheckpointError) -> str:
    snap = snapshot(dm)
    with pytest.raises(cls) as info:
        gf.load(dm, path)
    assert unchanged(dm, snap), f"loading {path} changed the state"
    return str(info.value)


def reseal(path: Path, edit) -> None:
    """Edit graphfuse.json's JSON object with `edit` and seal it afresh (a consistent edit)."""
    f = path / "graphfuse.json"
    d = json.loads(f.read_text())
    d.pop("crc32")
    edit(d)
    f.write_text(json.dumps({**d, "crc32": record._seal(d)}))


# ---- 1. paths -------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["path", "path.old", "path.saving"])
def test_save_refuses_a_directory_it_did_not_write_and_keeps_its_files(tmp_path, where):
    results = tmp_path / "results"
    user = tmp_path / where.replace("path", "results")
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("my notes")
    (user / "sub" / "data.bin").write_bytes(b"\x01\x02")
    with pytest.raises(gf.CheckpointError) as info:
        gf.save(trained(), results)
    assert str(user) in str(info.value) and "not a graphfuse checkpoint" in str(info.value)
    assert "choose another path" in str(info.value)
    assert (user / "notes.txt").read_text() == "my notes" and (user / "sub" / "data.bin").read_bytes() == b"\x01\x02"


def test_save_refuses_a_file_and_replaces_its_own_checkpoint(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(gf.CheckpointError, match="is a file"):
        gf.save(trained(), tmp_path / "file")
    dm = trained()
    gf.save(dm, tmp_path / "ckpt")
    gf.save(dm, tmp_path / "ckpt")  # its own: replaced
    (tmp_path / "empty").mkdir()
    gf.save(dm, tmp_path / "empty")  # an empty directory holds nothing to lose
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "empty", "file"]


def test_save_creates_missing_parent_directories_as_dcp_does(tmp_path):
    """As torch.distributed.checkpoint's FileSystemWriter: `mkdir -p` of the parent; an
    ancestor that is a file is refused by name, and nothing is written."""
    dm = trained("unbalanced")
    gf.save(dm, tmp_path / "runs" / "day1" / "ckpt", extra={"note": 1})
    assert sorted(os.listdir(tmp_path / "runs" / "day1")) == ["ckpt"]  # no lock or staging left
    assert gf.load(trained("unbalanced", seed=7), tmp_path / "runs" / "day1" / "ckpt") == {"note": 1}
    (tmp_path / "file").write_text("x")
    with pytest.raises(gf.CheckpointError) as info:
        gf.save(dm, tmp_path / "file" / "sub" / "ckpt")
    assert f"{tmp_path / 'file'}: exists and is not a directory" in str(info.value)
    assert (tmp_path / "file").read_text() == "x" and sorted(os.listdir(tmp_path)) == ["file", "runs"]


# ---- 2. no code from .metadata ----------------------------------------------------------------
class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file


@pytest.mark.parametrize("record_kept", [True, False], ids=["records_resealed", "graphfuse_json_deleted"])
def test_a_pickle_payload_in_metadata_does_not_run(saved, tmp_path, record_kept):
    path = copy_of(saved["balanced"], tmp_path)
    marker = tmp_path / "PWNED"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    if record_kept:
        size, crc = (path / ".metadata").stat().st_size, zlib.crc32((path / ".metadata").read_bytes())
        reseal(path, lambda d: d["files"].update({".metadata": {"bytes": size, "crc32": crc}}))
    else:
        (path / "graphfuse.json").unlink()
    msg = refused(trained(), path)
    assert str(path / ".metadata") in msg and "open is not a DCP metadata class" in msg
    with pytest.raises(gf.CheckpointError):
        checkpoint_cli.cli_info(str(path))
    assert not marker.exists(), "the payload ran"


# ---- 5. all or nothing -------------------------------------------------------------------------
def test_a_load_failing_inside_torch_read_changes_nothing(saved, tmp_path):
    """A plain DCP checkpoint (no graphfuse.json, so no CRC) whose last chunk is damaged:
    torch's read fails after it has read the chunks before it."""
    path = copy_of(saved["balanced"], tmp_path)
    (path / "graphfuse.json").unlink()
    md = pickle.loads((path / ".metadata").read_bytes())
    last = max(md.storage_data.values(), key=lambda s: s.offset)
    with open(path / last.relative_path, "r+b") as f:
        f.seek(last.offset)
        f.write(b"\x00" * min(64, last.length))
    msg = refused(trained(), path)
    assert str(path) in msg and "rank 0" in msg and "torch.distributed.checkpoint" in msg


def test_a_full_disk_says_disk_full_and_keeps_the_previous_checkpoint(saved, tmp_path, monkeypatch):
    path = copy_of(saved["balanced"], tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path) + ".saving/__0_0.distcp")

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    with pytest.raises(gf.CheckpointError) as info:
        gf.save(trained(seed=9), path)
    assert "disk full" in str(info.value) and "rank 0" in str(info.value) and "__0_0.distcp" in str(info.value)
    monkeypatch.undo()
    dm = trained()
    assert gf.load(dm, path) == {"note": 1} and dm.steps == [3]


# ---- 6. graphfuse.json ---------------------------------------------------------------------------
def test_graphfuse_json_edited_without_its_checksum_is_refused(saved, tmp_path):
    path = copy_of(saved["balanced"], tmp_path)
    f = path / "graphfuse.json"
    f.write_text(f.read_text().replace('"steps": [\n  3\n ]', '"steps": [\n  8\n ]'))
    assert '"steps": [\n  8' in f.read_text()
    assert "CRC-32 does not match" in refused(trained(), path)


def test_a_resealed_step_that_the_data_contradicts_is_refused(saved, tmp_path):
    path = copy_of(saved["balanced"], tmp_path)
    reseal(path, lambda d: d.update(steps=[8]))
    msg = refused(trained(), path)
    assert "says step 8" in msg and "the data says 3" in msg


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.update(steps=["x"]), "steps[0] must be an integer"),
        (lambda d: d.pop("layout"), "missing fields ['layout']"),
        (lambda d: d.update(param_groups=[{"lr": {"a": 1}, "params": []}]), "param_groups[0]['lr']"),
        (lambda d: d.update(mode="both"), "mode must be one of"),
        (lambda d: d.update(surprise=1), "unknown fields ['surprise']"),
        (lambda d: d["files"].update({"__0_0.distcp": {"bytes": -1, "crc32": 0}}), "files['__0_0.distcp']"),
    ],
)
def test_malformed_graphfuse_json_is_refused_naming_the_field(saved, tmp_path, edit, words):
    path = copy_of(saved["balanced"], tmp_path)
    reseal(path, edit)
    msg = refused(trained(), path)
    assert "graphfuse.json" in msg and words in msg, msg


def test_an_adamw_checkpoint_does_not_load_into_sgd(saved, tmp_path):
    # SGD with AdamW's weight decay and no momentum: nothing but the optimizer's identity differs
    sgd = trained(opt_cls=lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1, foreach=False))
    msg = refused(sgd, saved["balanced"], gf.CheckpointMismatchError)
    assert "AdamW" in msg and "SGD" in msg
    assert "betas" not in sgd.optimizer.param_groups[0]
    plain = copy_of(saved["balanced"], tmp_path)  # the same without graphfuse.json: the groups tell
    (plain / "graphfuse.json").unlink()
    assert "betas" in refused(sgd, plain, gf.CheckpointMismatchError)
    sgd = trained(opt_cls=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False))
    assert "AdamW" in refused(sgd, saved["balanced"], gf.CheckpointMismatchError)


def test_convert_refuses_an_edited_layout(saved, tmp_path):
    path = copy_of(saved["unbalanced"], tmp_path)

    def overlap(d):  # the second parameter moved onto the first, fingerprint updated to match
        d["layout"]["buckets"][0]["params"][1][2] = 0
        d["fingerprint"] = BucketLayout.from_json(d["layout"]).fingerprint

    reseal(path, overlap)
    with pytest.raises(gf.CheckpointError, match="impossible place or shape"):
        checkpoint_cli.cli_convert(str(path), str(tmp_path / "dst"), "balanced")
    assert not (tmp_path / "dst").exists()


# ---- 7. fsync before every rename ---------------------------------------------------------------
def test_files_and_directories_are_flushed_before_the_renames_that_publish(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    fsync, rename = os.fsync, Path.rename

    def spy_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def spy_rename(self, target):
        events.append(("rename", f"{self} -> {target}"))
        return rename(self, target)

    dm = trained()
    gf.save(dm, tmp_path / "ckpt")
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(Path, "rename", spy_rename)
    gf.save(dm, tmp_path / "ckpt", extra={"a": 1})
    publish = events.index(("rename", f"{tmp_path / 'ckpt.saving'} -> {tmp_path / 'ckpt'}"))
    flushed = {path for kind, path in events[:publish] if kind == "fsync"}
    staging = tmp_path / "ckpt.saving"
    for f in ("graphfuse.json", "extra.pt", "__0_0.distcp"):
        assert str(staging / f) in flushed, f
    assert str(staging / ".metadata.tmp") in flushed  # DCP flushes its index, then renames it
    assert {str(staging), str(tmp_path)} <= flushed
    assert ("fsync", str(tmp_path)) in events[publish + 1 :], "the parent is flushed after the rename"


# ---- the lock -----------------------------------------------------------------------------------
def test_a_live_savers_lock_refuses_a_second_saver_and_a_loader(saved, tmp_path, monkeypatch):
    from graphfuse.checkpoint import directory

    monkeypatch.setattr(directory, "LOCK_WAIT_S", 1.0)  # a loader waits this long for the lock (10 s by default)
    path = copy_of(saved["balanced"], tmp_path)
    lock = tmp_path / "ckpt.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "save_id": "x"}))
    dm = trained()
    with pytest.raises(gf.CheckpointError) as info:
        gf.save(dm, path)
    assert str(lock) in str(info.value) and f"pid {os.getppid()}" in str(info.value)
    assert "load it after it finishes" in refused(dm, path)
    assert lock.exists(), "another saver's lock is not ours to remove"


@pytest.mark.parametrize("at", ["writing the holder", "linking the lock into place"])
def test_a_saver_killed_while_it_takes_the_lock_leaves_no_lock(tmp_path, monkeypatch, at):
    """A saver killed between creating the lock and writing who holds it left an empty lock that
    every later save took for a held one (seen: a SIGKILL test's next save refused)."""
    from graphfuse.checkpoint import directory

    final = tmp_path / "ckpt"

    def killed(*args, **kwargs):  # stands for SIGKILL at that instant
        raise KeyboardInterrupt

    if at == "writing the holder":
        monkeypatch.setattr(json, "dump", killed)
        monkeypatch.setattr(json, "dumps", killed)
    else:
        monkeypatch.setattr(os, "link", killed)
    with pytest.raises(KeyboardInterrupt):
        directory.acquire(final, "first")
    monkeypatch.undo()
    assert not directory.lock_path(final).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    lock = directory.acquire(final, "second")
    assert json.loads(lock.read_text())["save_id"] == "second"


@pytest.mark.parametrize("where", ["ckpt.old", "ckpt.saving"])
def test_a_removal_killed_after_any_file_leaves_a_directory_the_next_save_replaces(saved, tmp_path, monkeypatch, where):
    """Removing `<path>.old` (or a stale `<path>.saving`) killed part-way once left one holding
    .metadata without graphfuse.json, which every later save refused as not its own (seen: a CI
    failure of the SIGKILL test). The file that marks a directory as ours now goes last."""
    from graphfuse.checkpoint import directory

    path = copy_of(saved["balanced"], tmp_path)
    unlink, rmdir = os.unlink, os.rmdir
    for k in range(len(list(saved["unbalanced"].iterdir())) + 1):  # killed before removal k (the last: rmdir)
        victim = copy_of(saved["unbalanced"], tmp_path, where)
        if where == "ckpt.saving":
            (victim / ".graphfuse").write_text(json.dumps({"host": "h", "pid": 1, "save_id": "x"}))
        done = []

        def killed_before(real, _done=done, _k=k):  # stands for SIGKILL before the k-th removal
            def op(target, *args, **kwargs):
                if len(_done) == _k:
                    raise KeyboardInterrupt
                _done.append(os.path.basename(target))
                return real(target, *args, **kwargs)

            return op

        monkeypatch.setattr(os, "unlink", killed_before(unlink))
        monkeypatch.setattr(os, "rmdir", killed_before(rmdir))
        with pytest.raises(KeyboardInterrupt):
            directory.remove(victim)
        monkeypatch.undo()
        assert victim.exists() and len(done) == k
        directory.check_replaceable(victim)  # does not raise: still ours, or empty
        dm = trained(steps=k % 3 + 1)
        gf.save(dm, path)
        assert not victim.exists(), "the next save removed what the killed removal left"
        fresh = trained()
        gf.load(fresh, path)
        assert fresh.steps == [k % 3 + 1]


def test_a_stale_lock_of_a_dead_saver_is_taken_over_and_released(saved, tmp_path):
    path = copy_of(saved["balanced"], tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / "ckpt.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "save_id": "x"}))
    dm = trained(steps=1)
    assert gf.load(trained(), path) == {"note": 1}
    gf.save(dm, path)
    assert not lock.exists()
    fresh = trained()
    gf.load(fresh, path)
    assert fresh.steps == [1]


# ---- async save ---------------------------------------------------------------------------------
def test_async_save_writes_the_state_of_its_call_while_training_goes_on(tmp_path):
    dm = trained(steps=2)
    gf.save(dm, tmp_path / "sync")
    handle = gf.save(dm, tmp_path / "async", extra={"k": 2}, async_=True)
    for i in range(2, 5):
        dm(batch(0, i))  # changes the live buffers while the files are written
    handle.wait()
    a, b = trained(seed=11), trained(seed=12)
    gf.load(a, tmp_path / "sync")
    assert gf.load(b, tmp_path / "async") == {"k": 2}
    assert a.steps == b.steps == [2]
    for name in a.tensors:
        if name.startswith("bucket"):
            assert torch.equal(a.tensors[name], b.tensors[name]), name


def test_an_async_save_failure_is_raised_by_wait_and_keeps_the_previous_checkpoint(saved, tmp_path, monkeypatch):
    path = copy_of(saved["balanced"], tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    handle = gf.save(trained(seed=9), path, async_=True)
    with pytest.raises(gf.CheckpointError, match="disk full"):
        handle.wait()
    monkeypatch.undo()
    dm = trained()
    assert gf.load(dm, path) == {"note": 1} and dm.steps == [3]
    assert not (tmp_path / "ckpt.lock").exists()


# ---- damage anywhere, and files replaced during a load ------------------------------------------
@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp", "graphfuse.json", "extra.pt"])
@pytest.mark.parametrize("mode", ["balanced", "unbalanced"])
def test_random_damage_to_any_file_is_refused_and_changes_nothing(saved, tmp_path, victim, mode):
    """Seeded random byte flips (1 to 8 bytes, anywhere) in each file kind of a graphfuse checkpoint."""
    dm = trained(mode)
    rng = torch.Generator().manual_seed(zlib.crc32(f"{victim} {mode}".encode()))
    for trial in range(6):
        path = copy_of(saved[mode], tmp_path, f"t{trial}")
        f = path / victim
        data = bytearray(f.read_bytes())
        for _ in range(int(torch.randint(1, 9, (), generator=rng))):
            at = int(torch.randint(0, len(data), (), generator=rng))
            data[at] ^= int(torch.randint(1, 256, (), generator=rng))
        f.write_bytes(bytes(data))
        refused(dm, path)


def test_a_file_replaced_while_it_is_read_is_refused_and_changes_nothing(saved, tmp_path, monkeypatch):
    from graphfuse.checkpoint import loading

    path = copy_of(saved["balanced"], tmp_path)
    original = loading.dcp_load

    def load_then_replace(*args, **kwargs):  # another job rewrites the checkpoint meanwhile
        original(*args, **kwargs)
        data = path / "__0_0.distcp"
        shutil.copyfile(data, tmp_path / "copy")
        os.replace(tmp_path / "copy", data)

    monkeypatch.setattr(loading, "dcp_load", load_then_replace)
    assert "changed while it was being loaded" in refused(trained(), path)


@pytest.mark.parametrize("mode", ["balanced", "unbalanced"])
def test_in_memory_state_dict_round_trips_and_its_record_is_checked(mode):
    dm = trained(mode, steps=3)
    other = trained(mode, seed=5, steps=1)
    other.load_state_dict(dm.state_dict())
    assert other.steps == [3]
    assert all(torch.equal(other.tensors[k], v) for k, v in dm.tensors.items() if k.startswith("bucket"))
    sd = dm.state_dict()
    sd["graphfuse"]["steps"] = ["x"]
    snap = snapshot(other)
    with pytest.raises(gf.CheckpointError, match=r"steps\[0\] must be an integer"):
        other.load_state_dict(sd)
    assert unchanged(other, snap)


def test_a_format_1_record_still_loads(saved, tmp_path):
    path = copy_of(saved["balanced"], tmp_path)
    f = path / "graphfuse.json"
    d = json.loads(f.read_text())
    for k in ("crc32", "optimizer", "save_id"):
        d.pop(k)
    d["files"].pop("extra.pt")
    f.write_text(json.dumps({**d, "format": 1}))
    dm = trained()
    assert gf.load(dm, path) == {"note": 1} and dm.steps == [3]


def test_single_process_saves_and_loads_emit_no_warning(tmp_path):
    import warnings

    from graphfuse.checkpoint.convert import convert

    dm = trained()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in ("balanced", "unbalanced"):
            gf.save(dm, tmp_path / mode, mode=mode)
            gf.load(dm, tmp_path / mode)
        gf.save(dm, tmp_path / "async", async_=True).wait()
        gf.load(dm, tmp_path / "async")
        dm.load_state_dict(dm.state_dict())
        convert(str(tmp_path / "unbalanced"), str(tmp_path / "converted"), "balanced")
    assert [str(w.message) for w in caught] == []
