"""Program files: round trips at 1, 2 and 3 real Gloo ranks run bitwise like the original
(and restart from a checkpoint), tampered files are refused without running anything, and
the committed fixture loads and trains."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import graphfuse as gf
from graphfuse import program_files
from graphfuse.cli import main as cli_main
from graphfuse.testing.models import GPT, GPTConfig, gpt_loss, synthetic_tokens
from tests._common import ROOT, run_ranks

FIXTURE = ROOT / "tests" / "fixtures" / "program_v1"
FIXTURE_V2 = ROOT / "tests" / "fixtures" / "program_v2"
GPT_CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
STEPS = 3


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # as tools/make_program_fixture.py


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def make(kind: str, rank: int):
    """(model, optimizer, loss_fn, batches) with the same weights on every call and rank."""
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT(GPT_CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return model, opt, gpt_loss, synthetic_tokens(GPT_CFG, 2, STEPS, seed=10 + rank)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(10 + rank)
    return model, opt, mse, [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(STEPS)]


def compile_small(kind: str, rank: int):
    model, opt, loss_fn, batches = make(kind, rank)
    strategy = gf.Strategy(bucket_size_mb=0.01 if kind == "gpt" else 0.0005, align_bytes=64)
    return gf.compile(model, opt, loss_fn, batches[0], strategy=strategy), batches


def plain(value):
    """A node argument or meta value with nodes replaced by their names and tensors by
    (shape, dtype), for comparing two graphs."""
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value) is tuple, [plain(v) for v in value])
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, float) and value != value:
        return "nan"
    return (type(value), value)


def assert_same_program(loaded: gf.Program, original: gf.Program) -> None:
    a, b = list(loaded.graph.nodes), list(original.graph.nodes)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.op, x.name, x.target) == (y.op, y.name, y.target)
        assert plain(x.args) == plain(y.args) and plain(x.kwargs) == plain(y.kwargs), x.name
        for key in ("val", "phase", "gf_input"):
            assert plain(x.meta.get(key)) == plain(y.meta.get(key)), (x.name, key)
    assert loaded.signature == original.signature  # the passes' scratch is not saved
    assert getattr(loaded.layout, "fingerprint", None) == getattr(original.layout, "fingerprint", None)
    assert (loaded.optim, loaded.strategy, loaded.inputs_meta) == (
        original.optim,
        original.strategy,
        original.inputs_meta,
    )
    assert (loaded.passes, loaded.world_size, loaded.rank, loaded.group_name) == (
        original.passes,
        original.world_size,
        original.rank,
        original.group_name,
    )
    assert getattr(loaded, "state_plan", None) == getattr(original, "state_plan", None)


def _round_trip(rank: int, world_size: int, tmp: str) -> dict:
    collectives = {}
    for kind in ("gpt", "mlp"):
        dm, batches = compile_small(kind, rank)
        path = Path(tmp) / f"{kind}-rank{rank}"
        gf.save_program(dm.program, path)
        loaded = gf.load_program(path)
        assert_same_program(loaded, dm.program)
        model, opt, _, _ = make(kind, rank)
        rebuilt = gf.DistModel.from_program(loaded, model, opt)
        for batch in batches:
            assert torch.equal(dm(batch), rebuilt(batch))
        for (name, p), q in zip(dm.model.named_parameters(), model.parameters()):
            assert torch.equal(p, q), name
        # A restart: the saved program and a checkpoint, into a fresh model, with no tracing.
        gf.save(rebuilt, Path(tmp) / f"{kind}-ckpt")
        model, opt, _, _ = make(kind, rank)
        restarted = gf.DistModel.from_program(gf.load_program(path), model, opt)
        gf.load(restarted, Path(tmp) / f"{kind}-ckpt")
        for batch in batches[:2]:
            assert torch.equal(dm(batch), restarted(batch))
        for (name, p), q in zip(dm.model.named_parameters(), model.parameters()):
            assert torch.equal(p, q), name
        collectives[kind] = sum(
            1 for n in loaded.graph.nodes if getattr(n.target, "namespace", "") == "_c10d_functional"
        )
    return collectives


def _round_trip_and_fixture(rank: int, world_size: int, tmp: str) -> tuple[dict, list[float], list[float]]:
    return (
        _round_trip(rank, world_size, tmp),
        _run_fixture(rank, world_size),
        _run_fixture(rank, world_size, FIXTURE_V2),
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[tuple[dict, list[float], list[float]]]:
    """The 2-rank round trip and the committed 2-rank fixtures (v1, v2), in one spawn of ranks."""
    return run_ranks(_round_trip_and_fixture, 2, str(tmp_path_factory.mktemp("two_ranks")))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_loaded_program_equals_original_trains_bitwise_and_restarts_from_a_checkpoint(world_size, tmp_path, request):
    if world_size == 2:
        results = [r for r, _, _ in request.getfixturevalue("two_ranks")]
    else:
        results = run_ranks(_round_trip, world_size, str(tmp_path))
    for counts in results:  # the collectives went through the file, and ran
        assert (counts["gpt"] > 0) == (counts["mlp"] > 0) == (world_size > 1)


def test_captured_program_before_any_pass_round_trips(tmp_path):
    model, opt, loss_fn, batches = make("mlp", 0)
    program = gf.capture(model, opt, loss_fn, batches[0])
    assert program.layout is None and program.signature.names("param")
    gf.save_program(program, tmp_path / "captured")
    loaded = gf.load_program(tmp_path / "captured")
    assert_same_program(loaded, program)
    inputs = [
        torch.randn(m.shape, dtype=getattr(torch, m.dtype))
        for m in (program.inputs_meta[s.name] for s in program.signature.inputs)
    ]
    for a, b in zip(loaded.graph_module(*inputs), program.graph_module(*inputs)):
        assert torch.equal(a, b)


# ---- tampering -------------------------------------------------------------------------


class CreatesFile:
    """Unpickling this creates `path`: what a loader that unpickles would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def with_constant(program: gf.Program) -> gf.Program:
    """`program` with its loss plus a constant tensor (a get_attr node), so that the saved
    program has a constants file."""
    gm = program.graph_module
    gm.register_buffer("loss_offset", torch.tensor(0.25))
    out = program.graph.output_node()
    loss = out.args[0][0]
    with program.graph.inserting_before(out):
        const = program.graph.get_attr("loss_offset")
        shifted = program.graph.call_function(torch.ops.aten.add.Tensor, (loss, const))
    shifted.meta.update(phase=loss.meta["phase"], val=loss.meta["val"])
    const.meta["val"] = loss.meta["val"]
    out.args = ((shifted, *out.args[0][1:]),)
    gm.recompile()
    return program


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A world-size-1 MLP program with a constant, saved once."""
    dm, _ = compile_small("mlp", 0)
    path = tmp_path_factory.mktemp("saved") / "program"
    gf.save_program(with_constant(dm.program), path)
    return path


def copy_of(saved: Path, tmp_path: Path) -> Path:
    path = tmp_path / "program"
    shutil.copytree(saved, path)
    return path


def rehash(path: Path) -> None:
    """Rewrite the manifest's sizes and hashes to match the files (an attacker can too)."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (path / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_program_with_constant_round_trips(saved):
    assert (saved / "constants.safetensors").is_file()
    loaded = gf.load_program(saved)
    assert torch.equal(loaded.graph_module.loss_offset, torch.tensor(0.25))
    model, opt, _, batches = make("mlp", 0)
    reference, _ = compile_small("mlp", 0)
    rebuilt = gf.DistModel.from_program(loaded, model, opt)
    for batch in batches:
        assert torch.equal(rebuilt(batch), reference(batch) + 0.25)


