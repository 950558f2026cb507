"""The sharded optimizer's state in torch.optim's form: full tensors keyed by FQN (gathered from
the shards, one all-gather per state shard), and loading that form, or a plain torch optimizer's
index-keyed state_dict(), through graphfuse.checkpoint's validated in-memory load."""

from __future__ import annotations

import torch

from graphfuse import signature as sig
from graphfuse.checkpoint.plan import MASTER
from graphfuse.errors import CheckpointMismatchError
from graphfuse.execute import backend_of
from graphfuse.optimizers import torch_host_states
from graphfuse.param_state import all_gather_flat

TORCH_MODE = "torch"


def _gather(opt, shard: torch.Tensor) -> torch.Tensor:
    """The whole bucket-sized tensor of which every rank holds `shard`."""
    if opt.world_size == 1:
        return shard
    # Gloo gathers host tensors only; the state goes back to the shard's device.
    host = backend_of(opt.group, shard.device.type) == "gloo" and shard.device.type != "cpu"
    src = shard.cpu() if host else shard.contiguous()
    whole = src.new_empty(src.numel() * opt.world_size)
    all_gather_flat(whole, src, opt.group)
    return whole.to(shard.device)


def torch_form(opt) -> dict:
    """{"state": {fqn: {state: full tensor, "step"}}, "param_groups": [{..., "params": [fqn]}]}:
    what get_optimizer_state_dict(model, optim, StateDictOptions(full_state_dict=True)) gives
    for the same plain torch optimizer, so that torch.optim loading it steps on exactly as
    graphfuse would. Collective: every rank must call it. fp32 master weights are left out
    (torch.optim has none); loading derives them from the weights."""
    shards = opt.program.signature.names(sig.SHARD)
    state: dict[str, dict] = {}
    with torch.no_grad():
        for bucket in opt.layout.buckets:
            for name in (n for n in shards if n.split(".", 1)[0] == bucket.name):
                what = name.split(".", 1)[1]
                if what == MASTER:
                    continue
                whole = _gather(opt, opt.tensors[name])
                for slot in bucket.slots:
                    full = whole[slice(*slot.data_range)].view(slot.shape).clone()
                    state.setdefault(slot.fqn, {})[what] = full
    for g, spec in enumerate(opt.program.optim.groups):
        if spec.has_step:
            # and the 0-d states graphfuse computes on the host (NAdam's mu_product, ASGD's eta and mu)
            host = torch_host_states(spec, opt.steps[g], opt.carried[g], float(opt.param_groups[g]["lr"]))
            for fqn in spec.params:
                state.setdefault(fqn, {}).update(step=torch.tensor(float(opt.steps[g])), **{k: v.clone() for k, v in host.items()})
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(spec.params)}
        for group, spec in zip(opt.param_groups, opt.program.optim.groups)
    ]
    return {"state": state, "param_groups": groups}


def load_torch_form(opt, sd: dict) -> None:
    """Load {"state", "param_groups"} keyed by FQN, or by parameter index in param-group order
    (a plain torch optimizer's state_dict()); the weights are left as they are."""
    from graphfuse import checkpoint

    names = list(opt.params)

    def fqn(key) -> str:
        if isinstance(key, int):
            if not 0 <= key < len(names):
                raise CheckpointMismatchError(
                    f"state dict: parameter index {key} is out of range; this optimizer has {len(names)} parameters"
                )
            return names[key]
        return key

    state = {fqn(k): v for k, v in sd["state"].items()}
    groups = [{**g, "params": [fqn(k) for k in g.get("params", [])]} for g in sd["param_groups"]]
    model = {k: v.detach().clone() for k, v in opt.model.state_dict().items()}
    checkpoint.load_state_dict(opt, {"model": model, "optim": {"state": state, "param_groups": groups}})
