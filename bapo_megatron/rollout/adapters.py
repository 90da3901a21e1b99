"""Which LoRA adapter the engines serve (model.lora.sync: adapter), and which versions requests still name.

    served = ServedAdapter()                    # shared by the rollout, the evaluation and the weight sync
    with served.named() as adapter:             # on the engines' loop, around one /generate call
        answer = await client.generate(ids, sampling, rid, **adapter.request)
    answer = adapter.stamp(answer)              # its tokens: the adapter's version
    served.serve(version)                       # (the weight sync, once every engine holds it)
    served.in_use()                             # versions a request names now: not unloaded

Each weight version's adapter is loaded on the engines under a name of its own (`adapter_name`),
and a request names the one current when it goes out, so a request that stays inside an engine
across a weight update (a retract or in-place pause) keeps sampling with the adapter it began
with: its tokens are that adapter's version, whatever weight version the engine reports. An older
adapter is unloaded once no request names it (weights/lora_sync.py). Before the first `serve`,
and in a run without adapter sync, requests name no adapter: the engines' own weights answer.
Every method runs on the engines' loop, where the requests are.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from bapo_megatron.common.protocol import Completion

PREFIX = "policy-v"


def adapter_name(version: int) -> str:
    """The name weight version `version`'s adapter is served under."""
    return f"{PREFIX}{version}"


@dataclass(frozen=True)
class Named:
    """The adapter one request names (version None: none)."""

    version: int | None

    @property
    def request(self) -> dict[str, str]:
        """The /generate call's keyword that names it (none without an adapter)."""
        return {} if self.version is None else {"lora_path": adapter_name(self.version)}

    def stamp(self, completion: Completion) -> Completion:
        """The completion with every token of the adapter's version (the engine's weight version
        counts for nothing here: its base weights do not change between versions)."""
        if self.version is None:
            return completion
        return dataclasses.replace(completion, weight_version=str(self.version), version_spans=[])


class ServedAdapter:
    def __init__(self) -> None:
        self.version: int | None = None  # the adapter new requests name; None: none yet
        self._users: Counter[int] = Counter()

    name = staticmethod(adapter_name)

    @contextlib.contextmanager
    def named(self) -> Iterator[Named]:
        """The current adapter, counted as in use by one request until the block ends."""
        version = self.version
        if version is None:
            yield Named(None)
            return
        self._users[version] += 1
        try:
            yield Named(version)
        finally:
            self._users[version] -= 1
            if not self._users[version]:
                del self._users[version]

    def serve(self, version: int) -> None:
        """Every engine holds version `version`'s adapter: new requests name it."""
        self.version = version

    def in_use(self) -> set[int]:
        """The versions requests name now, and the current one."""
        return set(self._users) | ({self.version} if self.version is not None else set())