def test_payload_creates_a_file_when_unpickled(tmp_path):
    marker = tmp_path / "created"
    pickle.loads(pickle.dumps(CreatesFile(str(marker))))
    assert marker.exists()  # so its absence below means something


@pytest.mark.parametrize("rehashed", [False, True], ids=["hash-mismatch", "manifest-rehashed"])
@pytest.mark.parametrize("container", ["pickle", "torch.save"])
def test_every_file_replaced_by_a_pickle_is_refused_and_never_unpickled(saved, tmp_path, container, rehashed):
    marker = tmp_path / "pwned"
    files = sorted(p.name for p in saved.iterdir())
    assert files == ["constants.safetensors", "graph.json", "manifest.json", "program.json"]
    for i, name in enumerate(files):
        path = copy_of(saved, tmp_path / str(i))
        if container == "pickle":
            (path / name).write_bytes(pickle.dumps(CreatesFile(str(marker))))
        else:
            torch.save(CreatesFile(str(marker)), path / name)
        if rehashed and name != "manifest.json":
            rehash(path)
        with pytest.raises(gf.ProgramFormatError, match=name.replace(".", r"\.")):
            gf.load_program(path)
        assert not marker.exists(), name


def test_truncated_file_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    data = (path / "graph.json").read_bytes()
    (path / "graph.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(gf.ProgramFormatError, match=r"graph\.json: truncated"):
        gf.load_program(path)


def test_altered_file_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    text = (path / "program.json").read_text()
    (path / "program.json").write_text(text.replace('"rank": 0', '"rank": 1'))
    with pytest.raises(gf.ProgramFormatError, match=r"program\.json: altered"):
        gf.load_program(path)


def test_missing_file_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    (path / "constants.safetensors").unlink()
    with pytest.raises(gf.ProgramFormatError, match=r"constants\.safetensors: cannot read"):
        gf.load_program(path)


def test_newer_format_version_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["version"] = program_files.FORMAT_VERSION + 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(gf.ProgramFormatError, match=r"manifest\.json: format version 3 is newer.*upgrade graphfuse"):
        gf.load_program(path)


def edit_graph(path: Path, edit) -> None:
    doc = json.loads((path / "graph.json").read_text())
    edit(doc["nodes"])
    (path / "graph.json").write_text(json.dumps(doc))
    rehash(path)


def first(nodes: list[dict], op: str) -> dict:
    return next(n for n in nodes if n["op"] == op)


@pytest.mark.parametrize(
    "target",
    [
        "aten.not_an_op.default",
        "os.system",
        "builtins.eval",
        "torch.save",
        "aten.add.__class__",
        "torch.ops.aten.add.Tensor",
    ],
)
def test_unknown_operator_is_refused(saved, tmp_path, target):
    path = copy_of(saved, tmp_path)
    edit_graph(path, lambda nodes: first(nodes, "call_function").update(target=target))
    with pytest.raises(gf.ProgramFormatError, match=rf"graph\.json: node .*unknown operator '{target}'"):
        gf.load_program(path)


def test_code_in_names_and_targets_is_refused_and_never_run(saved, tmp_path):
    marker = tmp_path / "pwned"
    code = f"x=open({str(marker)!r}, 'w')"
    edits = {
        "placeholder target": lambda nodes: first(nodes, "placeholder").update(target=code),
        "node name": lambda nodes: first(nodes, "call_function").update(name=code),
        "get_attr target": lambda nodes: first(nodes, "get_attr").update(target=code),
        "kwarg name": lambda nodes: first(nodes, "call_function")["kwargs"].update({code: {"int": 1}}),
        "dtype": lambda nodes: first(nodes, "call_function")["args"].append({"dtype": "save"}),
        "value type": lambda nodes: first(nodes, "call_function")["args"].append({"pickle": "gASV"}),
    }
    for what, edit in edits.items():
        path = copy_of(saved, tmp_path / what.replace(" ", "_"))
        edit_graph(path, edit)
        with pytest.raises(gf.ProgramFormatError, match=r"graph\.json"):
            gf.load_program(path)
        assert not marker.exists(), what


def test_arguments_an_operator_rejects_are_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_graph(path, lambda nodes: first(nodes, "call_function")["args"].append({"str": "surplus"}))
    with pytest.raises(gf.ProgramFormatError, match=r"graph\.json: the graph does not run on fake tensors"):
        gf.load_program(path)


def test_meta_that_disagrees_with_the_operator_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)

    def edit(nodes):
        node = next(n for n in nodes if n["target"] == "aten.mm.default")
        node["meta"]["val"]["tensor"]["shape"][0] += 1

    edit_graph(path, edit)
    with pytest.raises(gf.ProgramFormatError, match=r"graph\.json: node mm.*: meta records"):
        gf.load_program(path)


