"""The embedded engine's core: a transformers model serving requests on CPU, wired from its parts.

No HTTP here (engines/embedded/server.py serves it). The parts, each in its own module:
weights.py loads the model and checks and loads weight updates; request_queue.py holds the
requests; decode.py runs the model over them (a slotted KV cache, slots.py, batched decoding
and prefills), sampling as sampling.py does; prefixes.py keeps the caches of requests cut short
(emptied whenever the weights change); memory.py releases and resumes memory; routing.py records
a mixture-of-experts model's routes; lora.py keeps LoRA adapters and adds them in the forwards, each
request under its own. EngineCore builds them and answers for them together.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from bapo_megatron.engines.embedded.decode import DecodeLoop
from bapo_megatron.engines.embedded.lora import Adapter
from bapo_megatron.engines.embedded.memory import MemoryOccupation
from bapo_megatron.engines.embedded.prefixes import PrefixStore
from bapo_megatron.engines.embedded.request_queue import EngineRequest, RequestQueue
from bapo_megatron.engines.embedded.routing import RouteRecorder
from bapo_megatron.engines.embedded.slots import SlotKV
from bapo_megatron.engines.embedded.weights import ServedWeights, eos_ids, load_model
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec


class EngineCore:
    """Requests in, tokens out, one `step()` at a time (the caller owns the loop and the locking)."""

    def __init__(
        self,
        model_dir: str | Path,
        seed: int = 0,
        max_batch: int = 64,
        batch_invariant: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """dtype: the weights' and activations' (log-probs are computed in float32 from its logits).
        batch_invariant: every request runs alone in its forwards (its prefill, then one decode
        forward a token, over a cache of its own), and the prefix store is off, so a request's
        tokens and log-probs depend on nothing but its input, its sampling seed and the weights:
        never on what else runs or arrives when (SGLang's --enable-deterministic-inference). It
        is for deterministic runs and costs the batching. A model whose cache holds a recurrent
        state (Family.cache_by_position) always runs so: a request continued after a cut (partial
        rollout) prefills its prompt and partial response again, its state rebuilt exactly."""
        self.model_dir = str(model_dir)
        self.model = load_model(self.model_dir, dtype)
        spec = ModelSpec.from_hf_dir(self.model_dir)  # after transformers has refused what it would not load
        for difference in family_of(spec).engine_differences(spec):  # one warning line each, once
            warnings.warn(f"{self.model_dir}: {difference}", stacklevel=2)
        self.route_recorder = RouteRecorder.of(self.model, spec)  # None: a dense model
        # a recurrent state cannot be cut, padded or slotted by position: each request over its own cache
        self.alone = batch_invariant or not family_of(spec).cache_by_position(spec)
        self.queue = RequestQueue(seed, self.model.config.vocab_size)
        self.prefixes = PrefixStore()
        self.weights = ServedWeights(self.model)
        generator = torch.Generator().manual_seed(seed)
        self.loop = DecodeLoop(
            self.model,
            self.route_recorder,
            eos_ids(self.model),
            self.queue,
            self.prefixes,
            generator,
            max_batch,
            self.alone,
        )
        self.memory = MemoryOccupation(self.queue, self.loop, self.weights)

    # -- what the server reads ----------------------------------------------------------------
    @property
    def version(self) -> str:
        """The weights' version, stamped on the tokens made with them."""
        return self.loop.version

    @version.setter
    def version(self, value: str) -> None:
        self.loop.version = value

    @property
    def counters(self) -> dict[str, int]:
        """Running totals (decode.COUNTERS), for the server's throughput log and /metrics."""
        return self.loop.counters

    @property
    def kv(self) -> SlotKV:
        return self.loop.kv

    @property
    def incoming(self) -> collections.deque[EngineRequest]:
        return self.queue.incoming

    @property
    def waiting(self) -> list[EngineRequest]:
        return self.queue.waiting

    @property
    def running(self) -> list[EngineRequest]:
        return self.queue.running

    @property
    def busy(self) -> bool:
        return self.queue.busy

    @property
    def context_length(self) -> int:
        """The most tokens (prompt and output) a request may hold: the model's position range."""
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 20)

    # -- requests -----------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        """Queue a request; safe to call from another thread while a step runs."""
        self.queue.add(request)

    def step(self) -> list[EngineRequest]:
        """One batched decode step of the running requests, then one batched prefill of the waiting ones."""
        return self.loop.step()

    def abort(
        self,
        rid: str | None = None,
        message: str = "aborted",
        status_code: int | None = None,
        err_type: str | None = None,
    ) -> int:
        """Finish (with finish reason abort and their partial output) one request, or all if rid is None;
        an internal error passes its message, 500 and its type. Not concurrently with step()."""
        hit = self.queue.matching(rid)
        for r in hit:
            self.loop.finish(r, {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type})
        return len(hit)

    def drop_caches(self) -> None:
        """Forget every running request's KV cache (retract): they re-prefill. The prefix store stays."""
        self.loop.retract()

    def flush(self) -> None:
        """Forget every cached key and value (the weights changed): running requests re-prefill."""
        self.loop.flush()

    def shrink(self) -> None:
        """Free the slotted cache's memory when no request runs (it is reallocated on demand)."""
        if not self.queue.running and self.loop.kv.capacity:
            self.loop.free_cache()

    # -- memory -------------------------------------------------------------------------------
    def release_memory(self, tags: Sequence[str], paused: bool = False) -> None:
        """Free memory as SGLang's release_memory_occupation does (memory.py); only when idle."""
        self.memory.release(tags, paused)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Take released memory back; resumed weights hold no values until loaded."""
        self.memory.resume(tags)

    def can_generate(self) -> str | None:
        """Why generation cannot run now (memory released, weights not reloaded since), or None."""
        return self.memory.refusal()

    # -- weights ------------------------------------------------------------------------------
    def check_weights(self, announced: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> None:
        """ValueError naming the first (name, dtype, shape) the served model cannot take (weights.py)."""
        self.weights.check(announced)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model (cast to its dtype); all are checked before any is copied."""
        count = self.weights.load(tensors)
        self.prefixes.clear()  # computed with the old weights
        return count

    # -- LoRA adapters --------------------------------------------------------------------------
    def load_adapter(
        self, name: str, config_dict: object, tensors: Iterable[tuple[str, torch.Tensor]], source: str
    ) -> Adapter:
        """Check a PEFT adapter (its adapter_config.json and tensors) in full against the served model,
        then make it resident; ValueError naming the first field or tensor that does not fit. The base
        weights stay as they are. Not concurrently with step()."""
        adapter = self.loop.adapters.build(name, config_dict, tensors, source)
        self.loop.adapters.add(adapter)
        return adapter

    def unload_adapter(self, adapter_id: str) -> None:
        """Free a resident adapter that no request runs under any more. Not concurrently with step()."""
        self.loop.adapters.remove(adapter_id)
