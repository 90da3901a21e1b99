"""Adapter-only weight updates (model.lora.sync: adapter): every step the engines get the LoRA adapters
alone, as a PEFT adapter under a versioned name, not the model.

    sync = AdapterSync(clients, peft_config(spec, lora, base), served, engine_tp, by_value)  # models/lora.py
    sent, gone = sync.load(buckets, version, members, loop, verify)   # `version`'s adapter on each member
    sync.unload_unused(members, loop)                                 # older ones no request names

The buckets are the adapters gathered whole over TP and PP to rank 0 under PEFT's names
(weights/export.py, part "adapters"); they go to every engine with SGLang's
/load_lora_adapter_from_tensors: the PEFT adapter_config as config_dict, one serialized copy per
engine TP rank (SGLang slices the adapters for its ranks itself), as a flattened bucket or a plain
dict of tensors, and, when the sync verifies (rollout.sync.verify), the sha256 of every tensor as
sent (expected_checksums: SGLang checks them for adapters). The name is rollout/adapters.py's
`policy-v{version}`; the rollout's ServedAdapter then makes new requests name it, and counts the
requests that still name an older one (a retract or in-place pause keeps them inside the engines
across the update): an older adapter is unloaded at a later sync once none does.

The base goes to the engines whole once, by the ordinary weight sync (part "base": the base weights,
adapters left out), at the run's first sync and to an engine that comes back (engine_updates.py).

How the tensors travel: SGLang servers may run on other hosts, so their payload carries the bytes
(a plain pickle of CPU tensors, which SGLang's SafeUnpickler reads through its torch.load of a
storage); the embedded engine reads handles to shared memory only (common/ipc.py), on this host.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import pickle
from collections.abc import Iterable, Iterator

import torch

from bapo_megatron.common import ipc, protocol
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.engines.client import CHECKSUM_MISMATCH, EngineClient, EngineError, EngineUnavailable
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.errors import RunStopped
from bapo_megatron.models.lora import adapter_params
from bapo_megatron.models.spec import ModelSpec

Named = list[tuple[str, torch.Tensor]]
SGLANG_MISMATCH = "adapter sync MISMATCH"
"""How SGLang 0.5.23's refusal of an adapter whose tensors differ from expected_checksums reads."""