def test_metadata_that_disagrees_with_the_graph_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    doc = json.loads((path / "program.json").read_text())
    doc["signature"]["inputs"].reverse()
    (path / "program.json").write_text(json.dumps(doc))
    rehash(path)
    with pytest.raises(gf.ProgramFormatError, match="placeholders do not match"):
        gf.load_program(path)


def test_malformed_values_raise_only_program_format_errors(saved, tmp_path):
    """Any field of a node or of the metadata replaced by a value of the wrong type (with the
    manifest rehashed) loads or raises ProgramFormatError: no other exception escapes."""
    junk = [None, "x", [1], {"int": "1"}]
    nodes = json.loads((saved / "graph.json").read_text())["nodes"]
    cases = []
    for op in ("placeholder", "call_function"):
        i = next(k for k, n in enumerate(nodes) if n["op"] == op)
        cases += [
            ("graph.json", lambda d, i=i, f=f, j=j: d["nodes"][i].__setitem__(f, j)) for f in nodes[i] for j in junk
        ]
    keys = json.loads((saved / "program.json").read_text())
    cases += [("program.json", lambda d, k=k, j=j: d.__setitem__(k, j)) for k in keys for j in junk]
    refused = 0
    for n, (name, edit) in enumerate(cases):
        path = copy_of(saved, tmp_path / str(n))
        doc = json.loads((path / name).read_text())
        edit(doc)
        (path / name).write_text(json.dumps(doc))
        rehash(path)
        try:
            gf.load_program(path)
        except gf.ProgramFormatError as e:
            assert name in str(e) or "disagree" in str(e)
            refused += 1
    assert refused > 0.8 * len(cases)


