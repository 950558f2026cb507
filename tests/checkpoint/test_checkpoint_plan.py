"""The checkpoint plan's box arithmetic, directly: `flat_boxes` splits a flat range of a tensor
into the fewest boxes that are each contiguous in it (property-tested)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphfuse.checkpoint.plan import flat_boxes


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    n = math.prod(shape)
    lo = draw(st.integers(0, n))
    hi = draw(st.integers(lo, n))
    return shape, lo, hi


@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_flat_boxes_tile_the_range_with_contiguous_boxes(case):
    shape, lo, hi = case
    boxes = flat_boxes(shape, lo, hi)
    index = torch.arange(math.prod(shape)).reshape(shape)
    at = lo
    for start, stop, offsets, sizes in boxes:
        assert start == at and stop > start  # consecutive, non-empty, in order
        box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert box.reshape(-1).tolist() == list(range(start, stop))  # the box is exactly that flat range
        at = stop
    assert at == hi or (not boxes and lo == hi)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
