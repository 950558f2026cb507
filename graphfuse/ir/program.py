"""`Program`: a traced training step (an aten-level FX graph) and the roles of its values."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import cast

import torch.fx

from graphfuse.errors import GraphfuseError
from graphfuse.ir.layout import Bucket, BucketLayout
from graphfuse.ir.signature import Signature
from graphfuse.ir.state_layout import state_bucket
from graphfuse.ir.state_plan import StatePlan
from graphfuse.optim import OptimSpec
from graphfuse.strategy import Strategy


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and device of one placeholder, as the runtime must allocate it."""

    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ...
    device: str  # "cpu", "cuda", ... (the type only: a program runs on any index)

    def to_json(self) -> list:
        return [list(self.shape), self.dtype, self.device]

    @classmethod
    def from_json(cls, d: list) -> TensorMeta:
        return cls(tuple(d[0]), d[1], d[2])


@dataclass(frozen=True)
class PassRun:
    """A pass that ran on a program, by name, with what it did. Only the name is compared and
    saved: the statistics describe one run (they are logged at DEBUG by the pipeline)."""

    name: str
    nodes_added: int = field(default=0, compare=False)
    nodes_removed: int = field(default=0, compare=False)
    collectives_added: int = field(default=0, compare=False)
    seconds: float = field(default=0.0, compare=False)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Handoffs:
    """Graph values one pass hands a later one, one node per bucket in layout order. They exist
    only while the pipeline runs (run_pipeline drops them); no file holds them."""

    grad_shards: tuple[torch.fx.Node, ...] | None = None  # averaged gradient shard (reduce_scatter, clip_grad_norm)
    param_shards: tuple[torch.fx.Node, ...] | None = None  # updated shard in the bucket's dtype (sharded_update)

    def nodes(self) -> list[torch.fx.Node]:
        return [n for f in (self.grad_shards, self.param_shards) if f is not None for n in f]


@dataclass(frozen=True)
class Program:
    """One rank's training step: `graph_module(*inputs) -> outputs`, inputs and outputs in
    the order of `signature`, plus what the runtime needs to own its tensors."""

    graph_module: torch.fx.GraphModule
    signature: Signature
    optim: OptimSpec
    inputs_meta: dict[str, TensorMeta]  # placeholder name -> how to allocate it
    strategy: Strategy = field(default_factory=Strategy)
    layout: BucketLayout | None = None
    passes: tuple[PassRun, ...] = ()  # what ran since capture, in order
    world_size: int = 1
    rank: int = 0
    group_name: str = ""  # the process group the collectives in the graph run on
    state_plan: StatePlan | None = None  # how state is saved and loaded (the serializer pass)
    handoffs: Handoffs = field(default_factory=Handoffs)  # pass-to-pass values, inside the pipeline only

    def with_(self, **changes) -> Program:
        return replace(self, **changes)

    def handing_off(self, **nodes: tuple[torch.fx.Node, ...]) -> Program:
        """This program with the hand-offs `nodes` (Handoffs fields) set."""
        return self.with_(handoffs=replace(self.handoffs, **nodes))

    @property
    def pass_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    @property
    def bucket_layout(self) -> BucketLayout:
        """`layout`, for code that runs only after plan_buckets set it."""
        if self.layout is None:
            raise GraphfuseError(
                f"this program has no bucket layout (passes run: {', '.join(self.pass_names) or 'none'}): "
                "run the graphfuse.passes pipeline (plan_buckets) on it first, as gf.compile does"
            )
        return self.layout

    @functools.cached_property  # of the layout and the optimizer, which with_() replaces, never edits
    def state_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """The state shards ("bucket<b>.<state>") whose members' states are not all shaped like
        the members (Adafactor's factored second moment): FQN -> the state's shape, for the
        members that have it (graphfuse.ir.state_layout.state_bucket lays such a shard out)."""
        out = {}
        for bucket in self.bucket_layout.buckets:
            spec = self.optim.groups[bucket.group]
            per = {s.fqn: spec.state_shapes(s.shape) for s in bucket.slots}
            for name in spec.state_names:
                shapes = {f: states[name] for f, states in per.items() if name in states}
                if shapes and any(shapes.get(s.fqn) != s.shape for s in bucket.slots):
                    out[f"{bucket.name}.{name}"] = shapes
        return out

    def bucket_states(self, bucket: Bucket) -> tuple[str, ...]:
        """The states `bucket` has a shard of: its group's, less those none of its members has."""
        spec = self.optim.groups[bucket.group]
        have = {name for s in bucket.slots for name in spec.state_shapes(s.shape)}
        return tuple(name for name in spec.state_names if name in have)

    def state_layout(self, bucket: Bucket, state: str) -> Bucket:
        """The layout of `bucket`'s shard of `state` (the bucket's own for a state shaped like
        each member, and for the fp32 master weights)."""
        return state_bucket(bucket, self.state_shapes.get(f"{bucket.name}.{state}"))

    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def output_args(self) -> list[torch.fx.Node]:
        return output_nodes(self.graph)

    def node(self, name: str) -> torch.fx.Node:
        for n in self.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def output_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The values a step's `graph` returns, in order (its output node's one tuple argument)."""
    outputs = graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)):
        raise GraphfuseError(
            f"the step's graph returns {type(outputs).__name__}, not a tuple of values: trace it again"
        )
    # FX types an argument as any Argument; a traced step returns graph values
    return cast(list[torch.fx.Node], list(outputs))


def arg_node(node: torch.fx.Node, i: int = 0) -> torch.fx.Node:
    """`node.args[i]` where the op takes a graph value there (a tensor input of an aten op): FX
    types every argument as any Argument, so this says which one the caller knows it to be."""
    return cast(torch.fx.Node, node.args[i])
