"""The weights' way out of the trainer, on every rank: buckets made, sent, and checked in one call.

    publisher = WeightPublisher(cfg, trainer, outlet)   # outlet: where this rank's buckets go
    metrics = publisher.publish(version)                # every rank at once

A publish makes the model's HF buckets (every rank takes its part in the gathers), hands them to
this rank's outlet (rank 0: the engines' weight-update group, weights/engine_updates.py; a rank
holding a copy for a colocated engine, on any node: its holders; the others: nowhere), then checks what the
engines serve: every rollout.sync.check_every versions a probe's log-probs from a serving engine
against the trainer's, and for each engine that took the weights while it waited for them
(restarted), the same probe from that engine before it serves again. Every rollout.sync.verify
versions the engines also check each tensor they receive against the checksum sent with it
(weights/sync.py). The probe is rank 0's: every rank receives it
and scores its copies, so that the outlet is the only thing that differs between ranks.

With LoRA adapter sync (model.lora.sync adapter) a publish makes the adapters' buckets alone (gathered
over TP and PP as the model's are, under PEFT's names) and, when rank 0's outlet says the engines
need it (the run's first publish, an engine back from a death), the base's first; the outlet loads
the adapter on the engines under its version's name (weights/lora_sync.py) and the probe runs with
it on. rollout.sync.verify then sends the adapter's checksums to SGLang too (it checks them for
adapters), the base's to embedded engines only.

SGLang engines started from a quantized release (fp8 with block scales, MXFP4 experts) get the
release's layout, quantized anew from the trainer's weights (`engine_quantization`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.common.hf_io import TOKENIZER_FILES
from bapo_megatron.config import JobConfig
from bapo_megatron.errors import ConfigError, RunStopped
from bapo_megatron.fsutil import atomic_directory, remove
from bapo_megatron.models.quantized import Quantization, read_quantization


class Outlet(Protocol):
    """Where one rank's buckets go, and (rank 0) what the engines answer about them."""

    def publish(self, buckets: Iterable, version: int, verify: bool = False) -> dict[str, float]:
        """Consume the buckets (every one: the gathers are collectives); the publish's figures.
        verify (rank 0): the engines check each tensor received against its checksum."""

    def probe(self, engine: int | None) -> Sample | None:
        """A fixed response with engine `engine`'s log-probs (None: a serving one); None on other ranks."""

    def waiting(self) -> list[int]:
        """The engines this publish sent the weights to while they waited for them (rank 0)."""

    def revive(self, engines: list[int]) -> int:
        """These engines passed the checks: they serve again (rank 0); how many came back."""

    def needs_base(self) -> bool:
        """(LoRA adapter sync, rank 0) Whether the engines need the base before the adapter."""

    def publish_adapter(
        self, base: Iterable | None, adapter: Iterable, version: int, verify: bool = False
    ) -> dict[str, float]:
        """(LoRA adapter sync) Consume the base's buckets (None: none go) then the adapter's, as `publish`."""


class Gathering:
    """A rank other than 0: its part of the gathers; with holders, its own copy for the engine on
    its GPU (colocated on several GPUs)."""

    def __init__(self, holders=None) -> None:
        self.holders = holders

    def publish(self, buckets: Iterable, version: int, verify: bool = False) -> dict[str, float]:
        if self.holders is not None:
            self.holders.hold(buckets)
        else:
            for _ in buckets:
                pass
        return {}

    def probe(self, engine: int | None) -> Sample | None:
        return None

    def waiting(self) -> list[int]:
        return []

    def revive(self, engines: list[int]) -> int:
        return 0

    def needs_base(self) -> bool:
        return False  # (rank 0 decides)

    def publish_adapter(
        self, base: Iterable | None, adapter: Iterable, version: int, verify: bool = False
    ) -> dict[str, float]:
        if base is not None:
            self.publish(base, version)
        for _ in adapter:  # this rank's part of the adapters' gathers
            pass
        return {}


