"""`BoundProgram`: the runtime's one owner of training state across steps (a Program, the tensors
it runs on, each param group's step count and carried scalars, the process group); `BoundFront`
gives a frontend that holds one (DistModel, ShardedOptimizer) its attributes, read through."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from graphfuse.ir.layout import BucketLayout
from graphfuse.ir.program import Program
from graphfuse.ranks import HeldGroup, group_info
from graphfuse.runtime.execute import bind_tensors, refresh_masters, run_step


class BoundProgram:
    """A process group's rank, then (after `bind`) a Program bound to the tensors it runs on.

    `program` is the program bound first; other programs of the same layout (another batch
    shape, a variant of the update) run on the same `tensors` through `step`. `steps[g]` is
    the number of steps param group g has taken, `carried[g]` what its last step left for
    the next (ASGD's eta); checkpoint loads write both.
    """

    group = HeldGroup()  # weakly: destroy_process_group() destroys it (graphfuse/ranks.py)
    program: Program
    tensors: dict[str, torch.Tensor]
    steps: list[int]
    carried: list[dict[str, float]]

    def __init__(self, group: dist.ProcessGroup | None, held_for: str) -> None:
        self.held_for = held_for  # the frontend's name, in HeldGroup's error (graphfuse/ranks.py)
        self.group, self.world_size, self.rank, self.group_name = group_info(group)

    def bind(
        self,
        program: Program,
        params: dict[str, torch.nn.Parameter],
        buffers: dict[str, torch.Tensor],
        scalar_device: torch.device | None = None,
    ) -> None:
        """Allocate `program`'s buckets and shards from `params` (their views from now on) and
        `buffers`, at step 0 with nothing carried (see execute.bind_tensors)."""
        self.tensors = bind_tensors(program, params, buffers, self.group, scalar_device=scalar_device)
        self.program = program
        self.steps = [0] * len(program.optim.groups)
        self.carried = [{} for _ in program.optim.groups]

    @property
    def layout(self) -> BucketLayout:
        return self.program.bucket_layout  # bind takes a compiled program: plan_buckets set it

    def step(
        self, program: Program, fn: Callable, param_groups: list[dict], per_call: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Run one step of `program` (this layout's; `fn` its executable) with `per_call`'s
        tensors: every group's step count advances, and what it carries is replaced, only if
        it ran (execute.run_step writes nothing on failure). Returns the outputs not written back."""
        steps = [s + 1 for s in self.steps]
        outs = run_step(program, fn, self.tensors, param_groups, steps, self.carried, per_call)
        self.steps = steps
        return outs

    def refresh_masters(self, fqns: set[str]) -> None:
        """The weights of `fqns` were written into the buckets: the fp32 master shards follow."""
        refresh_masters(self.program, self.tensors, fqns)

    def named_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's `slice@<fqn>` views: the parameter's data in the bucket shard, and
        `slice@<fqn>.<state>` in every state shard (and `.master`), padding excluded."""
        for bucket in self.layout.buckets:
            shards = [n.split(".", 1)[1] for n in self.tensors if n.startswith(bucket.name + ".")]
            layouts = {
                what: {s.fqn: s for s in self.program.state_layout(bucket, what).slices(self.rank)} for what in shards
            }
            for s in bucket.slices(self.rank):
                yield f"slice@{s.fqn}", self.tensors[bucket.name][slice(*bucket.bucket_range(self.rank, s))]
                for what in shards:
                    if s.fqn in layouts[what]:  # each state in its own shard's layout (Adafactor's factors)
                        part = slice(*layouts[what][s.fqn].shard_range)
                        yield f"slice@{s.fqn}.{what}", self.tensors[f"{bucket.name}.{what}"][part]


class BoundFront:
    """The training-state attributes of a frontend that holds its BoundProgram as `_bound`
    (what graphfuse.checkpoint.TrainingState reads): each reads, and `steps`/`carried` write,
    the BoundProgram's own, so that there is one copy of each."""

    _bound: BoundProgram

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._bound.group

    @property
    def rank(self) -> int:
        return self._bound.rank

    @property
    def world_size(self) -> int:
        return self._bound.world_size

    @property
    def group_name(self) -> str:
        return self._bound.group_name

    @property
    def program(self) -> Program:
        return self._bound.program

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self._bound.tensors

    @property
    def layout(self) -> BucketLayout:
        return self._bound.layout

    @property
    def steps(self) -> list[int]:
        return self._bound.steps

    @steps.setter
    def steps(self, value: list[int]) -> None:
        self._bound.steps = value

    @property
    def carried(self) -> list[dict[str, float]]:
        return self._bound.carried

    @carried.setter
    def carried(self, value: list[dict[str, float]]) -> None:
        self._bound.carried = value
