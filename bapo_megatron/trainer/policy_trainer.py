"""The policy update: BAPO (or a baseline) inside Megatron-Core's pipeline schedule.

One optimizer step on a list of samples:
  1. advantages from group rewards; samples split over data-parallel ranks and into
     micro-batches by token budget (every rank the same number);
  2. where needed (BAPO with bound_scope "step", or a decoupled rollout correction), a
     forward-only pass at the parameters of the start of the step: per-micro-batch BAPO
     tables summed, ONE all-reduce over data x context parallel on the last stage (one more
     for the step's mean importance weight under batch normalisation), and pi_prox for the
     correction (with one micro-batch a rank, taken from the training pass's own forward
     instead: _folds_prepass); with a KL loss (algo.kl_coef > 0), one more through
     the frozen reference model (trainer/reference.py), or under LoRA the policy's own chunks
     with the adapters off, for pi_ref;
  3. the training pass through get_forward_backward_func: forward_step on every stage,
     the loss on the last, (loss_sum, token_count) so that finalize_model_grads divides
     by the step's global token count;
  4. a non-finite loss or gradient on any rank skips the step (no NaN ever reaches the
     weights); else the optimizer and LR schedule step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from bapo_megatron.algo import rollout_corr_metrics as corr_metrics
from bapo_megatron.algo.advantages import group_advantages
from bapo_megatron.algo.bapo import BoundSearch, ClipBounds
from bapo_megatron.algo.losses import PolicyBatch, importance_ratio, policy_loss
from bapo_megatron.algo.metrics import LossOutput, reduce_metrics
from bapo_megatron.algo.rollout_correction import Sequences, apply_correction, batch_mean_parts, normaliser
from bapo_megatron.common.batch import RolloutBatch
from bapo_megatron.common.progress import Progress, bars_on
from bapo_megatron.config import JobConfig
from bapo_megatron.errors import NonFiniteInputError
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer import megatron_config as mc
from bapo_megatron.trainer.logprobs import vocab_parallel_logprobs
from bapo_megatron.trainer.lora import adapters_off
from bapo_megatron.trainer.microbatch import MicroBatch
from bapo_megatron.trainer.packing import microbatch_layout
from bapo_megatron.trainer.parallel import ParallelInfo
from bapo_megatron.trainer.reference import ReferenceModel
from bapo_megatron.trainer.routing import Routers, aux_loss_metric


@dataclass
class StepState:
    """What one optimizer step's loss callbacks need, handed to them (never kept on the trainer)."""

    temperature: float
    first_update: bool
    bounds: ClipBounds | None = None
    """The step's BAPO bounds from the prepass (None: searched in the loss, or fixed bounds)."""
    skip_reason: str = ""
    """Why the step will be skipped (a non-finite input found by a collective check); empty: it will not."""
    version: int | None = None
    """The policy version the step's weights are (the batch's metadata), where the rollout says."""
    is_parts: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's (sum, count) of the importance weights' mean (rollout_is_batch_normalize)."""
    is_scale: torch.Tensor | None = None
    """The step's mean importance weight over every rank, the batch normalisation's divisor."""
    folded: bool = False
    """The prepass's figures come from the training forward (PolicyTrainer._folds_prepass)."""


@dataclass
class StepResult:
    metrics: dict[str, float]
    skipped: bool


