"""The embedded engine's LoRA adapters: PEFT adapters checked in full, kept resident by id, and added
to the served model's linear layers in its forward, each row of a batch under its own request's adapter.

An adapter is PEFT's (adapter_config.json's fields, tensors named `base_model.model.<module>.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]); a targeted linear layer computes, as peft's LoRA Linear does
at inference (no dropout), `base(x) + (x A^T) B^T * scaling` with scaling = lora_alpha / r, or
lora_alpha / sqrt(r) under use_rslora. The base weights are never touched: the adapters act through
forward hooks on the targeted layers, so base weight updates load as before and several adapters
(a new version while requests of the old still run) are resident at once. The decode loop tells
`ServedAdapters.rows` which request each row of a forward belongs to (decode.py).
"""

from __future__ import annotations

import contextlib
import math
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bapo_megatron.engines.embedded import lora_experts
from bapo_megatron.engines.embedded.request_queue import EngineRequest
from bapo_megatron.models.lora import PEFT_PREFIX

ALL_LINEAR = "all-linear"
"""PEFT's target_modules shorthand: every linear layer but the output embedding."""
TENSOR_SOURCE = "__tensor__"
"""What SGLang reports as the path of an adapter loaded from tensors (loaded_adapters)."""
_NAME = re.compile(rf"{re.escape(PEFT_PREFIX)}(?P<module>.+)\.lora_(?P<matrix>[AB])\.weight")

UNSUPPORTED = {
    "use_dora": "DoRA (SGLang refuses it too)",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "lora_bias": "adapter biases",
    "use_qalora": "QA-LoRA",
    "modules_to_save": "fully trained modules beside the adapters",
    "layers_to_transform": "a subset of the layers",
    "layers_pattern": "a subset of the layers",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "exclude_modules": "excluded modules",
    "trainable_token_indices": "trained token embeddings",
    "alora_invocation_tokens": "activated LoRA",
    "layer_replication": "replicated layers",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}
"""PEFT 0.21 fields that change what an adapter computes, which this engine does not serve: refused
unless unset (null, false or empty)."""
INERT = frozenset(
    {
        "task_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",  # training only
        "init_lora_weights",  # how A and B started; the tensors are given
        "megatron_config",
        "megatron_core",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "qalora_group_size",
        "ensure_weight_tying",
    }
)
"""PEFT 0.21 fields that do not change what a loaded adapter computes."""


@dataclass(frozen=True)
class AdapterConfig:
    """What of a PEFT adapter_config.json the forward uses."""

    r: int
    lora_alpha: float
    target_modules: str | tuple[str, ...]
    """PEFT's: a regular expression a module's full name must match, or names its name ends with."""
    use_rslora: bool = False
    experts: bool = False
    """Whether the routed experts' fused tensors are adapted (target_parameters: engines/embedded/lora_experts.py)."""

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_peft(cls, config: object) -> AdapterConfig:
        """The fields of a PEFT adapter config (its JSON object); ValueError naming the first field that
        is missing, malformed, or asks for what this engine does not serve."""
        if not isinstance(config, dict):
            raise ValueError(f"config_dict must be a PEFT adapter_config.json object, not {type(config).__name__}")
        for name in ("r", "lora_alpha", "target_modules"):
            if name not in config:
                raise ValueError(f"config_dict.{name}: missing")
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"config_dict.peft_type={config['peft_type']!r}: only LORA adapters are served")
        if config.get("bias", "none") != "none":
            raise ValueError(f"config_dict.bias={config['bias']!r}: adapters with biases are not served (none)")
        for name, what in UNSUPPORTED.items():
            if config.get(name):
                raise ValueError(f"config_dict.{name}={config[name]!r:.100}: {what} is not served")
        parameters = config.get("target_parameters")
        if parameters and (not isinstance(parameters, list) or set(parameters) != lora_experts.TARGET_PARAMETERS):
            served = sorted(lora_experts.TARGET_PARAMETERS)
            raise ValueError(f"config_dict.target_parameters={parameters!r:.100}: only {served} together are served")
        known = {"r", "lora_alpha", "target_modules", "use_rslora", "peft_type", "bias", "target_parameters"}
        known |= {*UNSUPPORTED, *INERT}
        unknown = sorted(k for k, v in config.items() if k not in known and v)
        if unknown:
            raise ValueError(f"config_dict.{unknown[0]}: not a PEFT 0.21 LoRA field this engine knows to be inert")
        r, alpha, targets = config["r"], config["lora_alpha"], config["target_modules"]
        rslora = config.get("use_rslora")
        if type(r) is not int or r <= 0:
            raise ValueError(f"config_dict.r={r!r}: must be an integer > 0")
        if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"config_dict.lora_alpha={alpha!r}: must be a number > 0")
        if isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
            targets = tuple(targets)
        elif not isinstance(targets, str) or not targets:
            raise ValueError(f"config_dict.target_modules={targets!r:.100}: must be a pattern or a list of names")
        if rslora not in (None, False, True):
            raise ValueError(f"config_dict.use_rslora={rslora!r}: must be true or false")
        return cls(r, float(alpha), targets, bool(rslora), bool(parameters))

    def targets(self, name: str) -> bool:
        """Whether a module of this full name is targeted, as PEFT's check_target_module_exists decides."""
        if isinstance(self.target_modules, str):
            try:
                return re.fullmatch(self.target_modules, name) is not None
            except re.error as err:
                raise ValueError(f"config_dict.target_modules={self.target_modules!r}: not a pattern: {err}") from None
        return name in self.target_modules or any(name.endswith(f".{t}") for t in self.target_modules)


