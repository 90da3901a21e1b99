"""SGLang 0.5.23 servers from our config: one `python -m sglang.launch_server` per rollout replica.

Each server gets its own GPUs, its own port (rollout.engines.port + i, 30000 + i when unset) and
dp_size 1, which weight updates need. Where its GPUs are (`gpu_placement`): started by the driver, on the driver's
node, colocated on the GPUs of the trainer's ranks there, else on the GPUs after theirs;
started by bapo-serve, GPUs (i x tensor_parallel) modulo the GPUs it sees on its node.
Every argument goes in a YAML file (mode 0600) passed with --config, so the admin key never
shows in `ps`.
Servers listen on rollout.engines.host: beyond loopback an admin key is required, read from
rollout.engines.admin_key_file or $BAPO_ADMIN_API_KEY, or generated into the run directory; the
client sends it (engines/client.py). Colocated with the trainer, the memory saver is on
(weights and KV cache released while training, pushed again after resume).
Readiness: /health_generate, with the server's log tail when it fails or times out.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bapo_megatron.config import SGLANG_LAUNCHER_ARGS, RolloutConfig
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.engines.launcher import ServerProcess, checked_admin_key, is_loopback, new_admin_key
from bapo_megatron.models.lora import served_modules
from bapo_megatron.models.spec import ModelSpec

KEY_ENV = "BAPO_ADMIN_API_KEY"


def admin_key(cfg: RolloutConfig, run_dir: str | Path) -> str | None:
    """The engines' admin key: from the key file or environment; generated (0600 file in run_dir)
    when the servers listen beyond loopback and none was given; None on loopback without one."""
    if cfg.engines.admin_key_file:
        path = Path(cfg.engines.admin_key_file)
        if not path.is_file():
            raise ValueError(f"rollout.engines.admin_key_file={path}: no such file")
        return checked_admin_key(path.read_text().strip(), f"rollout.engines.admin_key_file={path}")
    if os.environ.get(KEY_ENV):
        return checked_admin_key(os.environ[KEY_ENV], f"${KEY_ENV}")
    if is_loopback(cfg.engines.host):
        return None
    path = Path(run_dir) / "admin_api_key"
    path.parent.mkdir(parents=True, exist_ok=True)
    key = new_admin_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


SEPARATE_MEM_FRACTION = 0.8
"""mem_fraction_static of a server on GPUs of its own (SGLang's own default is similar)."""


def mem_fraction(cfg: RolloutConfig, colocated_fraction: float | None = None) -> float:
    """The servers' mem_fraction_static: the config's; else, colocated, `colocated_fraction` (the
    caller's, from the trainer's estimate: trainer/memory/estimate.rollout_mem_fraction); else SEPARATE_MEM_FRACTION."""
    if cfg.engines.mem_fraction_static is not None:
        return cfg.engines.mem_fraction_static
    if cfg.engines.colocate:
        if colocated_fraction is None:
            raise ValueError(
                "rollout.engines.colocate: set rollout.engines.mem_fraction_static, or pass the fraction the trainer "
                "leaves (trainer/memory/estimate.rollout_mem_fraction)"
            )
        return colocated_fraction
    return SEPARATE_MEM_FRACTION


@dataclass(frozen=True)
class Launch:
    """What every server of one launch is started with beyond the rollout config."""

    model_path: str
    weight_version: str = "0"
    seed: int = 0
    """Server i's random seed is seed + i."""
    colocated_fraction: float | None = None
    """mem_fraction_static colocated, from the trainer's estimate (`mem_fraction`)."""
    routed_experts: bool = False
    """/generate may return the experts a MoE model routed each position to (routing replay)."""
    lora: ServedLoRA | None = None
    """The adapters the servers are sent every step (model.lora.sync=adapter; `lora_args`)."""


@dataclass(frozen=True)
class ServedLoRA:
    """What a server needs to serve the adapters the trainer sends it."""

    rank: int
    target_modules: tuple[str, ...]
    """The HF projections adapted (models/lora.served_modules), named: never SGLang's "all", which
    gives every linear it finds a buffer and fails on one it cannot adapt (Qwen3-Next's in_proj_qkvz)."""

    @classmethod
    def of(cls, spec: ModelSpec, lora: LoRAConfig | None) -> ServedLoRA | None:
        """model.lora's, where the servers are sent adapters (None: no LoRA, or merged weights sent)."""
        if lora is None or not lora.adapter_sync:
            return None
        return cls(lora.rank, served_modules(spec, lora))


def server_args(
    cfg: RolloutConfig, launch: Launch, index: int, key: str | None, base_gpu: int | None = None
) -> dict[str, Any]:
    """SGLang's options (its CLI names) for server `index`; base_gpu: its first GPU (None:
    index x tensor_parallel on a node of its own, as bapo-serve starts them)."""
    args: dict[str, Any] = {
        "model-path": launch.model_path,
        "host": cfg.engines.host,
        "port": cfg.engines.first_port + index,
        "tp-size": cfg.engines.tensor_parallel,
        "dp-size": 1,
        "base-gpu-id": (index * cfg.engines.tensor_parallel) % max(1, _gpus_per_node())
        if base_gpu is None
        else base_gpu,
        "mem-fraction-static": mem_fraction(cfg, launch.colocated_fraction),
        "weight-version": launch.weight_version,
        "random-seed": launch.seed + index,
        "skip-tokenizer-init": True,  # we send and read token ids
    }
    if cfg.engines.colocate:
        args["enable-memory-saver"] = True
    if cfg.deterministic:
        args["enable-deterministic-inference"] = True
    if cfg.engines.dtype != "auto":
        args["dtype"] = cfg.engines.dtype
    if launch.routed_experts:
        args["enable-return-routed-experts"] = True
    if key is not None:
        args["admin-api-key"] = key
    if launch.lora is not None:
        args.update(lora_args(cfg, launch.lora))
    # the one list of the launcher's options is config.SGLANG_LAUNCHER_ARGS (the config refuses them
    # in sglang_args, --help-config shows them): an option set here and not there is a bug
    unlisted = set(args) - set(SGLANG_LAUNCHER_ARGS)
    assert not unlisted, f"SGLang options missing from config.SGLANG_LAUNCHER_ARGS: {sorted(unlisted)}"
    # validated by the config; None: SGLang's default (its --config merger would pass the string "None")
    args.update({k.replace("_", "-"): v for k, v in cfg.engines.sglang_args.items() if v is not None})
    return args


def lora_args(cfg: RolloutConfig, lora: ServedLoRA) -> dict[str, Any]:
    """What a server needs to serve the adapters model.lora.sync=adapter sends it: LoRA on, their rank
    and target modules, and room for every version a request may still name (a request kept inside
    the engine across updates samples with the adapter it began with, for up to max_staleness
    versions: weights/lora_sync.py unloads an adapter once no request names it), all in one batch.
    (Not --lora-strict-loading: SGLang 0.5.23's --config reader refuses its BooleanOptionalAction;
    the names sent are PEFT's for the family, checked against SGLang's loader in the tests.)"""
    versions = cfg.max_staleness + 2
    return {
        "enable-lora": True,
        "max-lora-rank": lora.rank,
        "lora-target-modules": list(lora.target_modules),
        "max-loaded-loras": versions,
        "max-loras-per-batch": versions,
    }


def _gpus_per_node() -> int:
    import torch

    return torch.cuda.device_count() or 1


def gpu_placement(cfg: RolloutConfig, trainer_gpus: int, node_gpus: int) -> list[int]:
    """The first GPU of each server the driver starts on its node, whose first `trainer_gpus`
    GPUs run the trainer's ranks there (one a rank, by LOCAL_RANK) out of `node_gpus`.

    Colocated, server i takes the GPUs of trainer ranks [i x TP, (i + 1) x TP): each engine
    rank shares a GPU with one trainer rank, whose memory it takes while the trainer's is
    released. On GPUs of their own, the servers follow the trainer's: trainer_gpus + i x TP.
    ValueError, naming the counts, when they do not fit (never two servers on one GPU, never a
    server beside a trainer rank that does not release its memory)."""
    tp, n = cfg.engines.tensor_parallel, cfg.engines.servers
    need = n * tp
    if cfg.engines.colocate:
        if need > trainer_gpus:
            raise ValueError(
                f"colocated, {n} server(s) x TP {tp} need the GPUs of {need} trainer ranks on the driver's node, "
                f"which runs {trainer_gpus}: use fewer or smaller servers, or engines on GPUs of their own"
            )
        return [i * tp for i in range(n)]
    if trainer_gpus + need > node_gpus:
        raise ValueError(
            f"{n} server(s) x TP {tp} on GPUs of their own need {need} GPUs beside the trainer's {trainer_gpus} "
            f"on the driver's node, which has {node_gpus}: run fewer trainer ranks there (torchrun "
            f"--nproc-per-node), set rollout.engines.colocate=true, or start the engines elsewhere (bapo-serve) "
            f"and pass rollout.engines.urls"
        )
    return [trainer_gpus + i * tp for i in range(n)]


def check_installed() -> None:
    """SGLang importable here (without importing it), before any model or process starts."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise ValueError(
            "SGLang 0.5.23 is not installed here: pip install -e '.[sglang]' (CUDA only; use "
            "rollout.engines.kind=embedded on CPU, or rollout.engines.urls for engines that run elsewhere)"
        )


def sglang_servers(
    cfg: RolloutConfig, launch: Launch, run_dir: str | Path, base_gpus: list[int] | None = None, first: int = 0
) -> tuple[list[ServerProcess], str | None]:
    """Not yet started server processes (one per rollout.engines.servers) and the admin key they use;
    base_gpus: each one's first GPU (gpu_placement; None: as bapo-serve places them); first: the
    first one's index (a node's colocated servers: engines/fleet.py)."""
    key = admin_key(cfg, run_dir)
    run_dir = Path(run_dir)
    servers = []
    for i in range(first, first + cfg.engines.servers):
        config = run_dir / f"sglang_{i}.yaml"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            base = None if base_gpus is None else base_gpus[i - first]
            args = server_args(cfg, launch, i, key, base)
            yaml.safe_dump(args, f)
        host = "127.0.0.1" if cfg.engines.host in ("0.0.0.0", "::") else cfg.engines.host
        servers.append(
            ServerProcess(
                [sys.executable, "-m", "sglang.launch_server", "--config", str(config)],
                f"http://{host}:{cfg.engines.first_port + i}",
                run_dir / f"sglang_{i}.log",
            )
        )
    return servers, key


def start_sglang(
    cfg: RolloutConfig,
    launch: Launch,
    run_dir: str | Path,
    timeout_s: float = 900.0,
    base_gpus: list[int] | None = None,
) -> tuple[list[ServerProcess], str | None]:
    """Start every server and wait until each generates; on any failure all are stopped."""
    servers, key = launch_sglang(cfg, launch, run_dir, base_gpus)
    wait_sglang(servers, key, timeout_s)
    return servers, key


def launch_sglang(
    cfg: RolloutConfig, launch: Launch, run_dir: str | Path, base_gpus: list[int] | None = None
) -> tuple[list[ServerProcess], str | None]:
    """Start every server, not waiting for them (`wait_sglang`); on a failure to start, all are stopped."""
    try:
        import sglang  # noqa: F401 (a clear error before any process starts)
    except ImportError:
        raise RuntimeError(
            "rollout.engines.kind=sglang needs SGLang 0.5.23: pip install -e '.[sglang]' "
            "(CUDA only; use rollout.engines.kind=embedded on CPU)"
        ) from None
    servers, key = sglang_servers(cfg, launch, run_dir, base_gpus)
    try:
        for s in servers:
            s.start()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers, key


def wait_sglang(servers: list[ServerProcess], key: str | None, timeout_s: float) -> None:
    """Wait until every server generates (/health_generate); on any failure all are stopped."""
    try:
        for s in servers:
            s.wait_ready(timeout_s, path="/health_generate", key=key)
    except BaseException:
        for s in servers:
            s.stop()
        raise
