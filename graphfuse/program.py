"""`Program`: a traced training step (an aten-level FX graph) and the roles of its values."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch.fx

from graphfuse.optim import OptimSpec
from graphfuse.signature import Signature
from graphfuse.strategy import Strategy

if TYPE_CHECKING:
    from graphfuse.layout import BucketLayout
    from graphfuse.passes.serializer import StatePlan


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
class Program:
    """One rank's training step: `graph_module(*inputs) -> outputs`, inputs and outputs in
    the order of `signature`, plus what the runtime needs to own its tensors."""

    graph_module: torch.fx.GraphModule
    signature: Signature
    optim: OptimSpec
    inputs_meta: dict[str, TensorMeta]  # placeholder name -> how to allocate it
    strategy: Strategy = field(default_factory=Strategy)
    layout: BucketLayout | None = None
    passes: tuple[str, ...] = ()
    world_size: int = 1
    rank: int = 0
    group_name: str = ""  # the process group the collectives in the graph run on
    state_plan: StatePlan | None = None  # how state is saved and loaded (the serializer pass)

    def with_(self, **changes) -> Program:
        return replace(self, **changes)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def output_args(self) -> list[torch.fx.Node]:
        return list(self.graph.output_node().args[0])

    def node(self, name: str) -> torch.fx.Node:
        for n in self.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def input_node(self, name: str) -> torch.fx.Node:
        return self.placeholders()[self.signature.index(name)]
