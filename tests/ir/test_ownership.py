"""Property tests of whole-parameter ownership (graphfuse.ir.ownership, plan_buckets(whole=...)):
every parameter updated whole lies inside one rank's shard, owners balance the update's cost,
the padding stays within its bound, and parameters updated elementwise are laid out as before."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphfuse.ir.layout import ParamInfo, itemsize, plan_buckets
from graphfuse.ir.ownership import assign, padding_bound, place

DTYPES = ["float32", "bfloat16", "float64"]
matrices = st.tuples(st.integers(1, 40), st.integers(1, 40))
params_st = st.lists(
    st.tuples(
        st.one_of(matrices, st.tuples(st.integers(1, 30))), st.sampled_from(DTYPES), st.integers(0, 1), st.booleans()
    ),
    min_size=1,
    max_size=14,
).map(lambda rows: [(ParamInfo(f"layer{i}.w", s, d, "cpu", g), whole) for i, (s, d, g, whole) in enumerate(rows)])
worlds = st.integers(1, 6)
aligns = st.sampled_from([1, 4, 16, 64])
caps = st.integers(1, 16384)


def newton_schulz_cost(shape: tuple[int, ...]) -> int:
    """m·n·min(m, n) for a matrix (a Newton-Schulz step's multiply-adds up to a constant, what
    tracing.whole_cost counts for Muon), the elements otherwise: a cost that is not the length."""
    m, n = shape if len(shape) == 2 else (1, shape[0])
    return m * n * min(m, n)


def _plan(rows, world, align, cap):
    params = [p for p, _ in rows]
    whole = {p.fqn: newton_schulz_cost(p.shape) for p, w in rows if w}
    return params, whole, plan_buckets(params, world, align, cap, whole=whole)


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_a_parameter_updated_whole_lies_in_one_shard_and_every_element_has_one_owner(rows, world, align, cap):
    params, whole, layout = _plan(rows, world, align, cap)
    seen = {p.fqn: [0] * p.numel for p in params}
    for bucket in layout.buckets:
        assert bucket.size % (world * max(1, align // itemsize(bucket.dtype))) == 0
        assert len({f in whole for f in bucket.fqns}) == 1  # whole and elementwise never share a bucket
        for rank in range(world):
            end = 0
            for s in bucket.slices(rank):
                assert end <= s.shard_start < s.shard_end <= bucket.shard_size
                end = s.shard_end
                seen[s.fqn][s.param_start : s.param_start + s.numel] = [
                    x + 1 for x in seen[s.fqn][s.param_start : s.param_start + s.numel]
                ]
                if s.fqn in whole:  # the whole parameter, in the shard of its owner
                    assert (s.param_start, s.numel) == (0, bucket.slot(s.fqn).numel)
                    assert bucket.owner(s.fqn) == rank
    assert seen == {p.fqn: [1] * p.numel for p in params}


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_padding_of_a_bucket_laid_out_whole_is_within_its_bound(rows, world, align, cap):
    params, whole, layout = _plan(rows, world, align, cap)
    for bucket in layout.buckets:
        if bucket.fqns[0] not in whole:
            continue
        a = max(1, align // itemsize(bucket.dtype))
        sizes = [-(-s.numel // a) * a for s in bucket.slots]
        assert bucket.size - sum(sizes) <= padding_bound(sizes, world, a)
        # slots tile the bucket in offset order: each one's padding reaches the next
        assert [s.offset for s in bucket.slots] == sorted(s.offset for s in bucket.slots)
        assert sum(s.padded for s in bucket.slots) == bucket.size and bucket.slots[0].offset == 0


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_a_ranks_same_shape_parameters_lie_next_to_each_other_in_its_shard(rows, world, align, cap):
    """What lets CUDA's batched Newton-Schulz read a rank's same-shape matrices as one view:
    in each rank's shard of a bucket laid out whole, no other shape lies between two of one
    shape, and those of one shape keep the order given."""
    params, whole, layout = _plan(rows, world, align, cap)
    order = {p.fqn: i for i, p in enumerate(params)}
    for bucket in layout.buckets:
        if bucket.fqns[0] not in whole:
            continue
        for rank in range(world):
            shapes = [bucket.slot(s.fqn).shape for s in bucket.slices(rank)]
            runs = [shape for i, shape in enumerate(shapes) if i == 0 or shapes[i - 1] != shape]
            assert len(runs) == len(set(runs))  # each shape in one run
            for shape in set(shapes):
                fqns = [s.fqn for s in bucket.slices(rank) if bucket.slot(s.fqn).shape == shape]
                assert [order[f] for f in fqns] == sorted(order[f] for f in fqns)


def test_a_run_keeps_kinds_together_in_order_of_first_appearance():
    at = place([4, 4, 4, 4, 4], [1, 1, 1, 1, 1], 1, 1, kinds=["a", "b", "a", "c", "b"])
    assert at.offsets == (0, 8, 4, 16, 12)  # a a b b c
    assert place([4, 4], [1, 1], 1, 1).offsets == (0, 4)


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_elementwise_parameters_are_laid_out_as_without_ownership(rows, world, align, cap):
    """...as the same parameters planned without those updated whole (which get buckets of their own)."""
    params = [p for p, _ in rows]
    alone = [p for p, w in rows if not w]
    plain = plan_buckets(alone, world, align, cap) if alone else None
    mixed = plan_buckets(params, world, align, cap, whole={p.fqn: 1 for p, w in rows if w})
    elementwise = {p.fqn for p, w in rows if not w}
    expected = [b.slots for b in plain.buckets] if plain else []
    assert [b.slots for b in mixed.buckets if b.fqns[0] in elementwise] == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 10**6)), min_size=1, max_size=20), st.integers(1, 8))
def test_owners_fill_ranks_in_order_within_the_length_cap(members, world):
    sizes, costs = [s for s, _ in members], [c for _, c in members]
    owners = assign(sizes, costs, world)
    used = sorted(set(owners))
    assert used == list(range(len(used)))  # the ranks owning nothing are the last ones
    cap = -(-sum(sizes) // world) + max(sizes)
    assert all(sum(s for s, o in zip(sizes, owners) if o == r) <= cap for r in range(world))
    at = place(sizes, costs, world, 1)
    assert at.size - sum(sizes) <= padding_bound(sizes, world, 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30), st.integers(1, 8), st.integers(1, 50))
def test_equal_matrices_are_spread_evenly(n, world, side):
    owners = assign([side * side] * n, [side**3] * n, world)
    counts = [owners.count(r) for r in range(world)]
    assert max(counts) - min(counts) <= 1


def test_owners_balance_newton_schulz_cost_not_elements():
    # A 64x64 matrix costs 64x as much as a 1x4096 one of the same length: with two ranks, the
    # square one alone on rank 0, the three long ones on rank 1 (cost 3·4096 < 64³; their
    # length 12288 is just within the cap ceil(4·4096 / 2) + 4096).
    shapes = [(64, 64), (1, 4096), (1, 4096), (1, 4096)]
    assert assign([4096] * 4, [newton_schulz_cost(s) for s in shapes], 2) == [0, 1, 1, 1]


def test_costs_equalise_where_they_can_and_the_length_cap_binds():
    assert assign([16, 16, 16, 16], [8, 4, 2, 2], 2) == [0, 1, 1, 1]  # costs 8 | 4 + 2 + 2
    # cap ceil(51 / 2) + 10 = 36: rank 1 (cheaper) takes three of the long ones, then is full
    assert assign([1, 10, 10, 10, 10, 10], [100, 1, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 0, 0]
    at = place([1, 10, 10, 10, 10, 10], [100, 1, 1, 1, 1, 1], 2, 1)
    assert at.size == 2 * 30 and at.offsets == (0, 30, 40, 50, 1, 11)


def _factor(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A state not shaped like its parameter: Adafactor's row factor of a matrix."""
    return (*shape[:-1], 1)


