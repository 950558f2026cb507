"""Property tests of bucket planning (graphfuse.ir.layout): ownership, tiling, alignment, the
bucket cap, grouping, order, and the fingerprint."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphfuse as gf
from graphfuse.errors import ProgramFormatError, UnsupportedError
from graphfuse.ir.blocks import MIN_ALIGNED_BLOCK_BYTES, aligned_blocks, block_of
from graphfuse.ir.layout import Box, BucketLayout, ParamInfo, flat_boxes, itemsize, plan_buckets

DTYPES = ["float32", "bfloat16", "float16", "float64"]

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
params_st = st.lists(
    st.tuples(shapes, st.sampled_from(DTYPES), st.sampled_from(["cpu", "cuda"]), st.integers(0, 2)),
    min_size=1,
    max_size=12,
).map(lambda rows: [ParamInfo(f"layer{i}.w", s, d, dev, g) for i, (s, d, dev, g) in enumerate(rows)])
worlds = st.integers(1, 8)
aligns = st.sampled_from([1, 2, 4, 16, 64, 256])
caps = st.integers(1, 4096)


def plan(params, world, align, cap) -> BucketLayout:
    return plan_buckets(params, world, align, cap)


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_every_element_of_every_parameter_is_owned_by_exactly_one_rank(params, world, align, cap):
    layout = plan(params, world, align, cap)
    owners = {p.fqn: [0] * p.numel for p in params}
    for bucket in layout.buckets:
        for rank in range(world):
            for s in bucket.slices(rank):
                for i in range(s.param_start, s.param_start + s.numel):
                    owners[s.fqn][i] += 1
    assert owners == {p.fqn: [1] * p.numel for p in params}
    assert sorted(layout.fqns) == sorted(p.fqn for p in params)


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_slices_tile_each_shards_parameter_data_and_nothing_else(params, world, align, cap):
    layout = plan(params, world, align, cap)
    for bucket in layout.buckets:
        assert bucket.size % world == 0
        data = [False] * bucket.size
        for s in bucket.slots:
            data[s.offset : s.offset + s.numel] = [True] * s.numel
        for rank in range(world):
            lo, hi = bucket.shard_range(rank)
            covered = [False] * bucket.shard_size
            prev_end = 0
            for s in bucket.slices(rank):
                assert prev_end <= s.shard_start < s.shard_end <= bucket.shard_size  # in order, no overlap
                prev_end = s.shard_end
                slot = bucket.slot(s.fqn)
                # the slice's shard range is the parameter's flat range it claims
                assert lo + s.shard_start == slot.offset + s.param_start
                assert s.param_start + s.numel <= slot.numel
                covered[s.shard_start : s.shard_end] = [True] * s.numel
            assert covered == data[lo:hi]


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_offsets_and_bucket_sizes_are_aligned_in_bytes(params, world, align, cap):
    layout = plan(params, world, align, cap)
    for bucket in layout.buckets:
        align_elems = max(1, align // itemsize(bucket.dtype))
        assert bucket.size % (world * align_elems) == 0
        end = 0
        for s in bucket.slots:
            assert s.offset % align_elems == 0
            assert (s.offset * itemsize(bucket.dtype)) % min(align, itemsize(bucket.dtype) * align_elems) == 0
            assert s.offset == end  # slots are packed: padding only where alignment needs it
            assert s.padded >= s.numel
            end = s.offset + s.padded
        assert end == bucket.size


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_bucket_cap_holds_unless_one_parameter_exceeds_it(params, world, align, cap):
    layout = plan(params, world, align, cap)
    for bucket in layout.buckets:
        if bucket.nbytes > cap:
            assert len(bucket.slots) == 1, f"{bucket.name} has {bucket.nbytes} B > cap {cap} B with several parameters"


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_buckets_group_by_dtype_device_and_param_group(params, world, align, cap):
    layout = plan(params, world, align, cap)
    info = {p.fqn: p for p in params}
    for bucket in layout.buckets:
        for fqn in bucket.fqns:
            p = info[fqn]
            assert (p.dtype, p.device, p.group) == (bucket.dtype, bucket.device, bucket.group)
            assert bucket.slot(fqn).shape == p.shape


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_buckets_follow_gradient_order(params, world, align, cap):
    layout = plan(params, world, align, cap)
    pos = {p.fqn: i for i, p in enumerate(params)}
    ready = []
    for bucket in layout.buckets:
        order = [pos[f] for f in bucket.fqns]
        assert order == sorted(order)  # inside a bucket, in gradient order
        ready.append(max(order))
    assert ready == sorted(ready)  # the first bucket is the first one whose gradients are all ready
    # buckets of one group are consecutive runs of that group's gradients
    for key in {(p.dtype, p.device, p.group) for p in params}:
        seq = [f for b in layout.buckets if (b.dtype, b.device, b.group) == key for f in b.fqns]
        assert seq == [p.fqn for p in params if (p.dtype, p.device, p.group) == key]


def test_bucket_order_example_last_layer_first():
    # Backward produces head first, then layer1, then layer0: so do the buckets (Paddle
    # orders them in forward order, making the first bucket ready last).
    params = [ParamInfo(n, (64,), "float32", "cpu", 0) for n in ("head.w", "layer1.w", "layer0.w")]
    layout = plan_buckets(params, 2, 256, 256)
    assert [b.fqns for b in layout.buckets] == [("head.w",), ("layer1.w",), ("layer0.w",)]


@settings(max_examples=100, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_fingerprint_is_stable_and_layout_round_trips_through_json(params, world, align, cap):
    layout = plan(params, world, align, cap)
    again = plan(list(params), world, align, cap)
    assert again == layout and again.fingerprint == layout.fingerprint
    loaded = BucketLayout.from_json(json.loads(json.dumps(layout.to_json())))
    assert loaded == layout
    assert loaded.fingerprint == layout.fingerprint


def test_a_layout_of_another_format_and_a_world_of_no_ranks_are_refused_as_library_errors():
    d = plan_buckets([ParamInfo("a", (100,), "float32", "cpu", 0)], 2, 256, 4096).to_json()
    with pytest.raises(
        ProgramFormatError, match="bucket layout format 99 is not .*the graphfuse version that wrote it"
    ):
        BucketLayout.from_json({**d, "format": 99})
    with pytest.raises(UnsupportedError, match="world_size must be >= 1, got 0"):
        plan_buckets([ParamInfo("a", (100,), "float32", "cpu", 0)], 0, 256, 4096)


BASE = [
    ParamInfo("a", (100,), "float32", "cpu", 0),
    ParamInfo("b", (7, 3), "float32", "cpu", 0),
    ParamInfo("c", (50,), "float32", "cpu", 0),
]


def test_fingerprint_changes_with_everything_that_changes_the_layout():
    base = plan_buckets(BASE, 2, 256, 4096).fingerprint
    changed = {
        "world size": plan_buckets(BASE, 3, 256, 4096),
        "bucket size": plan_buckets(BASE, 2, 256, 8192),
        "alignment": plan_buckets(BASE, 2, 64, 4096),
        "order": plan_buckets([BASE[1], BASE[0], BASE[2]], 2, 256, 4096),
        "shape": plan_buckets([dataclasses.replace(BASE[1], shape=(3, 7)), BASE[0], BASE[2]], 2, 256, 4096),
        "dtype": plan_buckets([dataclasses.replace(BASE[0], dtype="bfloat16"), *BASE[1:]], 2, 256, 4096),
        "name": plan_buckets([dataclasses.replace(BASE[0], fqn="z"), *BASE[1:]], 2, 256, 4096),
    }
    fingerprints = {k: v.fingerprint for k, v in changed.items()}
    assert base not in fingerprints.values(), fingerprints
    assert len(set(fingerprints.values())) == len(fingerprints)


def test_tiny_model_on_many_ranks_leaves_some_ranks_only_padding():
    params = [ParamInfo("w", (3, 2), "float32", "cpu", 0), ParamInfo("b", (3,), "float32", "cpu", 0)]
    layout = plan_buckets(params, 8, 256, 2**20)
    (bucket,) = layout.buckets
    assert bucket.size == 8 * 64 and bucket.shard_size == 64
    assert [s.fqn for s in bucket.slices(0)] == ["w"]  # w at 0..6, b at 64..67
    assert [(s.fqn, s.shard_start, s.shard_end, s.param_start) for s in bucket.slices(1)] == [("b", 0, 3, 0)]
    assert all(bucket.slices(r) == () for r in range(2, 8))  # these ranks hold padding only


def test_parameter_straddling_ranks_is_split_into_one_slice_per_rank():
    layout = plan_buckets([ParamInfo("w", (10, 13), "float32", "cpu", 0)], 3, 16, 2**20)
    (bucket,) = layout.buckets
    assert bucket.size == 132 and bucket.shard_size == 44  # 130 rounded up to 3 * 4
    got = [[(s.shard_start, s.shard_end, s.param_start) for s in bucket.slices(r)] for r in range(3)]
    assert got == [[(0, 44, 0)], [(0, 44, 44)], [(0, 42, 88)]]


def test_parameter_larger_than_the_cap_gets_a_bucket_of_its_own():
    params = [
        ParamInfo("small", (4,), "float32", "cpu", 0),
        ParamInfo("big", (1000,), "float32", "cpu", 0),
        ParamInfo("small2", (4,), "float32", "cpu", 0),
    ]
    layout = plan_buckets(params, 2, 16, 1024)
    assert [b.fqns for b in layout.buckets] == [("small",), ("big",), ("small2",)]
    assert layout.buckets[1].nbytes == 4000


# ---- ranges and boxes: every offset the runtime, the passes and checkpoints read ----------


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_data_ranges_and_padding_tile_each_bucket(params, world, align, cap):
    layout = plan(params, world, align, cap)
    for bucket in layout.buckets:
        end = 0
        for s in bucket.slots:
            start, stop = s.data_range
            assert start == end and stop - start == s.numel  # data, then its padding, then the next slot
            assert s.padding >= 0
            end = stop + s.padding
        assert end == bucket.size


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_slice_ranges_name_the_same_elements_in_bucket_shard_and_parameter(params, world, align, cap):
    layout = plan(params, world, align, cap)
    for bucket in layout.buckets:
        # Element i of the bucket stands for (fqn, flat index) or padding.
        owner = [None] * bucket.size
        for s in bucket.slots:
            start, _ = s.data_range
            for i in range(s.numel):
                owner[start + i] = (s.fqn, i)
        for rank in range(world):
            lo, hi = bucket.shard_range(rank)
            assert hi - lo == bucket.shard_size
            for s in bucket.slices(rank):
                a, b = bucket.bucket_range(rank, s)
                x, y = s.shard_range
                p, q = s.param_range
                assert lo <= a < b <= hi and (a - lo, b - lo) == (x, y) and b - a == q - p == s.numel
                assert owner[a:b] == [(s.fqn, i) for i in range(p, q)]
                boxes = s.boxes(bucket.slot(s.fqn).shape)
                assert [(box.start, box.stop) for box in boxes] == [
                    (box.start - p + x, box.stop - p + x) for box in flat_boxes(bucket.slot(s.fqn).shape, p, q)
                ]
                assert boxes[0].start == x and boxes[-1].stop == y


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


boxes_st = (
    st.lists(st.integers(1, 5), min_size=0, max_size=4)
    .map(tuple)
    .flatmap(
        lambda shape: st.tuples(st.just(shape), st.integers(0, _numel(shape)), st.integers(0, _numel(shape))).map(
            lambda t: (t[0], min(t[1], t[2]), max(t[1], t[2]))
        )
    )
)


@settings(max_examples=400, deadline=None)
@given(boxes_st)
def test_flat_boxes_tile_the_range_with_at_most_2_ndim_minus_1_chunks(case):
    shape, lo, hi = case
    boxes = flat_boxes(shape, lo, hi)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    end = lo
    for box in boxes:
        assert box.start == end and box.stop > box.start  # in order, no gap, nothing empty
        end = box.stop
    assert end == hi or (not boxes and lo == hi)


@settings(max_examples=400, deadline=None)
@given(boxes_st)
def test_each_flat_box_is_the_chunk_at_its_offsets(case):
    shape, lo, hi = case
    full = torch.arange(_numel(shape)).reshape(shape)
    for box in flat_boxes(shape, lo, hi):
        assert len(box.offsets) == len(box.sizes) == len(shape)
        assert all(0 <= o and o + n <= d for o, n, d in zip(box.offsets, box.sizes, shape))
        chunk = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
        assert chunk.flatten().tolist() == list(range(box.start, box.stop))  # contiguous in the tensor


def test_flat_boxes_example_a_range_across_rows():
    # Rows 0..3 of 4 columns; elements 2..13 are the end of row 0, rows 1-2, the start of row 3.
    assert flat_boxes((4, 4), 2, 14) == [
        Box(2, 4, (0, 2), (1, 2)),
        Box(4, 12, (1, 0), (2, 4)),
        Box(12, 14, (3, 0), (1, 2)),
    ]


# ---- Strategy.align_buckets_to_blocks -------------------------------------------------------

block_params_st = st.lists(
    st.tuples(st.integers(-1, 3), shapes, st.sampled_from(DTYPES), st.integers(0, 1)),
    min_size=1,
    max_size=14,
).map(
    lambda rows: [
        ParamInfo(f"h.{b}.w{i}" if b >= 0 else f"head.w{i}", s, d, "cpu", g) for i, (b, s, d, g) in enumerate(rows)
    ]
)


@settings(max_examples=200, deadline=None)
@given(block_params_st, worlds, aligns, caps)
def test_blocks_keep_every_invariant_and_a_bucket_holds_one_block_or_none(params, world, align, cap):
    layout = plan_buckets(params, world, align, cap, blocks=aligned_blocks(params, True))
    assert sorted(layout.fqns) == sorted(p.fqn for p in params)
    for bucket in layout.buckets:
        assert len(bucket.slots) == 1 or bucket.nbytes <= cap  # the cap holds as without blocks
        runs = [block_of(s.fqn) for s in bucket.slots]
        # One block per bucket, unless the backward interleaves two (the order given here is random).
        contiguous = all(
            block_of(p.fqn) == block_of(q.fqn)
            for p, q in zip(params, params[1:])
            if block_of(p.fqn) and block_of(q.fqn)
        )
        if contiguous:
            assert len(set(runs)) == 1, runs


def _gpt_like(n_blocks: int) -> list[ParamInfo]:
    """Backward order of a small transformer: head, blocks last to first, embeddings."""
    block = [
        ("mlp.proj.bias", (64,)),
        ("mlp.proj.weight", (64, 256)),
        ("mlp.fc.weight", (256, 64)),
        ("ln.weight", (64,)),
        ("attn.qkv.weight", (192, 64)),
        ("attn.qkv.bias", (192,)),
    ]
    params = [ParamInfo("ln_f.weight", (64,), "float32", "cpu", 0)]
    for b in reversed(range(n_blocks)):
        params += [ParamInfo(f"transformer.h.{b}.{name}", shape, "float32", "cpu", 0) for name, shape in block]
    return params + [ParamInfo("wte.weight", (100, 64), "float32", "cpu", 0)]


def test_blocks_give_identical_blocks_identical_bucket_offsets_also_when_split_by_the_cap():
    def shape_of(bucket):  # what a kernel's code sees: shapes and offsets, not names
        return tuple((s.shape, s.offset, s.numel, s.padded) for s in bucket.slots), bucket.size

    for cap in (1 << 30, 70_000):  # all blocks fit; a block (about 150 KB) is split
        layout = plan_buckets(_gpt_like(4), 2, 256, cap, blocks=aligned_blocks(_gpt_like(4), True))
        per_block = {}
        for bucket in layout.buckets:
            blocks = {block_of(f) for f in bucket.fqns}
            assert len(blocks) == 1, bucket.fqns
            per_block.setdefault(blocks.pop(), []).append(shape_of(bucket))
        assert set(per_block) == {None, *(f"transformer.h.{b}" for b in range(4))}
        assert len({tuple(v) for k, v in per_block.items() if k is not None}) == 1, per_block
        assert len(per_block["transformer.h.0"]) == (1 if cap > 1e6 else 3)
    # Without blocks, all of it shares one bucket at the large cap: the blocks' offsets differ.
    assert len(plan_buckets(_gpt_like(4), 2, 256, 1 << 30).buckets) == 1


def test_block_of_is_the_first_numbered_module():
    assert block_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert block_of("model.layers.12.mlp.gate_proj.weight") == "model.layers.12"
    assert block_of("encoder.layer.0.attention.self.query.weight") == "encoder.layer.0"
    assert block_of("0.weight") is None and block_of("wte.weight") is None and block_of("h.3") is None


def _blocks_of(layout) -> list[set]:
    return [{block_of(f) for f in b.fqns} for b in layout.buckets]


def test_auto_aligns_repeated_blocks_of_a_mebibyte_or_more_and_packs_the_rest():
    wide = [ParamInfo(f"h.{b}.w", (512, 512), "float32", "cpu", 0) for b in reversed(range(3))]  # 1 MiB each
    small = [ParamInfo(f"h.{b}.w", (64, 64), "float32", "cpu", 0) for b in reversed(range(3))]  # 16 KiB each
    head = [ParamInfo("head.w", (512, 512), "float32", "cpu", 0)]
    assert MIN_ALIGNED_BLOCK_BYTES == 512 * 512 * 4
    assert aligned_blocks(head + wide, "auto") == {f"h.{b}.w": f"h.{b}" for b in range(3)}
    layout = plan_buckets(head + wide, 1, 256, 1 << 30, blocks=aligned_blocks(head + wide, "auto"))
    assert _blocks_of(layout) == [{None}, {"h.2"}, {"h.1"}, {"h.0"}]
    # Blocks under a mebibyte share buckets as without blocks (True would split them anyway).
    assert aligned_blocks(head + small, "auto") == {}
    assert len(plan_buckets(head + small, 1, 256, 1 << 30, blocks=aligned_blocks(head + small, "auto")).buckets) == 1
    assert len(plan_buckets(head + small, 1, 256, 1 << 30, blocks=aligned_blocks(head + small, True)).buckets) == 4
    assert aligned_blocks(head + wide, False) == {}


def test_auto_leaves_a_block_that_does_not_repeat_to_share_a_bucket():
    # Three blocks of one shape and one of another (a differently sized last layer): only the
    # three repeat, so only they can share kernels; the odd one packs with the head.
    params = [
        ParamInfo("head.w", (512, 512), "float32", "cpu", 0),
        ParamInfo("h.3.w", (512, 1024), "float32", "cpu", 0),
    ]
    params += [ParamInfo(f"h.{b}.w", (512, 512), "float32", "cpu", 0) for b in reversed(range(3))]
    assert set(aligned_blocks(params, "auto").values()) == {"h.0", "h.1", "h.2"}
    layout = plan_buckets(params, 1, 256, 1 << 30, blocks=aligned_blocks(params, "auto"))
    assert _blocks_of(layout) == [{None, "h.3"}, {"h.2"}, {"h.1"}, {"h.0"}]
    # Same shapes in another dtype or param group are not the same block.
    regrouped = [*params[:2], ParamInfo("h.2.w", (512, 512), "float32", "cpu", 1), *params[3:]]
    assert set(aligned_blocks(regrouped, "auto").values()) == {"h.0", "h.1"}


def test_align_rule_must_be_true_false_or_auto():
    with pytest.raises(UnsupportedError, match="True, False or 'auto'"):
        aligned_blocks(_gpt_like(2), "yes")
    for bad in ("yes", 1, None):
        with pytest.raises(UnsupportedError, match="align_buckets_to_blocks must be True, False or 'auto'"):
            gf.Strategy(align_buckets_to_blocks=bad)
