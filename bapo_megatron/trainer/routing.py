"""The MoE routers of one trainer rank: rollout routing replay, and what the routers decided.

Replay (R3): before each micro-batch's forward on a model chunk, every MoE router of that chunk
is given the engine's experts for the tokens it will see, through Megatron's router replay
(`moe_enable_routing_replay`, REPLAY_FORWARD); the router then weighs the given experts with its
own probabilities, so its weights still train. A router sees its input as [seq, batch] flattened
sequence-major, under sequence parallel only this tensor-parallel rank's slice of the sequence;
with pipeline parallel a chunk holds some of the layers (its routers know their global layer);
expert parallel does not change what a router sees (it routes its rank's own tokens).

Full recompute (parallel.recompute=full) runs a recomputed layer twice: inside Megatron's
checkpoint (reentrant: under no_grad, only the layer's input kept), then again inside the backward
pass when its micro-batch is backpropagated, by which time the pipeline may have sent later
micro-batches forward. One forward pre-hook per router sets the routes of each run. A run inside
the autograd engine's backward (`torch._C._current_graph_task_id() != -1`, FSDP2's own test; true
on whichever thread runs the backward) is a rerun: it takes the oldest routes queued on its router.
A run under no_grad in a pass that backpropagates (grad was on when the micro-batch was given) is a
recomputed layer's first run: it queues the routes it took (the engine's, or None: its own choice).
Each chunk's micro-batches are backpropagated in the order they went forward (1F1B, interleaved
too: Megatron's schedules pop their tensors first in, first out), so the oldest is the right one;
a rerun with nothing queued fails. A router thus keeps the routes of its stage's micro-batches in
flight, and only in a recomputed layer: runs with grad on (layers not recomputed; selective
recompute, which reruns core attention only) and forward-only passes under no_grad (the bounds
prepass, the weight-sync probe) queue nothing. Megatron's REPLAY_BACKWARD is not used: its list is
appended to by every set_target_indices, for every layer, recomputed or not, and cannot say "route
yourself" for a micro-batch without the engine's routes; both runs take theirs as REPLAY_FORWARD.

Whatever the routes, every router's decisions are observed (a forward hook): the tokens each
expert received (the load: max over mean tokens per expert, per layer; padding not counted) and, where the engine's
routes are known, how many of the router's own top-k choices differ from the engine's (the
router disagreement, measured with replay on or off). Every (token, layer) decision is made on
exactly one rank (data parallel splits samples, sequence parallel the sequence, pipeline the
layers), so the step's figures are sums over the world; a rerun in the backward pass is not
counted again.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.dist_ckpt import unwrap
from bapo_megatron.trainer.microbatch import MicroBatch
from bapo_megatron.trainer.parallel import ParallelInfo


class _Router:
    """One MoE layer's router on this rank and what it saw during the current micro-batch."""

    def __init__(self, module: torch.nn.Module, ordinal: int, experts: int) -> None:
        self.module, self.ordinal = module, ordinal
        self.target: torch.Tensor | None = None  # [tokens, top_k] the engine's experts, when known
        self.known: torch.Tensor | None = None  # [tokens] True where `target` was recorded
        self.real: torch.Tensor | None = None  # [tokens] True at the samples' tokens (not padding)
        self.load = torch.zeros(experts, dtype=torch.float64)
        self.rerun: deque[torch.Tensor | None] = deque()  # the routes of runs to repeat in the backward pass


