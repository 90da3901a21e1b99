"""model.lora: low-rank adapters trained beside a frozen base, as PEFT's LoraConfig describes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bapo_megatron.errors import check

ALL_LINEAR = "all-linear"
"""target_modules' name for every linear projection a family adapts (PEFT's spelling)."""


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Adapters y = W x + (alpha / rank) B A dropout(x) on the projections named by their Hugging Face
    names; the base weights W are frozen (no gradient, no optimizer state). rank 0: no adapters, the
    whole model is trained. The valid names are the model family's (Family.lora_targets in its
    module under models/), checked when the model is built and by the dry run."""

    rank: int = 0
    """The adapters' rank r (PEFT's `r`); 0: off."""
    alpha: float = 16.0
    """The scale of the adapters' output is alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (PEFT's `lora_dropout`)."""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """The adapted projections by their Hugging Face names, the family's (its module in models/ says
    which: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj for the standard decoder and
    a dense or shared-expert MLP; Qwen3.5's delta-rule layers add in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a, out_proj), or "all-linear": every projection the family adapts that the weight sync
    can send (under sync "adapter" those SGLang serves: not Qwen3.5's four delta-rule input
    projections, which "merged" trains; naming one under "adapter" is refused)."""
    experts: bool = False
    """Adapt the routed experts of a mixture-of-experts layer too: every expert's gate_up_proj and
    down_proj, as PEFT adapts transformers 5's fused expert tensors (target_parameters); whatever
    target_modules says. Built for Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next (sync "merged": SGLang serves none
    of its expert adapters), GLM-4.5, DeepSeek-V3 and gpt-oss (another family is refused by name; a
    shared expert or dense MLP stays as target_modules says), with dropout 0 and
    experts run one after another (model.moe.grouped_gemm false; models/lora_experts.py)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """A's initialisation as PEFT's init_lora_weights does it: "kaiming" (True there: kaiming-uniform
    with a = sqrt(5)) or "gaussian" (normal, std 1 / rank); B starts at zero either way, so the first
    step starts from the base model's outputs."""
    sync: Literal["adapter", "merged"] = "adapter"
    """What a weight sync sends the engines. "adapter": the adapters alone, every step (megabytes), as
    a LoRA adapter each engine serves under a versioned name (SGLang's load_lora_adapter_from_tensors;
    the SGLang servers the job starts are launched for it: engines/sglang_launcher.lora_args); the
    base goes once, at the start and to an engine that restarts.
    "merged": the whole model with the adapters folded into the base weights, every step, for engines
    that cannot serve LoRA."""

    def __post_init__(self) -> None:
        check(self.rank >= 0, "rank", self.rank, "must be >= 0 (0: no adapters)")
        check(self.alpha > 0, "alpha", self.alpha, "must be > 0")
        check(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "must be in [0, 1)")
        check(bool(self.target_modules), "target_modules", self.target_modules, "names no module")
        check(
            len(set(self.target_modules)) == len(self.target_modules),
            "target_modules",
            self.target_modules,
            "names a module twice",
        )
        check(
            ALL_LINEAR not in self.target_modules or len(self.target_modules) == 1,
            "target_modules",
            self.target_modules,
            f"{ALL_LINEAR!r} already names every projection: give it alone",
        )
        check(self.sync in ("adapter", "merged"), "sync", self.sync, 'expected "adapter" or "merged"')

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def adapter_sync(self) -> bool:
        """Whether the engines are sent the adapters alone (LoRA on, sync "adapter")."""
        return self.enabled and self.sync == "adapter"