@settings(max_examples=200, deadline=None)
@given(params_st, worlds, aligns, caps)
def test_a_state_not_shaped_like_its_parameter_lies_whole_with_its_owner(rows, world, align, cap):
    """graphfuse.ir.layout.state_bucket: each member's state (a matrix's row factor; none for a
    vector) lies whole in the state shard of the rank that owns the member, the owner's members
    in bucket order without overlap, every state shard as long as the longest run; a bucket laid
    out elementwise, whose members may cross shards, is refused."""
    import pytest

    from graphfuse.errors import GraphfuseError
    from graphfuse.ir.state_layout import state_bucket

    params, whole, layout = _plan(rows, world, align, cap)
    for bucket in layout.buckets:
        shapes = {s.fqn: _factor(s.shape) for s in bucket.slots if len(s.shape) == 2}
        if bucket.fqns[0] not in whole:
            crossing = any(
                bucket.owner(f) != (bucket.slot(f).offset + bucket.slot(f).numel - 1) // bucket.shard_size
                for f in shapes
            )
            if crossing:
                with pytest.raises(GraphfuseError, match="crosses a shard boundary"):
                    state_bucket(bucket, shapes)
            continue
        assert state_bucket(bucket, None) is bucket
        states = state_bucket(bucket, shapes)
        runs = [[f for f in bucket.fqns if f in shapes and bucket.owner(f) == r] for r in range(world)]
        assert states.shard_size == max(1, *(sum(shapes[f][0] for f in run) for run in runs))
        assert states.size == world * states.shard_size and states.fqns == tuple(f for run in runs for f in run)
        for r, run in enumerate(runs):
            slices = states.slices(r)
            assert [s.fqn for s in slices] == run
            end = 0
            for s in slices:
                slot = states.slot(s.fqn)
                assert slot.shape == shapes[s.fqn] and (s.param_start, s.numel) == (0, slot.numel)
                assert s.shard_start == end  # packed, in bucket order
                end = s.shard_end