def test_saving_over_a_non_program_directory_is_refused(tmp_path):
    dm, _ = compile_small("mlp", 0)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(gf.GraphfuseError, match="not a program directory"):
        gf.save_program(dm.program, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---- format stability ------------------------------------------------------------------


def _run_fixture(rank: int, world_size: int, fixture: Path = FIXTURE) -> list[float]:
    data = load_file(str(fixture / "data.safetensors"))
    model = mlp()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(data[f"param.{name}"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    program = gf.load_program(fixture / f"rank{rank}")
    dm = gf.DistModel.from_program(program, model, opt)
    steps = json.loads((fixture / "expected.json").read_text())["steps"]
    losses = [
        dm((data[f"batch.{i}.x"], data[f"batch.{i}.y"])).item() for i in range(rank, steps * world_size, world_size)
    ]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, data[f"final.{name}"])
    return losses


def test_committed_fixture_program_loads_and_trains(two_ranks):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    assert expected["world_size"] == 2
    losses = [fixture_losses for _, fixture_losses, _ in two_ranks]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected["losses"]))


def test_committed_v2_fixture_program_loads_and_trains(two_ranks):
    expected = json.loads((FIXTURE_V2 / "expected.json").read_text())
    assert json.loads((FIXTURE_V2 / "rank0" / "manifest.json").read_text())["version"] == 2
    losses = [v2_losses for _, _, v2_losses in two_ranks]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected["losses"]))