class WeightPublisher:
    def __init__(self, cfg: JobConfig, trainer, outlet: Outlet, holders=None) -> None:
        self.cfg, self.trainer, self.outlet, self.holders = cfg, trainer, outlet, holders
        self.quantization = engine_quantization(cfg)

    def publish(self, version: int) -> dict[str, float]:
        """The trainer's weights out as version `version` and checked (every rank together):
        the outlet's figures, sync/probe_logprob_gap when a probe was due, sync/refit_probe_gap when
        engines that came back were checked. RunStopped when an engine serves other weights
        (WeightsCorrupted: one received other bytes than sent)."""
        sync, embedded = self.cfg.rollout.sync, self.cfg.rollout.engines.kind == "embedded"
        verify = _due(sync.verify_every(embedded), version)
        if self.cfg.model.lora.adapter_sync:  # SGLang checks an adapter's checksums too
            metrics = self._verified(lambda: self._adapter_publish(version, verify), verify)
        else:
            checked = verify and embedded
            metrics = self._verified(lambda: self.outlet.publish(self._buckets(), version, checked), checked)
        if _due(sync.check_every, version) or (verify and not embedded):  # SGLang checks no checksums: the probe
            gap = self._gap(version, None)
            if gap is not None:
                metrics["sync/probe_logprob_gap"] = gap
        refit, revived = self._refit_checks(version)
        metrics.update(refit)
        if revived and "engine/live" in metrics:  # counted as the weights went out, before these came back
            metrics["engine/live"] += revived
        return metrics

    def _verified(self, publish, verify: bool) -> dict[str, float]:
        """publish(), the outlet's publish (verifying when `verify`); with verify, a WeightsCorrupted
        on rank 0 (an engine received other bytes than sent) stops every rank with its line."""
        from bapo_megatron.weights.sync import WeightsCorrupted

        if not verify:
            return publish()
        stopped, metrics = None, {}
        try:
            metrics = publish()
        except WeightsCorrupted as err:
            stopped = str(err)
        stopped = broadcast(stopped)
        if stopped is not None:
            raise WeightsCorrupted(stopped)
        return metrics

    def _adapter_publish(self, version: int, verify: bool) -> dict[str, float]:
        """LoRA adapter sync: the base first when rank 0's outlet needs it, then the adapters (rank 0's
        copy, gathered over TP and PP, serves every engine rank: they are small)."""
        from bapo_megatron.weights.gather import hf_buckets_to_rank0

        base = self._buckets("base") if broadcast(self.outlet.needs_base()) else None
        adapter = hf_buckets_to_rank0(self.trainer, self.cfg.rollout.sync.bucket_mb << 20, part="adapters")
        return self.outlet.publish_adapter(base, adapter, version, verify)

    def _buckets(self, part: str = "model"):
        """The model's HF buckets as this rank makes them (of a LoRA model: `part`, weights/export.py):
        on rank 0 the whole model (every data-parallel rank 0 helping gather it); with holders, every
        rank its own copy (a rank that holds none still joins its tensor- and expert-parallel groups'
        gathers, which may hold ranks that do, on any node)."""
        from bapo_megatron.weights.export import stream_hf_buckets
        from bapo_megatron.weights.gather import hf_buckets_to_rank0

        size = self.cfg.rollout.sync.bucket_mb << 20
        if self.holders is None:
            made = hf_buckets_to_rank0(self.trainer, size, part=part)
        else:
            trainer = self.trainer
            made = stream_hf_buckets(trainer.model, trainer.spec, trainer.info, size, part=part)
        if self.quantization is None or part == "adapters":
            return made
        return quantized_buckets(made, self.quantization)

    def _refit_checks(self, version: int) -> tuple[dict[str, float], int]:
        """Engines that took the weights in this publish while they waited for them serve again once
        they pass the probe (with rollout.sync.check_every; without it, at once): the probe's figure
        and how many serve again."""
        if not self.cfg.rollout.sync.check_every:
            return {}, self.outlet.revive(self.outlet.waiting())
        engines = broadcast(self.outlet.waiting())
        gaps = [self._gap(version, engine) for engine in engines]
        revived = self.outlet.revive([e for e, gap in zip(engines, gaps, strict=True) if gap is not None])
        answered = [gap for gap in gaps if gap is not None]
        return ({"sync/refit_probe_gap": max(answered)} if answered else {}), revived

    def _gap(self, version: int, engine: int | None) -> float | None:
        """The largest gap between the trainer's log-probs of rank 0's probe and the engine's (None:
        no engine answered the probe; one that did not is restarted and probed after its refit);
        RunStopped beyond rollout.sync.check_max_gap."""
        probe = broadcast(self.outlet.probe(engine))
        if probe is None:
            return None
        sync = self.cfg.rollout.sync
        copies = 2 * self.trainer.info.dp_size  # every data-parallel rank scores a copy; a group of >= 2
        batch = RolloutBatch(
            samples=[dataclasses.replace(probe) for _ in range(copies)],
            temperature=self.cfg.rollout.sampling.temperature,
        )
        gap = self.trainer.logprob_gap(batch)
        if gap > sync.check_max_gap:
            raise RunStopped(
                f"weight sync check: the engines' log-probs of the probe differ from the trainer's by {gap:.3g} "
                f"(> rollout.sync.check_max_gap={sync.check_max_gap}) after the sync of version "
                f"{version}: the engines are not serving the trainer's weights; stopping rather than training on them"
                + _quantized_note(self.quantization)
            )
        return gap


