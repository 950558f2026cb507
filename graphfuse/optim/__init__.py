"""torch.optim's elementwise updates as data and aten math, each module importing only the one
before it: spec (GroupSpec, OptimSpec: plain data) <- updates (one function per optimizer) <-
matrix (updates that read a whole parameter: Muon) <- rules (the table: states, host scalars,
update; the torch.optim class of each) <- describe (a user's optimizer, or several of them
(several.Optimizers), validated and described, the checks between steps, one group's update).
Other packages import these names from here."""

from graphfuse.optim.describe import NOT_ELEMENTWISE, SUPPORTED, check_group_unchanged, describe_optimizer, update
from graphfuse.optim.matrix import muon_apply, muon_lr, muon_momentum, muon_orthogonal, takes_stacks
from graphfuse.optim.rules import BOOL_SCALARS, CLASSES, Rule
from graphfuse.optim.several import Optimizers, as_one
from graphfuse.optim.sharded_state import ShardedState
from graphfuse.optim.spec import RULES, GroupSpec, OptimSpec
from graphfuse.optim.updates import torch_host_states

__all__ = [
    "BOOL_SCALARS",
    "CLASSES",
    "NOT_ELEMENTWISE",
    "RULES",
    "SUPPORTED",
    "GroupSpec",
    "OptimSpec",
    "Optimizers",
    "Rule",
    "ShardedState",
    "check_group_unchanged",
    "describe_optimizer",
    "torch_host_states",
    "as_one",
    "muon_apply",
    "muon_lr",
    "muon_momentum",
    "muon_orthogonal",
    "takes_stacks",
    "update",
]