class PolicyTrainer:
    """Megatron model chunks, optimizer and LR schedule of one trainer rank, and its step."""

    def __init__(self, spec: ModelSpec, cfg: JobConfig, info: ParallelInfo) -> None:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer

        self.spec, self.cfg, self.info = spec, cfg, info
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = [
            DistributedDataParallel(
                config=chunk.config, ddp_config=mc.ddp_config(cfg.model), module=chunk, disable_bucketing=i > 0
            )
            for i, chunk in enumerate(self._build_chunks())
        ]
        self.optimizer = get_megatron_optimizer(mc.optimizer_config(cfg.optimizer, cfg.model), self.model)
        total = cfg.steps * cfg.algo.updates_per_batch
        self.scheduler = mc.lr_scheduler(self.optimizer, cfg.optimizer, total)
        config = self.model[0].config
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        self.search = BoundSearch(cfg.algo.bapo)
        self.layout = microbatch_layout(spec, cfg.model, cfg.parallel, mc.sequence_multiple(cfg.model, cfg.parallel))
        self.vocab_local = mc.padded_vocab(spec, cfg.model, cfg.parallel) // info.tp_size
        self.step = 0
        self.progress = bars_on(cfg.logging.progress) and dist.get_rank() == 0  # on the rank that logs
        from bapo_megatron.trainer.checkpoint import model_files

        # what checkpoints carry of the model (its HF config, tokenizer), read now: model.hf_path may be
        # gone by the time a checkpoint is saved (a moved or unmounted directory must not fail the save)
        self.model_files = model_files(spec, cfg.model.hf_path, cfg.model.mcore_path) if dist.get_rank() == 0 else {}
        self.routers = None
        if spec.moe is not None:
            self.routers = Routers(self.model, spec, info, cfg.parallel.sequence_parallel, self.device)
        self.reference = self.reference_routers = None
        # a frozen copy, its weights copied in by hold_reference or loaded with a checkpoint; under LoRA
        # the base with the adapters off is the starting policy, so no copy (trainer/reference.py)
        if cfg.algo.kl_coef > 0 and not cfg.model.lora.enabled:
            self.reference = ReferenceModel(self._build_chunks(initialize=False))
            if spec.moe is not None:  # the engine's routes replayed there too, as in the policy's passes
                sp = cfg.parallel.sequence_parallel
                self.reference_routers = Routers(self.reference.chunks, spec, info, sp, self.device)

    def _build_chunks(self, initialize: bool = True) -> list[torch.nn.Module]:
        from megatron.core import parallel_state as ps

        vpp = self.cfg.parallel.virtual_pipeline
        chunks = []
        for vp_stage in range(vpp or 1):
            stage = vp_stage if vpp else None
            chunk = mc.build_gpt_model(
                self.spec,
                self.cfg.model,
                self.cfg.parallel,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=stage),
                vp_stage=stage,
                initialize=initialize,
            )
            chunks.append(chunk.to(self.device))
        return chunks

    def load_weights(self, directory) -> None:
        """Model weights from a dist checkpoint (converted, or saved by any layout), without the
        optimizer's state. The optimizer's fp32 main parameters are refreshed from them
        (Megatron's reload_model_params): with bf16/fp8 parameters, the next step would
        otherwise go on from the old values and write them back over the loaded weights."""
        from bapo_megatron.trainer.dist_ckpt import load_model

        load_model(self.model, directory)
        self.optimizer.reload_model_params()

    def hold_reference(self) -> None:
        """The reference model of the KL loss (algo.kl_coef > 0) := the policy's weights now: called
        once the starting weights are loaded (job.py). A resume does not call it: the checkpoint
        holds the reference of the run's start (trainer/checkpoint.py). Nothing to hold under LoRA:
        the frozen base is the reference."""
        if self.reference is not None:
            self.reference.copy_from(self.model)

    # ------------------------------------------------------------------------------------------
    # Data.

    def microbatches(self, batch: RolloutBatch) -> tuple[list[MicroBatch], dict[str, float]]:
        """This rank's micro-batches of `batch`, with group-normalised advantages (none for
        supervised samples, which carry no reward), the advantages' metrics and the step's packing
        efficiency (real over computed tokens, every rank's)."""
        advantages, metrics = [0.0] * len(batch), {}
        if self.cfg.algo.loss != "sft":
            order, rewards = batch.rewards_by_group()
            adv, metrics = group_advantages(rewards, self.cfg.algo.advantage)
            for i, a in zip(order, adv.reshape(-1).tolist(), strict=True):
                advantages[i] = a
        interleaved = len(self.model) > 1  # virtual pipeline stages: micro-batches in groups of PP
        lengths = [s.length for s in batch.samples]
        plan = self.layout.plan(lengths, self.info.dp_size, multiple_of=self.info.pp_size if interleaved else 1)
        metrics["perf/packing_efficiency"] = sum(lengths) / self.layout.computed_tokens(lengths, plan)
        mbs = [mb.to(self.device) for mb in self.layout.build(batch.samples, plan[self.info.dp_rank], advantages)]
        return mbs, metrics

    # ------------------------------------------------------------------------------------------
    # The schedule and the loss.

    def _forward_step(self, loss_fn, bar: Progress, routers: Routers | None, data_iterator, model):
        mb = next(data_iterator)
        bar.update()
        if routers is not None:
            routers.before_forward(model, mb, replay=self.cfg.algo.routing_replay)
        output = model(mb.input_ids, mb.position_ids, **self.layout.attention.inputs(mb))
        return output, partial(loss_fn, mb)

    def _run(
        self, mbs: list[MicroBatch], loss_fn, forward_only: bool, label: str = "", reference: bool = False
    ) -> list:
        """The schedule over `mbs` through the policy (or, `reference`, the reference model); with
        self.progress and a label, a bar over its micro-batches (forward steps: one a micro-batch
        and virtual stage)."""
        chunks, routers = (self.reference.chunks, self.reference_routers) if reference else (self.model, self.routers)
        iterator = [iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs)
        total = len(mbs) * len(chunks)
        with Progress(total, label, unit="mb", enabled=self.progress and bool(label)) as bar:
            try:
                step = partial(self._forward_step, loss_fn, bar, routers)
                return self._schedule(mbs, step, forward_only, iterator, chunks)
            finally:
                if routers is not None:
                    routers.end_pass()

    def _schedule(self, mbs: list[MicroBatch], forward_step, forward_only: bool, iterator, chunks) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterator,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(mbs),
            seq_length=max(mb.input_ids.shape[1] for mb in mbs),
            micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
            forward_only=forward_only,
        )

    def _logprobs(self, mb: MicroBatch, logits: torch.Tensor, temperature: float, with_top: bool = False):
        """(log-probs, entropy) of mb's targets, and with_top each position's greedy log-prob."""
        return vocab_parallel_logprobs(
            logits,
            mb.targets,
            group=self.info.tp_group,
            vocab_start=self.info.tp_rank * self.vocab_local,
            vocab_size=self.spec.vocab_size,
            temperature=temperature,
            memory_budget_bytes=self.cfg.model.logprob_memory_mb << 20,
            fused=self.cfg.model.fused_logprobs and logits.is_cuda,
            with_top=with_top,
        )

    def _sequences(self, mb: MicroBatch) -> Sequences:
        """Which sample each position of `mb` belongs to (padded rows or a packed row)."""
        if mb.cu_seqlens is None:
            return Sequences.rows(mb.loss_mask.shape, len(mb.sample_index), mb.loss_mask.device)
        return Sequences.packed(mb.cu_seqlens, len(mb.sample_index), mb.loss_mask.shape[1])

    def _stats_loss(self, step: StepState, mb: MicroBatch, logits: torch.Tensor):
        """Forward-only pass: keep pi_prox and this micro-batch's part of the BAPO table."""
        logp, _ = self._logprobs(mb, logits, step.temperature)
        table = self._stats(step, mb, logp.detach())
        return logits.new_zeros(()), torch.tensor(mb.num_tokens, dtype=torch.int), table

    def _stats(self, step: StepState, mb: MicroBatch, logp: torch.Tensor) -> torch.Tensor:
        """mb's pi_prox (`logp`, detached) and its part of the BAPO table, searched over the tokens
        that train with their correction weights (before batch normalisation, a common factor that
        leaves the positive share as it is)."""
        mb.prox_logprobs = logp
        corr, seqs = self.cfg.algo.correction, self._sequences(mb)
        fixed = apply_correction(logp, logp, mb.old_logprobs, mb.loss_mask, seqs, corr, logp.new_ones(()))
        weights = fixed.mask if fixed.is_weight is None else fixed.mask * fixed.is_weight
        if corr.rollout_is_batch_normalize:
            level = "token" if corr.rollout_is == "token" else "sequence"
            step.is_parts.append(batch_mean_parts(fixed.correction, mb.loss_mask, seqs, level))
        return self.search.table(importance_ratio(logp, mb.old_logprobs), mb.advantages, weights)

    def _reference_loss(self, step: StepState, mb: MicroBatch, logits: torch.Tensor):
        """The reference pass's: keep log pi_ref."""
        mb.ref_logprobs, _ = self._logprobs(mb, logits, step.temperature)
        return logits.new_zeros(()), torch.tensor(mb.num_tokens, dtype=torch.int), {}

    def _reference_pass(self, step: StepState, mbs: list[MicroBatch]) -> None:
        """Every micro-batch's log pi_ref (on the last stage, which alone computes the loss): through
        the frozen copy, or under LoRA through the policy with its adapters off."""
        loss = partial(self._reference_loss, step)
        with torch.no_grad():
            if self.reference is None:
                with adapters_off(self.model):
                    self._run(mbs, loss, forward_only=True, label="reference")
                return
            assert self.reference.ready, "hold_reference() (or a checkpoint's load) gives the reference its weights"
            self._run(mbs, loss, forward_only=True, label="reference", reference=True)

    def _policy_loss(self, step: StepState, mb: MicroBatch, logits: torch.Tensor):
        sft = self.cfg.algo.loss == "sft"
        logp, entropy, *top = self._logprobs(mb, logits, step.temperature, with_top=sft)
        if step.folded:  # the prepass's figures from this very forward (_folds_prepass)
            step.bounds = self._settle(step, [self._stats(step, mb, logp.detach())])
        batch = PolicyBatch(
            logprobs=logp,
            old_logprobs=mb.old_logprobs,
            advantages=mb.advantages,
            mask=mb.loss_mask,
            prox_logprobs=mb.prox_logprobs,
            ref_logprobs=mb.ref_logprobs,
            entropy=entropy,
            top_logprobs=top[0] if top else None,
            first_update=step.first_update,
            sequences=self._sequences(mb),
            same_version=None if step.version is None else mb.versions == step.version,
            is_scale=step.is_scale,
        )
        scope_group = self.info.dp_cp_group if step.bounds is None else None
        try:
            out = policy_loss(batch, self.cfg.algo, bounds=step.bounds, group=scope_group)
        except NonFiniteInputError as err:
            # Every rank of the group raised together (the search reduces its error counts first):
            # finish the schedule with the starting bounds so no pipeline peer waits, then skip.
            self._invalid(step, err)
            out = policy_loss(batch, self.cfg.algo, bounds=self._start_bounds())
        # The schedule gets a tensor of its own: with pipeline stages it frees what it backpropagates
        # through (deallocate_pipeline_outputs: .data made an uninitialised [1]), and the non-finite
        # check reads out.loss_sum afterwards
        # rejected tokens leave the step's token count too (verl's mask): counted on the device then
        count = out.token_count.round().to(torch.int) if self.cfg.algo.correction.rules else mb.num_tokens
        return out.loss_sum.clone(), torch.as_tensor(count, dtype=torch.int), out

    def _start_bounds(self) -> ClipBounds:
        c_low, c_high = self.search.path.points[0]
        return ClipBounds(c_low=c_low, c_high=c_high, rho=float("nan"), rho_start=float("nan"), steps=0)

    def _invalid(self, step: StepState, err: Exception) -> None:
        if not step.skip_reason:
            warnings.warn(f"step {self.step + 1} will be skipped: {err}", stacklevel=2)
        step.skip_reason = str(err)

    def _needs_prepass(self) -> bool:
        algo, corr = self.cfg.algo, self.cfg.algo.correction
        bapo_step = algo.loss == "bapo" and algo.bapo.bound_scope == "step"
        return algo.loss != "sft" and (bapo_step or corr.needs_prox or corr.rollout_is_batch_normalize)

    def _folds_prepass(self, mbs: list[MicroBatch]) -> bool:
        """Whether the prepass can ride on the training pass: with one micro-batch a rank (every rank
        has as many), the training forward runs at the start-of-step parameters too and computes the
        same log-probs, and no micro-batch's loss comes before the step's search has every table.
        With several, the first micro-batch's loss and backward run before the last's forward, so
        the step's bounds need the separate pass. MoE routing and virtual stages keep it (their
        passes carry state of their own)."""
        return len(mbs) == 1 and self.routers is None and len(self.model) == 1

    def _step_bounds(self, step: StepState, mbs: list[MicroBatch]) -> ClipBounds | None:
        """BAPO's bounds over the whole step, at the start-of-step parameters (None: not searched
        here), and the step's mean importance weight where batch normalisation needs it."""
        with torch.no_grad():
            tables = self._run(mbs, partial(self._stats_loss, step), forward_only=True, label="bounds")
        return self._settle(step, tables)

    def _settle(self, step: StepState, tables: list[torch.Tensor]) -> ClipBounds | None:
        """The step's bounds and mean importance weight from every micro-batch's prepass figures."""
        if not self.info.is_last_stage:
            return None  # only the last stage computes the loss
        if step.is_parts:
            parts = torch.stack(step.is_parts).sum(0)
            dist.all_reduce(parts, group=self.info.dp_cp_group)
            step.is_scale = normaliser(parts)
        if self.cfg.algo.loss != "bapo" or self.cfg.algo.bapo.bound_scope != "step":
            return None
        try:
            return self.search.select(torch.stack(tables).sum(0), group=self.info.dp_cp_group)
        except NonFiniteInputError as err:
            self._invalid(step, err)
            return self._start_bounds()

    # ------------------------------------------------------------------------------------------
    # One optimizer step.

    def train_step(self, batch: RolloutBatch, first_update: bool = True) -> StepResult:
        """One optimizer step on all of `batch`'s samples (every rank passes the same batch)."""
        version = batch.metadata.get("version")
        step = StepState(
            temperature=batch.temperature,
            first_update=first_update,
            version=int(version) if version is not None and version.lstrip("-").isdigit() else None,
        )
        mbs, adv_metrics = self.microbatches(batch)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.cfg.algo.kl_coef > 0:
            self._reference_pass(step, mbs)
        if self._needs_prepass():
            step.folded = self._folds_prepass(mbs)
            step.bounds = None if step.folded else self._step_bounds(step, mbs)
        if self.routers is not None:
            self.routers.counting = True  # the update's routing decisions make the step's router figures
        try:
            outputs: list[LossOutput] = self._run(
                mbs, partial(self._policy_loss, step), forward_only=False, label="update"
            )
        finally:
            if self.routers is not None:
                self.routers.counting = False
        skipped = self._nonfinite(step, outputs)
        grad_norm = float("nan")
        if not skipped:
            _, norm, _ = self.optimizer.step()
            grad_norm = norm if self.cfg.optimizer.clip_grad > 0 else self.optimizer.get_grad_norm()
            self.scheduler.step(increment=1)
            self.step += 1
        metrics = self._metrics(outputs, adv_metrics, grad_norm, skipped)
        if self.routers is not None:
            metrics.update(self.routers.metrics())
            metrics.update(aux_loss_metric(len(mbs)))
            # samples that carry the engine's routes (replayed when algo.routing_replay): a share below 1
            # with routes on means some were lost on the way (a micro-batch with one such routes itself)
            metrics["moe/routed_samples_share"] = sum(s.routes is not None for s in batch.samples) / len(batch)
        return StepResult(metrics=metrics, skipped=skipped)

    def logprob_gap(self, batch: RolloutBatch) -> float:
        """The largest |log-prob of this trainer - behaviour log-prob| over `batch`'s response tokens
        (a forward pass, no update), the same on every rank: the weight-sync probe."""
        mbs, _ = self.microbatches(batch)

        def gap(mb: MicroBatch, logits: torch.Tensor):
            logp, _ = self._logprobs(mb, logits, batch.temperature)
            worst = ((logp.detach() - mb.old_logprobs).abs() * mb.loss_mask).max()
            return logits.new_zeros(()), torch.tensor(mb.num_tokens, dtype=torch.int), worst

        with torch.no_grad():
            found = self._run(mbs, gap, forward_only=True)
        worst = torch.tensor([max((float(x) for x in found), default=0.0)], device=self.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst.item())

    def _nonfinite(self, step: StepState, outputs: list[LossOutput]) -> bool:
        """Whether any rank saw a non-finite loss or gradient: the checks stay on the device and the
        host reads one flag, after its all-reduce (outside the loss). A gradient buffer's check is its
        largest magnitude, a reduction (NaN and inf carry through it): isfinite() of the whole buffer
        made a boolean copy and more of it (7 bytes a float32 gradient, the step's peak at short
        sequences: bench_memory's full recompute at 128 tokens, 1.27x the estimate)."""
        finite = [torch.isfinite(out.loss_sum).all() for out in outputs]
        for chunk in self.model:
            buffers = chunk.buffers + chunk.expert_parallel_buffers
            finite += [torch.isfinite(torch.linalg.vector_norm(b.grad_data, float("inf"))) for b in buffers]
        flag = torch.full((1,), float(bool(step.skip_reason)), device=self.device)
        if finite:
            flag = torch.maximum(flag, (~torch.stack(finite).all()).to(flag).view(1))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _metrics(self, outputs, adv_metrics, grad_norm, skipped) -> dict[str, float]:
        """The step's metrics on every rank (computed on the last stage, sent along the pipeline)."""
        from megatron.core import parallel_state as ps

        metrics: dict[str, float] = {}
        if self.info.is_last_stage:
            metrics = corr_metrics.finish(reduce_metrics(outputs, group=self.info.dp_cp_group))
        metrics.update(adv_metrics)
        metrics["train/grad_norm"] = float(grad_norm)
        metrics["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["train/skipped"] = float(skipped)
        metrics["train/step"] = float(self.step)
        if self.info.pp_size > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=self.info.pp_group)
            metrics = box[0]
        return metrics