@dataclass
class Adapter:
    """One resident adapter: its name, the id that tells it from a later one of the same name, and
    (A, B) per targeted module, in the served model's dtype."""

    name: str
    source: str  # its directory, or TENSOR_SOURCE
    config: AdapterConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    experts: lora_experts.Deltas = field(default_factory=dict)
    """The routed experts' fused tensors' deltas (target_parameters), by experts module."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def scaling(self) -> float:
        return self.config.scaling


class ServedAdapters:
    """The adapters resident in the served model, by id, and the hooks that add them to its forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.experts = lora_experts.expert_modules(model)
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self._output = next((n for n, m in self.linears.items() if m is output), None)
        self.resident: dict[str, Adapter] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._active: list[tuple[Adapter, torch.Tensor | None]] = []  # during a forward: adapter, its rows
        self._batch = 0  # during a forward of rows picked out: how many rows it has

    # -- an adapter in ----------------------------------------------------------------------
    def build(
        self, name: str, config_dict: object, tensors: Iterable[tuple[str, torch.Tensor]], source: str
    ) -> Adapter:
        """An adapter of the served model from a PEFT config and its tensors, checked in full first:
        ValueError naming the first field or tensor that does not fit (nothing is kept then)."""
        config = AdapterConfig.from_peft(config_dict)
        targeted = self._targeted(config)
        received: dict[str, torch.Tensor] = {}
        routed: dict[str, torch.Tensor] = {}
        for tensor_name, tensor in tensors:
            if tensor_name in received or tensor_name in routed:
                raise ValueError(f"{tensor_name}: sent twice")
            if config.experts and lora_experts.is_expert_tensor(tensor_name):
                routed[tensor_name] = tensor
                continue
            self._check_tensor(tensor_name, tensor, config, targeted)
            received[tensor_name] = tensor
        experts = (
            lora_experts.build_deltas(self.experts, config.r, config.scaling, routed.items()) if config.experts else {}
        )
        weights = {}
        for module in targeted:
            a_name, b_name = (f"{PEFT_PREFIX}{module}.lora_{m}.weight" for m in "AB")
            missing = next((n for n in (a_name, b_name) if n not in received), None)
            if missing is not None:
                raise ValueError(f"{missing}: missing (target_modules {_shown(config.target_modules)} names {module})")
            dtype = self.linears[module].weight.dtype
            # copies: the received tensors may be views of a payload's shared memory
            weights[module] = tuple(received[n].to(dtype=dtype, copy=True).contiguous() for n in (a_name, b_name))
        return Adapter(name, source, config, weights, experts)

    def _targeted(self, config: AdapterConfig) -> list[str]:
        """The served model's linear layers `config` targets (PEFT's all-linear: all but the output)."""
        if isinstance(config.target_modules, str) and config.target_modules.lower() == ALL_LINEAR:
            targeted = [n for n in self.linears if n != self._output]
        else:
            targeted = [n for n in self.linears if config.targets(n)]
        if not targeted:
            raise ValueError(
                f"config_dict.target_modules={_shown(config.target_modules)}: names no linear layer of the served model"
            )
        return targeted

    def _check_tensor(self, name: str, tensor: object, config: AdapterConfig, targeted: Sequence[str]) -> None:
        match = _NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(f"{name!r:.200}: not a PEFT LoRA tensor name ({PEFT_PREFIX}<module>.lora_A|B.weight)")
        module, matrix = match["module"], match["matrix"]
        if module not in self.linears:
            raise ValueError(f"{name}: the served model has no linear layer {module}")
        if module not in targeted:
            raise ValueError(f"{name}: {module} is not in target_modules {_shown(config.target_modules)}")
        if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
            raise ValueError(f"{name}: dtype {getattr(tensor, 'dtype', type(tensor).__name__)}; must be floating point")
        linear = self.linears[module]
        want = (config.r, linear.in_features) if matrix == "A" else (linear.out_features, config.r)
        if tuple(tensor.shape) != want:
            shape = "(r, in)" if matrix == "A" else "(out, r)"
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {shape} = {want}")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name}: holds NaN or infinite values")

    def add(self, adapter: Adapter) -> None:
        """Make `adapter` resident (built by `build`); its layers get the hook."""
        self.resident[adapter.id] = adapter
        for module in adapter.weights:
            if module not in self._hooks:
                self._hooks[module] = self.linears[module].register_forward_hook(self._hook(module))
        for module in adapter.experts:
            if module not in self._hooks:
                hook = lora_experts.expert_hook(self, module)
                self._hooks[module] = self.experts[module].register_forward_hook(hook)

    def remove(self, adapter_id: str) -> None:
        """Forget an adapter; a layer no resident adapter targets loses its hook."""
        self.resident.pop(adapter_id, None)  # gone already: an unload retried after its caller left
        used = {m for a in self.resident.values() for m in (*a.weights, *a.experts)}
        for module in [m for m in self._hooks if m not in used]:
            self._hooks.pop(module).remove()

    # -- the forward ------------------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, batch: Sequence[EngineRequest]) -> Iterator[None]:
        """Within the block, row b of the model's forwards runs under batch[b]'s adapter (none: the base)."""
        adapter_ids = [r.lora_id for r in batch]
        if not any(adapter_ids):
            yield
            return
        if len(set(adapter_ids)) == 1:  # one adapter for every row: no rows picked out
            self._active = [(self.resident[adapter_ids[0]], None)]
        else:
            groups: dict[str, list[int]] = {}
            for b, adapter_id in enumerate(adapter_ids):
                if adapter_id is not None:
                    groups.setdefault(adapter_id, []).append(b)
            self._active = [(self.resident[i], torch.tensor(rows)) for i, rows in groups.items()]
            self._batch = len(adapter_ids)
        try:
            yield
        finally:
            self._active, self._batch = [], 0

    def _hook(self, module: str):
        def add_adapters(layer: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            out = None
            for adapter, rows in self._active:
                pair = adapter.weights.get(module)
                if pair is None:
                    continue
                if rows is not None and args[0].shape[0] != self._batch:
                    raise RuntimeError(
                        f"{module}: input {tuple(args[0].shape)} is not by the forward's {self._batch} rows, "
                        "so the rows of requests under different adapters cannot be told apart there"
                    )
                x = args[0] if rows is None else args[0][rows]
                # peft's order of operations: x through A, then B, then the scaling, added to the base's
                update = F.linear(F.linear(x, pair[0]), pair[1]) * adapter.scaling
                out = output if out is None else out
                out = out + update if rows is None else out.index_add(0, rows, update)
            return out

        return add_adapters


def _shown(targets: str | tuple[str, ...]) -> str:
    return repr(targets if isinstance(targets, str) else list(targets))[:200]
