"""The embedded engine's memory occupation, as SGLang's release/resume_memory_occupation under its
memory saver: which memory is released (tags kv_cache, weights, cuda_graph), what releasing and
resuming it does here, and whether generation can run meanwhile."""

from __future__ import annotations

from collections.abc import Sequence

from bapo_megatron.engines.embedded.decode import DecodeLoop
from bapo_megatron.engines.embedded.request_queue import RequestQueue
from bapo_megatron.engines.embedded.weights import ServedWeights


class MemoryOccupation:
    """The memory tags released, and the cache and weights they free."""

    def __init__(self, queue: RequestQueue, loop: DecodeLoop, weights: ServedWeights) -> None:
        self.queue, self.loop, self.weights = queue, loop, weights
        self.released: set[str] = set()

    def release(self, tags: Sequence[str], paused: bool = False) -> None:
        """kv_cache drops the slotted cache and the prefix store; weights frees every parameter's
        storage (their values are lost, as SGLang's are: resume, then load weights); cuda_graph holds
        nothing here. Only when idle: no request running, and none waiting unless `paused`."""
        self.queue.admit()
        if self.queue.running or (self.queue.waiting and not paused):
            raise ValueError("release_memory_occupation should be called only when the engine is idle (or paused)")
        if "kv_cache" in tags:
            self.loop.flush()
            self.loop.free_cache()
        if "weights" in tags and "weights" not in self.released:
            self.weights.release()
        self.released.update(tags)

    def resume(self, tags: Sequence[str]) -> None:
        """Take released memory back; resumed weights hold no values until loaded."""
        if not set(tags) <= self.released:
            raise ValueError(f"cannot resume {sorted(set(tags) - self.released)}: not released")
        if "weights" in tags:
            self.weights.resume()
        self.released.difference_update(tags)

    def refusal(self) -> str | None:
        """Why generation cannot run now (memory released, weights not reloaded since), or None."""
        if self.released & {"weights", "kv_cache"}:
            return f"memory released ({', '.join(sorted(self.released))}): resume it first"
        if self.weights.unloaded:
            return (
                f"{self.weights.unloaded} weight tensors were released and have not been loaded since: "
                "update the weights first"
            )
        return None
