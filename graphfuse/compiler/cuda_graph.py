"""Whole-step CUDA graphs (`Strategy.cuda_graphs`, experimental): each inductor-compiled step
runs once un-captured, is captured at its next call and replayed from then on, so a step costs
one graph launch (plus a few copies) instead of one launch per kernel."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from graphfuse.errors import UnsupportedError
from graphfuse.ir import signature as sig
from graphfuse.ir.program import Program
from graphfuse.strategy import Strategy

log = logging.getLogger("graphfuse")

WAY_OUT = "or set Strategy(cuda_graphs=False)"


class CudaGraphs:
    """What the graphs of one DistModel share: their device, the side stream that warms them up
    and captures them (torch.cuda.graphs' docs: warm up on a side stream), and one memory pool.

    One pool serves every batch key's graph: a step's intermediates die within it and its only
    graph outputs (the loss) stay allocated while their graph lives, so a graph captured later
    reuses only memory no other graph holds live between replays, and replays may come in any
    order (they are serialised on the caller's stream, as every step is). Separate pools would
    each keep a step's activations reserved."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.captured = 0  # graphs captured so far (one per batch key that ran twice)

    def wrap(self, compiled: Callable, program: Program) -> GraphedStep:
        return GraphedStep(compiled, program, self)


def start(strategy: Strategy, model: torch.nn.Module, world_size: int, backend: str | None) -> CudaGraphs | None:
    """The shared state of the step's CUDA graphs, or None without `strategy.cuda_graphs`.
    Refuses, before anything is traced, what a CUDA graph cannot capture: collectives of a
    backend other than NCCL, collectives staged through the host, and tensors off the GPU."""
    if not strategy.cuda_graphs:
        return None
    if world_size > 1 and backend != "nccl":
        raise UnsupportedError(
            f"Strategy(cuda_graphs=True) captures the step's collectives in a CUDA graph, which NCCL allows and "
            f"{backend!r} (this process group's backend for CUDA tensors, at world size {world_size}) does not; "
            f"use an NCCL process group, {WAY_OUT}"
        )
    if world_size > 1 and strategy.stage_collectives_on_host is True:
        raise UnsupportedError(
            "Strategy(cuda_graphs=True) cannot capture collectives staged through the host "
            f"(stage_collectives_on_host=True): set stage_collectives_on_host=False with an NCCL group, {WAY_OUT}"
        )
    devices = set()
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.device.type != "cuda":
                raise UnsupportedError(
                    f"Strategy(cuda_graphs=True) replays the step on a CUDA device, but {kind} {name} is on "
                    f"{t.device}; move the model to the GPU (model.cuda()) before gf.compile, {WAY_OUT}"
                )
            devices.add(t.device)
    if len(devices) != 1:
        where = sorted(map(str, devices)) or "no device (the model has no parameters)"
        raise UnsupportedError(
            f"Strategy(cuda_graphs=True) needs the model on one CUDA device, found {where}; {WAY_OUT}"
        )
    return CudaGraphs(devices.pop())


class GraphedStep:
    """A compiled step (one that writes its buckets and shards in place) replayed from a CUDA
    graph. Every call is exactly one step:

    - call 1 runs it un-captured on the side stream: the warm-up the CUDA graph docs ask for
      (lazy initialisation, Triton's autotuning and kernel loading happen here);
    - call 2 captures it (nothing executes while a stream captures) and replays it;
    - later calls copy the batch into the static inputs made at capture and replay.

    The graph reads and writes every persistent tensor (buckets, shards, the step's scalars)
    at its address at capture; each replay checks that none has moved. Host scalars must be
    device tensors (execute.bind_tensors' `scalar_device`): a CPU scalar would be baked into
    the kernels' arguments at capture. Returns clones of the static outputs (the loss)."""

    writes_in_place = True

    def __init__(self, compiled: Callable, program: Program, graphs: CudaGraphs) -> None:
        self.compiled, self.graphs = compiled, graphs
        self.names = [s.name for s in program.signature.inputs]
        self.per_call = [i for i, s in enumerate(program.signature.inputs) if s.role in (sig.BATCH, sig.GRAD)]
        self.persistent = [i for i in range(len(self.names)) if i not in self.per_call]
        self.warmed_up = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: list[torch.Tensor] = []
        self.addresses: list[int] = []

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        graph = self.graph
        if graph is None:
            self._check_on_device(args)
            if not self.warmed_up:
                return self._warm_up(args)
            graph = self._capture(args)
        return self._replay(graph, args)

    def _check_on_device(self, args: Sequence[torch.Tensor]) -> None:
        for name, a in zip(self.names, args):
            if not (isinstance(a, torch.Tensor) and a.device == self.graphs.device):
                where = a.device if isinstance(a, torch.Tensor) else type(a).__name__
                raise UnsupportedError(
                    f"Strategy(cuda_graphs=True): the step's input {name} is on {where}, not {self.graphs.device}, "
                    f"and a CUDA graph reads device memory only; move the batch to {self.graphs.device}, {WAY_OUT}"
                )

    def _warm_up(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        main = torch.cuda.current_stream(self.graphs.device)
        side = self.graphs.stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            outs = self.compiled(*args)
        main.wait_stream(side)
        for out in outs:
            if isinstance(out, torch.Tensor):
                out.record_stream(main)  # made on the side stream, used by the caller on its own
        self.warmed_up = True
        return outs

    def _capture(self, args: Sequence[torch.Tensor]) -> torch.cuda.CUDAGraph:
        """Record one step into a graph; nothing executes, so a failure changes no state."""
        self.static_inputs = [torch.empty_like(args[i]) for i in self.per_call]
        captured = list(args)
        for i, buf in zip(self.per_call, self.static_inputs):
            captured[i] = buf
        graph, t = torch.cuda.CUDAGraph(), time.perf_counter()
        try:
            # "thread_local": other threads' CUDA calls (an async checkpoint save, NCCL's
            # watchdog) stay legal while this thread captures.
            with torch.cuda.graph(
                graph, pool=self.graphs.pool, stream=self.graphs.stream, capture_error_mode="thread_local"
            ):
                outs = self.compiled(*captured)
        except Exception as e:
            raise UnsupportedError(
                f"Strategy(cuda_graphs=True): capturing the step in a CUDA graph failed ({type(e).__name__}: {e}); "
                f"this call updated nothing. The step may read a value back to the host or use an op that cannot "
                f"be captured; {WAY_OUT}"
            ) from e
        self.graph, self.static_outputs = graph, list(outs)
        self.addresses = [args[i].data_ptr() for i in self.persistent]
        self.graphs.captured += 1
        log.info("graphfuse: captured the step in a CUDA graph in %.2f s", time.perf_counter() - t)
        return graph

    def _replay(self, graph: torch.cuda.CUDAGraph, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        for i, address in zip(self.persistent, self.addresses):
            if args[i].data_ptr() != address:
                raise UnsupportedError(  # before the replay: the step changed nothing
                    f"Strategy(cuda_graphs=True): the step's CUDA graph reads {self.names[i]} where it was at capture, "
                    "but that tensor has moved (replaced instead of copied into); load state with gf.load or "
                    "DistModel.load_state_dict, which copy in place"
                )
        for buf, i in zip(self.static_inputs, self.per_call):
            buf.copy_(args[i])
        graph.replay()
        return [out.clone() for out in self.static_outputs]