class Routers:
    """Every MoE router of this rank's model chunks, by chunk."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        spec: ModelSpec,
        info: ParallelInfo,
        sequence_parallel: bool,
        device: torch.device,
    ) -> None:
        self.spec, self.info, self.sequence_parallel, self.device = spec, info, sequence_parallel, device
        self.top_k = spec.moe.top_k
        ordinal = {layer: i for i, layer in enumerate(spec.moe.sparse_layers)}
        self.by_chunk: dict[int, list[_Router]] = {}
        self.routers: list[_Router] = []
        for chunk in chunks:
            found = []
            for layer in unwrap(chunk).decoder.layers:
                index = layer.layer_number - 1
                if index in ordinal:
                    router = _Router(layer.mlp.router, ordinal[index], spec.moe.num_experts)
                    layer.mlp.router.register_forward_pre_hook(self._replayer(router))
                    layer.mlp.router.register_forward_hook(self._observer(router))
                    found.append(router)
            self.by_chunk[id(chunk)] = found
            self.routers += found
        self.counting = False
        self.replay = False  # the pass replays the engine's routes (where a micro-batch has them)
        self.backprop = False  # the pass backpropagates (a checkpointed run is repeated)
        self.disagree = torch.zeros(2, dtype=torch.float64)  # [sum of differing shares, decisions]

    def before_forward(self, chunk: torch.nn.Module, mb: MicroBatch, replay: bool) -> None:
        """Give `chunk`'s routers `mb`'s routes (to replay when `replay`, to compare with in any case)."""
        self.replay, self.backprop = replay, torch.is_grad_enabled()
        for router in self.by_chunk.get(id(chunk), []):
            target = known = None
            if mb.routes is not None:
                target = self._as_seen(mb.routes[:, :, router.ordinal, :], router).reshape(-1, self.top_k)
                known = self._as_seen(mb.route_mask, router).reshape(-1)
            router.target, router.known = target, known
            router.real = self._as_seen(mb.token_mask, router).reshape(-1)

    def _replayer(self, router: _Router):
        """The router's forward pre-hook: the routes this run takes (the module docstring says how)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def replay(module, args) -> None:
            if _in_backward():
                assert router.rerun, f"MoE layer {router.ordinal}'s router reran without a kept first run"
                routes = router.rerun.popleft()
            else:
                routes = router.target if self.replay else None
                if self.backprop and not torch.is_grad_enabled():  # a checkpointed run: repeated in the backward
                    router.rerun.append(routes)
            state = module.router_replay
            state.target_topk_idx = routes  # not set_target_indices: its backward list would only grow
            if routes is None:
                state.clear_router_replay_action()
            else:
                state.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        return replay

    def _as_seen(self, per_position: torch.Tensor, router: _Router) -> torch.Tensor:
        """[batch, seq, ...] as the router sees its tokens: [seq, batch, ...], this rank's sequence
        slice under sequence parallel."""
        seen = per_position.transpose(0, 1)
        if self.sequence_parallel and self.info.tp_size > 1:
            part = seen.shape[0] // self.info.tp_size
            seen = seen[self.info.tp_rank * part : (self.info.tp_rank + 1) * part]
        return seen.to(router.module.weight.device)

    def end_pass(self) -> None:
        """Forget the pass's routes."""
        for router in self.routers:
            router.module.router_replay.clear_indices()
            router.module.router_replay.clear_router_replay_action()
            router.target = router.known = router.real = None
            router.rerun.clear()  # an interrupted pass's
        self.replay = self.backprop = False

    def _observer(self, router: _Router):
        def observe(module, args, output) -> None:
            if not self.counting or _in_backward():  # a recomputed layer's rerun: counted on its first run
                return
            _, routing_map = output
            real = router.real.to(routing_map.device).unsqueeze(1)
            router.load += (routing_map.detach() & real).sum(0).to(router.load)  # padding routes too: not counted
            if router.target is None:
                return
            with torch.no_grad():
                own = _own_choice(module, args[0])
                shared = own.gather(1, router.target.long()).sum(1)
                differ = (self.top_k - shared).double() / self.top_k
                known = router.known.to(differ.device)
                self.disagree += torch.stack([(differ * known).sum(), known.sum().double()]).cpu()

        return observe

    def metrics(self) -> dict[str, float]:
        """The step's router figures (summed over every rank), then zeroed: per-layer load (max over
        mean tokens per expert) and its maximum over layers; the router disagreement where the
        engine's routes were known. Every rank calls it (a collective)."""
        layers = len(self.spec.moe.sparse_layers)
        load = torch.zeros(layers, self.spec.moe.num_experts, dtype=torch.float64)
        for router in self.routers:
            load[router.ordinal] += router.load
            router.load.zero_()
        flat = torch.cat([load.reshape(-1), self.disagree])
        if dist.is_initialized() and dist.get_world_size() > 1:
            flat = flat.to(self.device)
            dist.all_reduce(flat)
            flat = flat.cpu()
        self.disagree.zero_()
        load = flat[:-2].view(layers, -1)
        out: dict[str, float] = {}
        mean = load.mean(1)
        balance = torch.where(mean > 0, load.max(1).values / mean.clamp(min=1e-12), torch.ones_like(mean))
        for ordinal, layer in enumerate(self.spec.moe.sparse_layers):
            out[f"moe/load/layer{layer}"] = float(balance[ordinal])
        out["moe/load_max"] = float(balance.max())
        if flat[-1] > 0:
            out["moe/router_disagreement"] = float(flat[-2] / flat[-1])
        return out


def _own_choice(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[tokens, experts] True at the experts Megatron's TopKRouter `router` chooses itself for `hidden`:
    its score function, expert bias and group limit, without replay (what top-k of its logits is only
    for a softmax router)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    config = router.config
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.detach().float().t()
    if router.bias is not None:  # a router with a bias (gpt-oss's, add_bias_linear)
        logits = logits + router.bias.detach().float()
    _, chosen = topk_routing_with_score_function(
        logits,
        router.topk,
        use_pre_softmax=config.moe_router_pre_softmax,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        score_function=router.score_function,
        expert_bias=router.expert_bias,
    )
    return chosen


def _in_backward() -> bool:
    """Whether this thread runs inside the autograd engine's backward pass (a recomputed layer's rerun)."""
    return torch._C._current_graph_task_id() != -1


def aux_loss_metric(microbatches: int) -> dict[str, float]:
    """The load-balancing loss (unscaled by its coefficient) of the step's update, mean over MoE layers
    and this rank's `microbatches` (Megatron's tracker sums them; reduced over pipeline and data
    parallel ranks, then cleared): a collective of every rank."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if "load_balancing_loss" not in tracker:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
    values = tracker["load_balancing_loss"]["values"].double().cpu().clone()
    moe_utils.clear_aux_losses_tracker()
    sparse = values[values != 0]
    return {"moe/aux_loss": float(sparse.mean()) / microbatches if sparse.numel() else 0.0}