def adapter_update_bytes(spec: ModelSpec, lora: LoRAConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """The bytes of one adapter-only update of `spec` with `lora` (the adapters whole, in `dtype`:
    a GPU trainer's bfloat16 parameters by default), once; an engine of TP t receives t copies of
    it. ConfigError where `lora` cannot adapt `spec`; 0 with LoRA off."""
    return adapter_params(spec, lora, list(range(spec.num_layers)), 1) * dtype.itemsize


@contextlib.contextmanager
def payloads(named: Named, copies: int, by_value: bool) -> Iterator[tuple[list[str], str | None]]:
    """(`copies` serialized payloads of the adapter, its load_format), valid until the block ends.
    by_value: one pickle holding the bytes (a {name: tensor} dict on the CPU, load_format None);
    else handles (common/ipc.py, a flattened bucket) that the receivers read in place."""
    if by_value:
        tensors = {name: t.detach().to("cpu", copy=True) for name, t in named}  # a copy: no larger storage
        text = base64.b64encode(pickle.dumps(tensors, protocol=4)).decode("ascii")
        yield [text] * copies, None
        return
    with ipc.serialized(ipc.flattened_bucket(named), copies) as serialized:
        yield serialized, protocol.FLATTENED


def checksums(named: Named) -> dict[str, str]:
    """{name: sha256 of the tensor's bytes as sent} (SGLang's expected_checksums)."""
    from bapo_megatron.engines.client import tensor_checksum

    return {name: tensor_checksum(t) for name, t in named}


class AdapterSync:
    """Rank 0's loads and unloads of adapters on the engines (by index in `clients`)."""

    def __init__(
        self, clients: list[EngineClient], config: dict, served, engine_tp: int = 1, by_value: bool = True
    ) -> None:
        """served: the rollout's ServedAdapter (rollout/adapters.py: its name rule, which versions
        requests name; called on the engines' loop)."""
        self.clients, self.config, self.served = clients, config, served
        self.engine_tp, self.by_value = engine_tp, by_value
        self.loaded: dict[int, set[int]] = {}  # engine -> the versions of the adapters it holds

    def load(
        self, buckets: Iterable[Named], version: int, members: list[int], loop: EngineLoop, verify: bool = False
    ) -> tuple[int, list[int]]:
        """`version`'s adapter (every bucket: the other ranks gather them with this one) on each of
        `members` that does not hold it yet; (bytes of the adapter, members that did not answer:
        dead, they get the base and the adapter when they come back). WeightsCorrupted when one
        received other bytes than sent (verify), RunStopped when one refuses the adapter."""
        named = [pair for bucket in buckets for pair in bucket]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        targets = [i for i in members if version not in self.loaded.get(i, set())]
        if not targets or not named:
            return (nbytes if targets else 0), []
        name = self.served.name(version)
        expected = checksums(named) if verify else None
        with payloads(named, self.engine_tp, self.by_value) as (serialized, load_format):
            calls = (
                self.clients[i].load_lora_adapter_from_tensors(name, self.config, serialized, load_format, expected)
                for i in targets
            )
            results = loop.run(_settled(calls))
        gone = []
        for index, result in zip(targets, results, strict=True):
            if isinstance(result, EngineUnavailable):
                gone.append(index)
            elif isinstance(result, EngineError):
                raise _refused(self.clients[index], result, version) from None
            elif isinstance(result, BaseException):
                raise result
            else:
                self.loaded.setdefault(index, set()).add(version)
        return nbytes, gone

    def forget(self, engines: list[int], loop: EngineLoop) -> None:
        """These engines come back (restarted, or set aside after a failed update): what they held
        is unloaded where they still hold it, and nothing of it is remembered."""
        for index in engines:
            self._unload(index, self.loaded.pop(index, set()), loop)

    def unload_unused(self, members: list[int], loop: EngineLoop) -> None:
        """Every adapter of `members` that no request names and is not the current one, unloaded."""
        in_use = loop.call(self.served.in_use)
        for index in members:
            held = self.loaded.get(index, set())
            stale = held - in_use
            self._unload(index, stale, loop)
            held -= stale

    def _unload(self, index: int, versions: set[int], loop: EngineLoop) -> None:
        client = self.clients[index]

        async def unload(version: int) -> None:
            # an engine that holds no such adapter (restarted) refuses (4xx), and one that is gone
            # does not answer: either way it does not hold it, which is what is asked
            with contextlib.suppress(EngineUnavailable, EngineError):
                await client.unload_lora_adapter(self.served.name(version))

        if versions:
            loop.run(_settled(unload(v) for v in sorted(versions)))


async def _settled(calls) -> list:
    return await asyncio.gather(*calls, return_exceptions=True)


def _refused(client: EngineClient, err: EngineError, version: int) -> RunStopped:
    """An engine's refusal of an adapter as the run's one line: WeightsCorrupted for a checksum
    refusal, RunStopped for any other (an engine that cannot serve the adapter)."""
    from bapo_megatron.weights.sync import WeightsCorrupted

    text = str(err)
    if CHECKSUM_MISMATCH in text or SGLANG_MISMATCH in text:
        return WeightsCorrupted(
            f"rollout.sync.verify: engine {client.base_url} did not receive the LoRA adapter of version "
            f"{version} as sent ({text[-300:]}); stopping rather than train on what it generates"
        )
    return RunStopped(
        f"engine {client.base_url} refused the LoRA adapter of version {version} ({text[-300:]}): "
        "an engine that cannot serve LoRA adapters needs model.lora.sync=merged (SGLang serves them "
        "with --enable-lora, --max-lora-rank and --lora-target-modules in rollout.engines.sglang_args)"
    )
