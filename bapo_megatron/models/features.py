"""The typed features a ModelSpec may hold beside its dense decoder's shape: routed experts
(MoESpec), multi-latent attention (LatentAttentionSpec) and its YaRN scaling (YarnSpec), Gated
DeltaNet linear attention (LinearAttentionSpec), sliding windows (SlidingWindowSpec). Each checks
its own values, naming the config.json key that sets them.
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_megatron.errors import check


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The routed experts of a mixture-of-experts model: Qwen3-MoE's by default (softmax router,
    top-k, no shared expert); DeepSeek-V3's and GLM-4.5's set the sigmoid router, its expert-score
    correction bias, grouped top-k, the scaling factor and a shared expert."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    """Each expert's MLP width (moe_intermediate_size)."""
    norm_topk_prob: bool
    """The top-k probabilities are renormalised to sum to 1 (Megatron: softmax after top-k)."""
    sparse_layers: tuple[int, ...]
    """0-based indices of the layers whose MLP is the experts (the others are dense)."""
    score_function: str = "softmax"
    """How router logits become scores: "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3, GLM-4.5)."""
    expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only (HF e_score_correction_bias,
    Megatron's router expert_bias); kept as loaded: RL never updates it."""
    num_groups: int | None = None
    """Experts in this many equal groups, of which each token may use `group_top_k` (n_group); None: no
    group limit (one group, or every group allowed)."""
    group_top_k: int | None = None
    """Groups each token chooses, by the sum of each group's top two scores (topk_group)."""
    scaling_factor: float = 1.0
    """The chosen experts' weights are multiplied by it (routed_scaling_factor)."""
    shared_ffn_hidden_size: int = 0
    """The width of the shared expert every token also goes through (0: none)."""
    shared_gate: bool = False
    """The shared expert's output is scaled by sigmoid(a learned [1, hidden] projection) (Qwen3-Next)."""

    def __post_init__(self) -> None:
        check(self.num_experts >= 2, "num_experts", self.num_experts, "must be >= 2")
        check(1 <= self.top_k <= self.num_experts, "num_experts_per_tok", self.top_k, "must lie in [1, num_experts]")
        check(self.ffn_hidden_size >= 1, "moe_intermediate_size", self.ffn_hidden_size, "must be >= 1")
        check(bool(self.sparse_layers), "mlp_only_layers", self.sparse_layers, "leave no layer with experts")
        check(self.score_function in SCORE_FUNCTIONS, "scoring_func", self.score_function, f"not in {SCORE_FUNCTIONS}")
        # Megatron (moe_utils.topk_routing_with_score_function) divides sigmoid scores by their sum
        # when top_k > 1 and never at top_k 1; transformers divides whenever norm_topk_prob says so
        check(
            self.score_function == "softmax" or self.norm_topk_prob == (self.top_k > 1),
            "norm_topk_prob",
            self.norm_topk_prob,
            f"must be {self.top_k > 1} with sigmoid scores at num_experts_per_tok={self.top_k} (Megatron "
            "renormalises sigmoid scores exactly when it routes a token to more than one expert)",
        )
        check(
            not self.expert_bias or self.score_function == "sigmoid",
            "e_score_correction_bias",
            self.expert_bias,
            "is mapped with sigmoid scores only",
        )
        check(self.scaling_factor > 0, "routed_scaling_factor", self.scaling_factor, "must be > 0")
        check(self.shared_ffn_hidden_size >= 0, "n_shared_experts", self.shared_ffn_hidden_size, "must be >= 0")
        check(
            not self.shared_gate or self.shared_ffn_hidden_size > 0,
            "shared_expert_gate",
            self.shared_gate,
            "needs a shared expert",
        )
        self._check_groups()

    def _check_groups(self) -> None:
        check(
            (self.num_groups is None) == (self.group_top_k is None),
            "n_group",
            self.num_groups,
            f"and topk_group={self.group_top_k} are set together",
        )
        if self.num_groups is None:
            return
        groups, chosen = self.num_groups, self.group_top_k
        check(
            groups >= 2 and self.num_experts % groups == 0 and self.num_experts // groups >= 2,
            "n_group",
            groups,
            f"must be >= 2 and divide the {self.num_experts} experts into groups of 2 or more",
        )
        check(1 <= chosen < groups, "topk_group", chosen, f"must lie in [1, n_group={groups})")
        # Megatron scores a group by its top (top_k / group_top_k) experts, transformers by its top 2
        check(
            self.top_k == 2 * chosen,
            "topk_group",
            chosen,
            f"must be half of num_experts_per_tok={self.top_k}: Megatron scores a group by its top "
            "num_experts_per_tok / topk_group experts where transformers and SGLang take the top 2",
        )

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True, kw_only=True)
class YarnSpec:
    """YaRN RoPE scaling (rope_scaling.rope_type "yarn", DeepSeek-V3's), as config.json states it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    """Scales the rotary cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
    are set (transformers' rule; 0: unset)."""
    mscale_all_dim: float = 0.0
    """Scales the attention's softmax by mscale(factor, mscale_all_dim) squared (0: unset)."""
    truncate: bool = True
    """The correction range's bounds rounded to whole dims (transformers' truncate; gpt-oss: false)."""

    def __post_init__(self) -> None:
        check(self.factor >= 1, "rope_scaling.factor", self.factor, "must be >= 1")
        check(
            self.original_max_position_embeddings >= 1,
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
            "must be >= 1",
        )


@dataclass(frozen=True, kw_only=True)
class LatentAttentionSpec:
    """Multi-latent attention (DeepSeek-V3's MLA): keys and values up-projected per head from one
    shared latent of kv_lora_rank, queries from the hidden state or a latent of q_lora_rank; each
    head's query and key are a part without position (qk_nope_head_dim) and a rotary part
    (qk_rope_head_dim, the key's shared by all heads)."""

    q_lora_rank: int | None
    """The queries' latent width (None: queries projected from the hidden state directly)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    """The rotary dims of a head are stored as interleaved pairs (DeepSeek's layout; Megatron's)."""
    yarn: YarnSpec | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim, "must be even")
        check(self.q_lora_rank is None or self.q_lora_rank >= 1, "q_lora_rank", self.q_lora_rank, "must be >= 1")

    @property
    def qk_head_dim(self) -> int:
        """A query's (and key's) width per head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class LinearAttentionSpec:
    """Gated DeltaNet linear attention in some layers (Qwen3.5, Qwen3-Next), full attention in the
    others: a causal depthwise convolution over [q; k; v], then the gated delta rule per value head
    (each key head shared by num_value_heads / num_key_heads of them), an RMSNorm gated by z."""

    layers: tuple[int, ...]
    """0-based indices of the linear-attention layers (layer_types "linear_attention")."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_dim"):
            check(getattr(self, name) >= 1, f"linear_{name}", getattr(self, name), "must be >= 1")
        check(
            self.num_value_heads % self.num_key_heads == 0,
            "linear_num_value_heads",
            self.num_value_heads,
            f"must be a multiple of linear_num_key_heads={self.num_key_heads}",
        )

    def is_linear(self, layer: int) -> bool:
        return layer in self.layers


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec:
    """Sliding-window attention in some layers (layer_types "sliding_attention"), full in the others."""

    size: int
    """Positions a query attends to, its own included (sliding_window)."""
    layers: tuple[int, ...]
    """0-based indices of the sliding-window layers."""

    def __post_init__(self) -> None:
        check(self.size >= 1, "sliding_window", self.size, "must be >= 1")

    def is_windowed(self, layer: int) -> bool:
        return layer in self.layers
