"""Program files built to hurt the loader (issue 10 item 8): links and special files, sizes,
nesting, absurd shapes, a layout or state plan that lies, operators outside the allowlist,
and random damage to every file. Each is refused at once with a ProgramFormatError that names
the file; nothing else escapes and nothing is allocated from the file's word."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphfuse as gf
from graphfuse.passes import serializer
from graphfuse.program_files import limits, ops
from tests._common import ROOT
from tests.program_files import test_program_io
from tests.program_files.test_program_io import FIXTURE, compile_small, copy_of, edit_graph, first, rehash

DOCS = ROOT / "docs" / "program-format.md"
saved = test_program_io.saved  # the fixture: an MLP program with a constant, so every file kind


@pytest.fixture(scope="module")
def saved_2_ranks(tmp_path_factory) -> Path:
    """Rank 0 of a 2-rank GPT program (buckets, shards, collectives, a state plan), built
    without a process group as the pass tests do, and verified as the runtime does."""
    from graphfuse import passes
    from graphfuse.passes.verify import verify
    from tests.program_files.test_program_io import make

    model, opt, loss_fn, batches = make("gpt", 0)
    program = gf.capture(model, opt, loss_fn, batches[0], gf.Strategy(bucket_size_mb=0.01, align_bytes=64))
    program = verify(passes.run_pipeline(program.with_(world_size=2, rank=0, group_name="0")))
    path = tmp_path_factory.mktemp("saved2") / "program"
    gf.save_program(program, path)
    return path


def refused(path: Path, pattern: str, within_s: float = 30.0) -> str:
    start = time.monotonic()
    with pytest.raises(gf.ProgramFormatError) as info:
        gf.load_program(path)
    assert time.monotonic() - start < within_s
    message = str(info.value)
    assert re.search(pattern, message), message
    return message


def edit_program(path: Path, edit) -> None:
    doc = json.loads((path / "program.json").read_text())
    edit(doc)
    (path / "program.json").write_text(json.dumps(doc))
    rehash(path)


# ---- links, special files, sizes -------------------------------------------------------------


def test_graph_json_symlinked_to_dev_zero_is_refused_at_once(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    (path / "graph.json").unlink()
    os.symlink("/dev/zero", path / "graph.json")
    refused(path, r"graph\.json: is a symbolic link", within_s=5)


def test_symlink_out_of_the_directory_is_refused_even_to_the_right_content(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.move(path / "graph.json", outside)
    os.symlink(outside, path / "graph.json")
    refused(path, r"graph\.json: is a symbolic link; a program directory holds only regular files")


def test_symlinked_manifest_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    shutil.move(path / "manifest.json", tmp_path / "m.json")
    os.symlink(tmp_path / "m.json", path / "manifest.json")
    refused(path, r"manifest\.json: is a symbolic link")


def test_fifo_is_refused_without_waiting_for_a_writer(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    (path / "program.json").unlink()
    os.mkfifo(path / "program.json")
    refused(path, r"program\.json: is a FIFO", within_s=5)


def test_device_file_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    (path / "graph.json").unlink()
    try:
        os.mknod(path / "graph.json", stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's device
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD, which this process lacks")
    refused(path, r"graph\.json: is a character device", within_s=5)


def test_file_over_its_size_cap_is_refused_before_it_is_read(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    cap = limits.MAX_BYTES["graph.json"]
    with open(path / "graph.json", "r+b") as f:
        f.truncate(cap + 1)  # sparse: costs no disk, and reading it would cost 512 MiB
    refused(path, r"graph\.json: 536,870,913 bytes, more than the limit 536,870,912", within_s=5)


def test_manifest_listing_a_huge_file_is_refused_before_reading(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["graph.json"]["bytes"] = 2**40
    (path / "manifest.json").write_text(json.dumps(manifest))
    refused(path, r"manifest\.json: graph\.json is listed at 1,099,511,627,776 bytes; the limit is")


# ---- nesting and shapes ------------------------------------------------------------------------


def _nested_spec(depth: int, leaf_type: str = "builtins.list") -> str:
    # Built as text: json.dumps itself cannot nest 5000 deep.
    opening = f'{{"type": "{leaf_type}", "context": "null", "children_spec": ['
    leaf = '{"type": null, "context": null, "children_spec": []}'
    return "[1, " + opening * depth + leaf + "]}" * depth + "]"


def test_5000_deep_batch_spec_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_program(path, lambda d: d["signature"].__setitem__("batch_spec", _nested_spec(5000)))
    refused(path, r"program\.json: .*batch_spec")


def test_40_deep_batch_spec_is_refused_by_the_nesting_limit(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_program(path, lambda d: d["signature"].__setitem__("batch_spec", _nested_spec(40)))
    refused(path, r"program\.json: signature\.batch_spec nests deeper than 32 levels")


@pytest.mark.parametrize(
    "kind", ["builtins.NotAType", "collections.defaultdict", "torch.fx.immutable_collections.immutable_list"]
)
def test_unknown_pytree_type_is_refused(saved, tmp_path, kind):
    path = copy_of(saved, tmp_path)
    edit_program(path, lambda d: d["signature"].__setitem__("batch_spec", _nested_spec(1, kind)))
    refused(path, rf"program\.json: signature\.batch_spec: unknown pytree type \"{re.escape(kind)}\"")


def test_deeply_nested_graph_value_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    value: dict = {"int": 1}
    for _ in range(100):
        value = {"list": [value]}
    edit_graph(path, lambda nodes: first(nodes, "call_function")["args"].append(value))
    refused(path, r"graph\.json: node .*values nest deeper than 32 levels")


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, 3])
def test_a_node_meta_pass_that_is_not_a_pass_name_is_refused(saved, tmp_path, name):
    path = copy_of(saved, tmp_path)
    edit_graph(path, lambda nodes: first(nodes, "call_function")["meta"].__setitem__("pass", name))
    refused(path, r"graph\.json: node .*meta pass must be a pass's name \(an identifier\)")


@pytest.mark.parametrize(
    ("size", "cause"),
    [(2**62, r"every size must be an int in \[0, 2\^48\]"), (2**30, r"more than the limit 2\^48")],
    ids=["size", "product"],
)
def test_absurd_shape_in_graph_meta_is_refused(saved, tmp_path, size, cause):
    path = copy_of(saved, tmp_path)
    edit_graph(
        path,
        lambda nodes: first(nodes, "placeholder")["meta"]["val"]["tensor"].update(shape=[size, size], stride=[size, 1]),
    )
    refused(path, r"graph\.json: node 0 .*" + cause)


def test_absurd_input_shape_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    edit_program(path, lambda d: next(iter(d["inputs_meta"].values())).__setitem__(0, [2**62, 2**62]))
    refused(path, r"program\.json: inputs_meta\[.*every size must be an int in \[0, 2\^48\]")


# ---- the layout and the state plan -------------------------------------------------------------


def _grow_bucket(doc: dict, elements: int) -> None:
    bucket = doc["layout"]["buckets"][0]
    bucket["size"] += elements
    bucket["params"][-1][4] += elements  # the arithmetic of the layout itself still holds


def test_bucket_larger_than_the_graph_is_refused(saved_2_ranks, tmp_path):
    path = copy_of(saved_2_ranks, tmp_path)
    edit_program(path, lambda d: _grow_bucket(d, 2**36))
    refused(
        path,
        r"program\.json: input bucket0\S* is \(\(\d+,\), 'float32'\), but the bucket layout gives it shape \(\d{11},\)",
    )


def test_bucket_and_its_inputs_grown_together_are_refused_by_the_graph(saved_2_ranks, tmp_path):
    """Layout and inputs_meta agree on a 2^36-element bucket, the graph's placeholder does
    not: refused before the runtime could allocate 256 GiB."""
    path = copy_of(saved_2_ranks, tmp_path)

    def edit(d):
        _grow_bucket(d, 2**36)
        d["inputs_meta"]["bucket0"][0] = [d["layout"]["buckets"][0]["size"]]
        shard = d["layout"]["buckets"][0]["size"] // 2
        for name in d["inputs_meta"]:
            if name.startswith("bucket0."):
                d["inputs_meta"][name][0] = [shard]

    edit_program(path, edit)
    # Placeholders that a pass added carry no recorded shape, so the fake run is what refuses it.
    refused(
        path,
        r"(program\.json: the placeholders do not match the signature's inputs: input bucket0: the graph "
        r"records \(\d+,\)"
        r"|graph\.json: the graph does not run on fake tensors)",
    )


def test_layout_whose_params_overlap_is_refused(saved_2_ranks, tmp_path):
    path = copy_of(saved_2_ranks, tmp_path)
    edit_program(path, lambda d: d["layout"]["buckets"][0]["params"][1].__setitem__(2, 0))
    refused(path, r"program\.json: layout bucket 0: param .* does not follow the previous one")


def test_state_plan_is_not_stored_but_derived_on_load(saved_2_ranks):
    text = (saved_2_ranks / "program.json").read_text() + (saved_2_ranks / "graph.json").read_text()
    for internal in ("state_plan", "graphfuse.", "grad_shard:", "param_shard:", "marks", "gf_input"):
        assert internal not in text, internal
    loaded = gf.load_program(saved_2_ranks)
    assert loaded.state_plan is not None and loaded.state_plan.unbalanced
    assert loaded.state_plan == serializer.run(loaded.with_(state_plan=None)).state_plan


def test_v1_state_plan_with_swapped_entries_is_ignored(tmp_path):
    path = copy_of(FIXTURE / "rank0", tmp_path)
    original = gf.load_program(path)

    def swap(d):
        pieces = d["extra"]["state_plan"]["value"]["unbalanced"]
        pieces[-1]["tensor"], pieces[-2]["tensor"] = pieces[-2]["tensor"], pieces[-1]["tensor"]
        pieces[0]["path"] = ["optim", "state", "0.weight", "exp_avg"]

    edit_program(path, swap)
    loaded = gf.load_program(path)
    assert loaded.state_plan == original.state_plan == serializer.run(loaded).state_plan
    assert all(p.path[0] != "optim" or p.path[-1] == "momentum_buffer" for p in loaded.state_plan.balanced)


# ---- the op allowlist ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target", ["aten.from_file.default", "aten.copy_.default", "aten.empty.memory_format", "prims.view_of.default"]
)
def test_operator_outside_the_allowlist_is_refused_by_name(saved, tmp_path, target):
    path = copy_of(saved, tmp_path)
    edit_graph(path, lambda nodes: first(nodes, "call_function").update(target=target))
    refused(path, rf"graph\.json: node .*unknown operator '{re.escape(target)}'.*allowlist")


def test_saving_a_program_with_an_operator_outside_the_allowlist_is_refused(tmp_path):
    dm, _ = compile_small("mlp", 0)
    program = dm.program
    node = next(n for n in program.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default)
    node.target = torch.ops.aten.matmul.default
    with pytest.raises(gf.UnsupportedError, match=r"calls .*aten\.matmul.*not in the program-file op allowlist"):
        gf.save_program(program, tmp_path / "program")
    assert not (tmp_path / "program").exists()


def test_the_docs_list_exactly_the_allowlist():
    text = DOCS.read_text()
    block = text.split("<!-- allowlist -->")[1]
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z_0-9]*\.[A-Za-z_0-9]+)`", block))
    assert documented == set(ops.allowed_names())


# ---- random damage -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["manifest.json", "program.json", "graph.json", "constants.safetensors"]),
    # Bytes JSON is made of, so that much damage still parses, and any byte at all.
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(b'019-e."[]{},:n') | st.integers(0, 255)),
        min_size=1,
        max_size=6,
    ),
    rehashed=st.booleans(),
)
def test_random_byte_damage_to_any_file_gives_only_program_format_errors(
    saved, tmp_path_factory, name, edits, rehashed
):
    path = copy_of(saved, tmp_path_factory.mktemp("damaged"))
    data = bytearray((path / name).read_bytes())
    for where, byte in edits:
        data[int(where * len(data))] = byte
    (path / name).write_bytes(bytes(data))
    if rehashed and name != "manifest.json":
        rehash(path)
    try:
        gf.load_program(path)
    except gf.ProgramFormatError as e:
        assert str(path) in str(e)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


def _places(doc):
    """Every (container, key) of a parsed JSON document."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield doc, key
        yield from _places(value)


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(["program.json", "graph.json"]),
    picks=st.lists(st.tuples(st.integers(0, 10**9), JSON), min_size=1, max_size=3),
)
def test_any_json_value_replaced_gives_only_program_format_errors(saved, tmp_path_factory, name, picks):
    """A structural edit (any value of the document replaced by any JSON value, the manifest
    rehashed) loads or is refused by name: never another exception."""
    path = copy_of(saved, tmp_path_factory.mktemp("edited"))
    doc = json.loads((path / name).read_text())
    for index, value in picks:
        places = list(_places(doc))
        container, key = places[index % len(places)]
        container[key] = value
    (path / name).write_text(json.dumps(doc))
    rehash(path)
    try:
        gf.load_program(path)
    except gf.ProgramFormatError as e:
        assert str(path) in str(e)
