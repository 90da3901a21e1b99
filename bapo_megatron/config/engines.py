"""rollout.engines: the inference servers, and the SGLang options the launcher owns or SGLang deprecates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from bapo_megatron.errors import check

SGLANG_LAUNCHER_ARGS = {
    "model-path": "set to the model being trained",
    "host": "set from rollout.engines.host",
    "port": "set from rollout.engines.port (else 30000) + the server's index",
    "tp-size": "set from rollout.engines.tensor_parallel",
    "dp-size": "always 1: one server per replica, as weight updates need",
    "base-gpu-id": "set from the server's index",
    "mem-fraction-static": "set from rollout.engines.mem_fraction_static",
    "weight-version": "set to the policy version",
    "random-seed": "set from the job seed + the server's index",
    "skip-tokenizer-init": "always true: token ids in and out",
    "enable-memory-saver": "set from rollout.engines.colocate",
    "enable-deterministic-inference": "set from rollout.deterministic (batch-invariant kernels)",
    "dtype": "set from rollout.engines.dtype (auto: left to SGLang)",
    "enable-return-routed-experts": "set when the run asks for routes (algo.routing_replay)",
    "admin-api-key": "set from rollout.engines.admin_key_file or $BAPO_ADMIN_API_KEY",
    "enable-lora": "set when model.lora.sync=adapter (the adapters sent every step)",
    "max-lora-rank": "set from model.lora.rank (model.lora.sync=adapter)",
    "lora-target-modules": "set from model.lora.target_modules (model.lora.sync=adapter)",
    "max-loaded-loras": "set from rollout.max_staleness + 2 (model.lora.sync=adapter: the versions requests may name)",
    "max-loras-per-batch": "set as max-loaded-loras (model.lora.sync=adapter)",
    "api-key": "never set: the rollout client sends only the admin key, so /generate would answer 401",
}
"""SGLang options that engines/sglang_launcher.py derives from the config: never in sglang_args."""

DEFAULT_PORT = 30000
"""The first port where rollout.engines.port is unset and a free one will not do: SGLang servers
(SGLang's own default) and bapo-serve's engines, whose URLs the trainer is handed beforehand."""

SGLANG_DEPRECATED_ARGS = {
    "disable-cuda-graph": "disable-decode-cuda-graph: true and disable-prefill-cuda-graph: true",
    "enable-dp-attention": "attn-dp-size (each server here has dp-size 1)",
    "monokernel-backend": "enable-amd-monokernel: true",
    "enable-flashinfer-allreduce-fusion": "flashinfer-allreduce-fusion-backend: auto",
    "grpc-mode": "smg-grpc-mode",
    "disable-fast-image-processor": "image-processor-backend: pil",
}
"""SGLang 0.5.23's deprecated server options and what replaces each: its --config merger refuses
some outright ("Unsupported config option"); tests/unit/test_sglang_launch_config.py
checks this list against the options its own parser registers as deprecated."""


@dataclass(frozen=True, kw_only=True)
class EnginesConfig:
    """rollout.engines: the inference servers, started by the job or already running elsewhere."""

    kind: Literal["embedded", "sglang"] = "embedded"
    """"embedded": the CPU engine of this package; "sglang": SGLang servers."""
    servers: int = 1
    """Engine servers (one per inference data-parallel replica). Colocated, divided evenly among the
    trainer's nodes (nodes x GPUs a node / tensor_parallel uses every GPU)."""
    tensor_parallel: int = 1
    """Tensor-parallel size of each SGLang server."""
    urls: tuple[str, ...] = ()
    """Engines that are already running (another node, another job): the driver only connects to
    them (and starts none). Empty: the driver starts `servers` engines of `kind`."""
    host: str = "127.0.0.1"
    """Interface the engines listen on; anything beyond loopback requires an admin key."""
    port: int | None = None
    """First port of the engines the run starts: engine i listens on port + i. None (or 0): each
    embedded engine takes a free port of its own (it binds port 0 and reports the port it got), so
    that runs and tests side by side never collide; SGLang servers, and bapo-serve's engines (the
    trainer is handed their URLs), listen on 30000 + i. Engines given by `urls` keep theirs."""
    colocate: bool = False
    """SGLang shares the trainer's GPUs, on every node of the trainer (each node's first rank starts
    its node's servers): memory saver on, weights pushed with update_weights_from_tensor, each
    engine rank loading the copy of the trainer rank on its GPU (CUDA IPC, within its node)."""
    mem_fraction_static: float | None = None
    """SGLang: fraction of GPU memory for weights and KV cache. None: 0.8 on GPUs of their own;
    colocated, what the trainer's resident memory (parameters, gradients, optimizer states:
    trainer/memory/estimate.py) leaves, less 10% of the GPU for SGLang's activations and CUDA graphs."""
    admin_key_file: str | None = None
    """File holding the engines' admin key (else $BAPO_ADMIN_API_KEY; generated when the servers
    listen beyond loopback and none is given)."""
    sglang_args: dict[str, Any] = field(default_factory=dict)
    """SGLang: further server options by their command-line names, passed as given (for example
    {attention-backend: fa3, chunked-prefill-size: 8192, disable-decode-cuda-graph: true}).
    Underscores read as dashes; a None leaves the option at SGLang's default. The options the
    launcher sets from the fields above, and SGLang's deprecated ones, are refused here."""
    max_batch: int = 64
    """Embedded engine: requests decoded together."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The engines' weights and activations. "auto": each engine's default, the embedded engine
    float32 (log-probs exact against a float32 trainer), SGLang its --dtype auto (a bfloat16
    checkpoint in bfloat16, a float32 one in float16). "bfloat16" in the embedded engine gives
    the numeric mismatch of a GPU engine against a float32 trainer on CPU; SGLang takes either
    as its --dtype (float32 doubles the memory its weights and KV cache take)."""
    request_timeout_s: float = 600.0
    """Seconds one HTTP request to an engine may take (a generation included) before it fails."""
    startup_timeout_s: float = 600.0
    """Seconds an engine may take to become ready (or an engine URL to answer)."""
    wait_s: float = 900.0
    """With no engine serving for this long (dead, restarting, or waiting for the weights), the run
    stops with one error line. Engines the job started are restarted when they die; engines given
    by `urls` are waited for until they answer again. Either kind serves again only after it has
    taken the current weights and passed the version check (and the probe, with sync.check_every)."""
    max_restarts: int = 3
    """An engine the job started that fails to come back this many times in a row stops the run."""

    def __post_init__(self) -> None:
        for name in ("servers", "tensor_parallel", "max_batch", "max_restarts"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("request_timeout_s", "startup_timeout_s", "wait_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for i, url in enumerate(self.urls):
            check(url.startswith(("http://", "https://")), f"urls[{i}]", url, "must be an http(s):// URL")
        if self.port:  # (None or 0: a free port)
            check(1 <= self.port <= 65535 - self.servers, "port", self.port, "must leave room for one port per server")
        if self.mem_fraction_static is not None:
            check(
                0 < self.mem_fraction_static < 1, "mem_fraction_static", self.mem_fraction_static, "must lie in (0, 1)"
            )
        for key, value in self.sglang_args.items():
            name = key.replace("_", "-")
            check(
                name not in SGLANG_LAUNCHER_ARGS,
                f"sglang_args.{key}",
                value,
                f"is the launcher's option ({SGLANG_LAUNCHER_ARGS.get(name)})",
            )
            check(
                name not in SGLANG_DEPRECATED_ARGS,
                f"sglang_args.{key}",
                value,
                f"is deprecated in SGLang 0.5.23, whose --config refuses it; use {SGLANG_DEPRECATED_ARGS.get(name)}",
            )
            check(
                value is None or isinstance(value, (str, int, float, bool, list)),
                f"sglang_args.{key}",
                value,
                "must be a scalar or a list",
            )

    @property
    def first_port(self) -> int | None:
        """Engine 0's port (engine i's: + i); None: each embedded engine takes a free port."""
        if self.port:
            return self.port
        return DEFAULT_PORT if self.kind == "sglang" else None