def handle_holders(cfg: JobConfig, trainer):
    """weights/sync.HandleHolders when engines the driver starts are colocated on several GPUs or
    on several nodes (each engine rank then loads the copy of the trainer rank on its GPU:
    engines/fleet.colocated_servers); else None: rank 0's copy serves every engine rank (one
    engine GPU, or, on one node, pipeline stages, which only rank 0 joins, or more engine GPUs
    than trainer ranks, as embedded engines on CPU may have). A collective: every rank calls it."""
    from bapo_megatron.engines.fleet import colocated_servers
    from bapo_megatron.weights.sync import HandleHolders, node_layout

    e = cfg.rollout.engines
    if not e.colocate or e.urls:
        return None
    try:
        layout = node_layout()
    except ValueError as err:
        raise ConfigError("rollout.engines.colocate", e.colocate, str(err)) from None
    n = e.servers * e.tensor_parallel
    if len(layout) == 1 and (trainer.info.pp_size > 1 or not 1 < n <= dist.get_world_size()):
        return None
    if trainer.info.pp_size > 1:
        raise ConfigError(
            "parallel.pipeline",
            trainer.info.pp_size,
            f"colocated engines on {len(layout)} nodes load their own node's copy of the whole model, which a "
            "pipeline stage does not hold: parallel.pipeline=1, or engines on GPUs of their own",
        )
    try:
        return HandleHolders(colocated_servers(e.servers, e.tensor_parallel, layout))
    except ValueError as err:
        raise ConfigError("rollout.engines.servers", e.servers, str(err)) from None


def engine_model_dir(cfg: JobConfig, trainer) -> Path | None:
    """A directory the engines can start from (rank 0; None elsewhere): model.hf_path when it has
    weights (whatever they are: the first sync sends the trainer's, a resumed run's included), else
    the trainer's weights written once to the run directory's engine_model/ (every data-parallel
    rank 0 helping gather them; a random or mcore_path start of a model without HF weights)."""
    from safetensors.torch import save_file

    from bapo_megatron.weights.gather import hf_buckets_to_rank0

    if cfg.model.hf_path and any(Path(cfg.model.hf_path).glob("*.safetensors")):
        return Path(cfg.model.hf_path) if dist.get_rank() == 0 else None
    part = "base" if cfg.model.lora.adapter_sync else "model"  # (the adapters go by themselves)
    tensors = {name: t.cpu() for bucket in hf_buckets_to_rank0(trainer, 512 << 20, part) for name, t in bucket}
    if dist.get_rank() != 0:
        return None
    target = cfg.run_path / "engine_model"
    if target.exists():
        remove(target)  # this run's own, from an earlier start
    with atomic_directory(target) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(trainer.spec.to_hf_config(), indent=1))
        if cfg.model.hf_path:
            for name in TOKENIZER_FILES:
                if (Path(cfg.model.hf_path) / name).is_file():
                    shutil.copy(Path(cfg.model.hf_path) / name, tmp / name)
    return target


def engine_quantization(cfg: JobConfig) -> Quantization | None:
    """How SGLang engines hold the weights they serve: as the quantized release they start from
    (model.hf_path's quantization_config), whose fp8 or MXFP4 parameters SGLang's loader fills with
    what it is sent as it is: the sync sends the release's layout (codes and scales, made anew from
    the trainer's weights). None for embedded engines (they load a release dequantized by the
    trainer's reader: common/hf_model.py) and for models stored unquantized."""
    if cfg.rollout.engines.kind != "sglang" or not cfg.model.hf_path:
        return None
    config = Path(cfg.model.hf_path) / "config.json"
    return read_quantization(json.loads(config.read_text())) if config.is_file() else None


def quantized_buckets(buckets: Iterable, quantization: Quantization) -> Iterator[list]:
    """The buckets with each weight the release stores quantized replaced by what it stores (fp8
    codes and their block scales, MXFP4 blocks and scales); the rest as they are."""
    for bucket in buckets:
        yield [pair for name, tensor in bucket for pair in quantization.quantize(name, tensor).items()]


def _quantized_note(quantization: Quantization | None) -> str:
    if quantization is None:
        return ""
    return (
        f" (the engines serve the release's {quantization.method} weights, whose log-probs differ from the "
        "trainer's by the quantization error: raise rollout.sync.check_max_gap above it)"
    )


def _due(every: int, version: int) -> bool:
    return bool(every) and version % every == 0


def broadcast(obj=None):
    """Rank 0's object on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return box[0]