def test_v1_fixture_converts_to_v2_on_read(tmp_path):
    """A v1 file loads as v2 would: no pass marks, the state plan derived (its stored one is
    ignored), the placeholders' specs checked; saved again it is a v2 file that loads the same."""
    v1 = gf.load_program(FIXTURE / "rank0")
    assert not hasattr(v1.signature, "marks") and v1.state_plan is not None
    assert json.loads((FIXTURE / "rank0" / "program.json").read_text())["signature"]["marks"]  # the file has them
    gf.save_program(v1, tmp_path / "v2")
    assert json.loads((tmp_path / "v2" / "manifest.json").read_text())["version"] == program_files.FORMAT_VERSION == 2
    assert_same_program(gf.load_program(tmp_path / "v2"), v1)


def test_cli_program_info(capsys):
    assert cli_main(["program", "info", str(FIXTURE / "rank0"), "--code"]) == 0
    out = capsys.readouterr().out
    for text in (
        "rank 0 of 2",
        "plan_buckets",
        "bucket0",
        "_c10d_functional.reduce_scatter_tensor",
        "new_bucket",
        "def forward",
    ):
        assert text in out, text


def test_cli_program_info_reports_a_damaged_file(tmp_path, capsys):
    path = copy_of(FIXTURE / "rank0", tmp_path)
    (path / "graph.json").write_bytes(b"{")
    assert cli_main(["program", "info", str(path)]) == 1  # a damaged file: the command failed (2 is a usage error)
    assert "graph.json: truncated" in capsys.readouterr().err


def test_conv_batchnorm_program_round_trips_and_trains_bitwise(tmp_path):
    """Conv + BatchNorm (buffers updated by the forward, an int64 counter): the allowlist and
    the codec hold such a step; the loaded program trains like the original."""
    from tests.capture.test_capture import ConvNet, adamw, conv_batches, mlp_loss

    torch.manual_seed(0)
    model, batches = ConvNet(), conv_batches(3)
    dm = gf.compile(model, adamw(model), mlp_loss, batches[0])
    gf.save_program(dm.program, tmp_path / "conv")
    loaded = gf.load_program(tmp_path / "conv")
    assert_same_program(loaded, dm.program)
    torch.manual_seed(0)
    fresh = ConvNet()
    rebuilt = gf.DistModel.from_program(loaded, fresh, adamw(fresh))
    for batch in batches:
        assert torch.equal(dm(batch), rebuilt(batch))
    assert torch.equal(dm.model.bn1.running_mean, fresh.bn1.running_mean)
    assert int(fresh.bn2.num_batches_tracked) == len(batches)


def test_save_program_replaces_only_its_own_directories_and_leaves_nothing_behind(tmp_path):
    dm, _ = compile_small("mlp", 0)
    target = tmp_path / "p"
    gf.save_program(dm.program, target)
    gf.save_program(dm.program, target)  # its own: replaced
    assert sorted(os.listdir(tmp_path)) == ["p"]
    assert sorted(os.listdir(target)) == ["graph.json", "manifest.json", "program.json"]
    (target / "notes.txt").write_text("mine")  # a user's file in it: no longer only a program
    with pytest.raises(gf.GraphfuseError, match="not a program directory"):
        gf.save_program(dm.program, target)
    assert (target / "notes.txt").read_text() == "mine"
    staging = tmp_path / f".q.tmp-{os.getpid()}"  # a user's directory where the writer would stage
    staging.mkdir()
    (staging / "data.bin").write_bytes(b"mine")
    with pytest.raises(gf.GraphfuseError, match="not a program directory"):
        gf.save_program(dm.program, tmp_path / "q")
    assert (staging / "data.bin").read_bytes() == b"mine" and not (tmp_path / "q").exists()
