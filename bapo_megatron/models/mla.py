"""Multi-latent attention (MLA, DeepSeek-V3's) as a decoder's attention part: its HF <-> Megatron
tensors, and Megatron-Core 0.16.1's MLASelfAttention made to build on the local layer spec.

HF `self_attn.X` is Megatron `self_attention.Y` (Transformer Engine's name where it differs):
  q_a_proj -> linear_q_down_proj; q_a_layernorm -> q_layernorm (linear_q_up_proj.layer_norm_weight);
  q_b_proj -> linear_q_up_proj; or q_proj -> linear_q_proj where queries have no latent;
  kv_a_proj_with_mqa -> linear_kv_down_proj ([the kv latent; the rotary key all heads share]);
  kv_a_layernorm -> kv_layernorm (linear_kv_up_proj.layer_norm_weight); kv_b_proj -> linear_kv_up_proj;
  o_proj -> linear_proj.
Every row keeps its place: Megatron lays out each head as transformers does ([no-position; rotary]
for queries and keys, [key; value] from the latent), and its MLA RoPE takes the rotary dims as
interleaved pairs, DeepSeek's layout (rope_interleave). A checkpoint with rope_interleave false keeps
each rotary part as two halves: those rows are interleaved on the way in and split back on the way out.
A dist checkpoint stores the latent norms under Transformer Engine's names whatever spec saved them.

The latent norms take config.json's rms_norm_eps, as SGLang's and Megatron's do; transformers fixes
them at 1e-6 (DeepSeek-V3's and Kimi-K2's value), so the embedded engine, which serves transformers'
model, says once when it serves another (engine_differences; Moonlight's 1e-5).

The local spec's MLA does not build on 0.16.1 without Transformer Engine (three obstacles, worked
around for this attention only, in `local_layer`): its module flags TE present when TE is absent
(Megatron's TE placeholders make HAVE_TE true) and then calls isinstance on a placeholder; the local
core attention refuses the key and value widths (k_channels, v_channels) MLA passes it; and its YaRN
embedding builds its buffers inside a CUDA device context, which fails on a machine without CUDA
although config.use_cpu_initialization asks for the CPU (MLA does not pass it on). A fourth is a
wrong gradient at TP > 1: the local spec's column-parallel down-projections gather their outputs, and
the gather's backward keeps only this rank's heads' share of the gradient of the rotary key all heads
use; they are replicated here, as Transformer Engine's are. Tensor parallel needs sequence parallel
(spec.check_layout): without it the rotary key's gradient is partial on either spec, and Megatron
sums the latent query norm's gradient over TP ranks that all computed it whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from bapo_megatron.models.decoder import Decoder
from bapo_megatron.models.family import AttentionMemory
from bapo_megatron.models.features import LatentAttentionSpec
from bapo_megatron.models.local_attention import sdpa_attention
from bapo_megatron.models.lora_targets import PROJ, Layout, Target
from bapo_megatron.models.recipes import Fused, Recipe, Rows
from bapo_megatron.models.spec import ModelSpec

TE_NORMS = {"q_layernorm.": "linear_q_up_proj.layer_norm_", "kv_layernorm.": "linear_kv_up_proj.layer_norm_"}
"""The latent norms' local names and Transformer Engine's, where they fuse into the up-projections."""
REPLICATED = ("q_a_proj.weight", "kv_a_proj_with_mqa.weight")
"""The down-projections, whole on every tensor-parallel rank."""
ATTN = "self_attention."
Q_PROJ, Q_DOWN, Q_UP = ATTN + "linear_q_proj", ATTN + "linear_q_down_proj", ATTN + "linear_q_up_proj"
KV_DOWN, KV_UP = ATTN + "linear_kv_down_proj", ATTN + "linear_kv_up_proj"


def interleave_rope(weight: torch.Tensor, width: int, rope: int) -> torch.Tensor:
    """Rows in groups of `width` whose last `rope` rows are two halves, each pair (i, rope/2 + i)
    made adjacent (rope_interleave false -> DeepSeek's interleaved layout)."""
    groups = weight.reshape(-1, width, *weight.shape[1:])
    plain, rotary = groups.split([width - rope, rope], dim=1)
    pairs = torch.stack(rotary.chunk(2, dim=1), dim=2).reshape(rotary.shape)
    return torch.cat([plain, pairs], dim=1).reshape(weight.shape)


def split_rope(weight: torch.Tensor, width: int, rope: int) -> torch.Tensor:
    """The inverse of interleave_rope."""
    groups = weight.reshape(-1, width, *weight.shape[1:])
    plain, rotary = groups.split([width - rope, rope], dim=1)
    halves = rotary.reshape(rotary.shape[0], rope // 2, 2, *rotary.shape[2:]).transpose(1, 2)
    return torch.cat([plain, halves.reshape(rotary.shape)], dim=1).reshape(weight.shape)


class LatentAttention(Decoder):
    """A decoder whose attention is multi-latent (spec.latent_attention) in every layer."""

    def _latent_names(self, spec: ModelSpec, te: bool) -> list[tuple[str, str]]:
        """(HF suffix under self_attn., Megatron suffix under self_attention.) in loading order."""
        mla = spec.latent_attention
        norm = TE_NORMS if te else {k: k for k in TE_NORMS}
        if mla.q_lora_rank is None:
            query = [("q_proj.weight", "linear_q_proj.weight")]
        else:
            query = [
                ("q_a_proj.weight", "linear_q_down_proj.weight"),
                ("q_a_layernorm.weight", norm["q_layernorm."] + "weight"),
                ("q_b_proj.weight", "linear_q_up_proj.weight"),
            ]
        return [
            *query,
            ("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
            ("kv_a_layernorm.weight", norm["kv_layernorm."] + "weight"),
            ("kv_b_proj.weight", "linear_kv_up_proj.weight"),
            ("o_proj.weight", "linear_proj.weight"),
        ]

    def _latent_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Each HF suffix under self_attn. with its shape."""
        mla, d, heads = spec.latent_attention, spec.hidden_size, spec.num_heads
        shapes = {}
        if mla.q_lora_rank is None:
            shapes["q_proj.weight"] = (heads * mla.qk_head_dim, d)
        else:
            shapes["q_a_proj.weight"] = (mla.q_lora_rank, d)
            shapes["q_a_layernorm.weight"] = (mla.q_lora_rank,)
            shapes["q_b_proj.weight"] = (heads * mla.qk_head_dim, mla.q_lora_rank)
        shapes["kv_a_proj_with_mqa.weight"] = (mla.kv_lora_rank + mla.qk_rope_head_dim, d)
        shapes["kv_a_layernorm.weight"] = (mla.kv_lora_rank,)
        shapes["kv_b_proj.weight"] = (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        shapes["o_proj.weight"] = (d, heads * mla.v_head_dim)
        return shapes

    def _rope_rows(self, mla: LatentAttentionSpec, hf_suffix: str) -> int | None:
        """The row-group width of a tensor whose rotary rows are permuted (rope_interleave false), or None."""
        if mla.rope_interleave:
            return None
        if hf_suffix in ("q_proj.weight", "q_b_proj.weight"):
            return mla.qk_head_dim
        if hf_suffix == "kv_a_proj_with_mqa.weight":
            return mla.kv_lora_rank + mla.qk_rope_head_dim
        return None

    # -- the decoder's attention part
    def _attention_hf_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        p = f"model.layers.{layer}.self_attn."
        return {p + suffix: shape for suffix, shape in self._latent_shapes(spec).items()}

    def _attention_recipes(self, spec: ModelSpec, layer: int, te: bool = False) -> dict[str, Recipe]:
        h, m = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}.self_attention."
        mla, recipes = spec.latent_attention, {}
        for hf, mg in self._latent_names(spec, te):
            width = self._rope_rows(mla, hf)
            if width is None:
                recipes[m + mg] = Rows((h + hf,))
            else:
                fn = functools.partial(interleave_rope, width=width, rope=mla.qk_rope_head_dim)
                recipes[m + mg] = Fused(fn, (h + hf,))
        return recipes

    def _attention_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        h, m = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}.self_attention."
        mla = spec.latent_attention
        te = m + TE_NORMS["kv_layernorm."] + "weight" in mg  # a TE model, or a dist checkpoint's names
        for hf, name in self._latent_names(spec, te):
            width = self._rope_rows(mla, hf)
            tensor = mg[m + name]
            yield h + hf, tensor if width is None else split_rope(tensor, width, mla.qk_rope_head_dim)

    def _attention_stored_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = self._latent_shapes(spec)
        return {"self_attention." + mg: shapes[hf] for hf, mg in self._latent_names(spec, te=True)}

    def _attention_params(self, spec: ModelSpec, layer: int) -> dict[str, int]:
        """The up- and output projections split over TP; the down-projections (replicated, as
        Megatron's MLA holds them here: local_layer) and the norms whole on every rank."""
        shapes = self._latent_shapes(spec)
        sizes = {suffix: math.prod(shape) for suffix, shape in shapes.items()}
        whole = sum(n for s, n in sizes.items() if s in REPLICATED or len(shapes[s]) == 1)
        return {
            "tensor": sum(sizes.values()) - whole,
            "replicated": whole + 2 * spec.hidden_size,
            "router": 0,
            "experts": 0,
        }

    def normed_qk_width(self, spec: ModelSpec) -> int:
        """The latent norms normalise one query latent and one kv latent per token (for the estimate)."""
        mla = spec.latent_attention
        return (mla.q_lora_rank or 0) + mla.kv_lora_rank

    def attention_memory(self, spec: ModelSpec, layer: int, local: bool, selective: bool) -> AttentionMemory:
        """Multi-latent attention's own intermediates (Megatron-Core 0.16.1's MLASelfAttention), not a
        head of q/k's width: per head the query and key after rope (nope + rope each: the rotary key
        repeated to every head), the kv up-projection's [k nope; value], the context (v_head_dim),
        and under the fused layers the attention output once more; per token, whole, the latents: the
        query latent and the kv down-projection's output (the kv latent and the rotary key), each
        norm's output (and x * rsqrt under the local modules). Core attention's inputs are these same
        tensors; the local modules' fused kernel (models/local_attention.py) keeps, unless it is
        recomputed (selective), the values padded to the query's width (nope + rope), its output at
        that width and a float32 log-sum-exp a head besides."""
        mla, h = spec.latent_attention, spec.num_heads
        nope, rope, v = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        kernel = local and not selective
        split = h * (2 * (nope + rope) + (nope + v) + (1 if local else 2) * v)
        if kernel:
            split += h * (nope + rope) * (2 if v < nope + rope else 1)
        norms = 3 if local else 2  # a norm's input, (x * rsqrt,) output
        latents = norms * (mla.q_lora_rank or 0) + (mla.kv_lora_rank + rope) + (norms - 1) * mla.kv_lora_rank
        rotary = 4 * rope if local else 0
        return AttentionMemory(split, h if kernel else 0, latents, rotary, fused=self.local_attention_fused)

    def engine_differences(self, spec: ModelSpec) -> tuple[str, ...]:
        """transformers fixes the latent norms' epsilon at 1e-6 (DeepSeek-V3's rms_norm_eps); the
        trainer and SGLang take rms_norm_eps (Moonlight's 1e-5)."""
        if spec.rms_norm_eps == 1e-6:
            return ()
        return (
            f"transformers' {spec.architecture} latent norms (q_a_layernorm, kv_a_layernorm) use epsilon 1e-6, "
            f"the trainer's and SGLang's rms_norm_eps={spec.rms_norm_eps:g}: the embedded engine's log-probs "
            "differ slightly from the trainer's",
        )

    def engine_cache_bytes(self, spec: ModelSpec, tp: int, dtype_bytes: int = 2) -> int:
        """SGLang's MLA caches a token's kv latent and rotary key, whole on every TP rank."""
        mla = spec.latent_attention
        return spec.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * dtype_bytes

    def stored_layer_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        """Transformer Engine's MLA keeps the input norm a module of its own (input_layernorm)."""
        d = spec.hidden_size
        shapes = {"input_layernorm.weight": (d,), "mlp.linear_fc1.layer_norm_weight": (d,)}
        return shapes | self._attention_stored_shapes(spec, layer) | self._mlp_stored_shapes(spec, layer)

    def norm_names(self, spec: ModelSpec, layer: int, impl: str) -> tuple[str, str]:
        """The input norm is `input_layernorm` under either spec (Transformer Engine's MLA does not
        fuse it into a linear layer)."""
        return "input_layernorm.weight", super().norm_names(spec, layer, impl)[1]

    def layer_recipes(self, spec: ModelSpec, layer: int, impl: str, grouped: bool) -> dict[str, Recipe]:
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn_norm, mlp_norm = self.norm_names(spec, layer, impl)
        recipes: dict[str, Recipe] = {m + attn_norm: Rows((h + "input_layernorm.weight",))}
        recipes |= self._attention_recipes(spec, layer, te=impl == "transformer_engine")
        recipes[m + mlp_norm] = Rows((h + "post_attention_layernorm.weight",))
        return recipes | self._mlp_recipes(spec, layer, grouped)

    # -- LoRA
    def latent_lora_targets(self, spec: ModelSpec) -> dict[str, Target]:
        """Every projection of multi-latent attention, each beside its own Megatron linear: the adapter
        of a down-projection writes its output before the latent norm, as PEFT's does (the local
        spec keeps the norms modules of their own: q_layernorm, kv_layernorm). What SGLang 0.5.23
        serves from PEFT's tensors (its deepseek_v2.py and lora/): q_b_proj and kv_b_proj (column
        parallel; kv_b_proj's delta added to its absorbed path too: lora/deepseek_mla_correction.py),
        o_proj, and q_a_proj with kv_a_proj_with_mqa together (its fused_qkv_a_proj_with_mqa stacks the
        two; one alone is padded to the other's shape or filed under no module). Without a query
        latent its q_proj (normalised to qkv_proj: stacked with a k_proj and v_proj it lacks) and
        kv_a_proj_with_mqa (filed under fused_qkv_a_proj_with_mqa, which that model has not) are
        not served."""
        mla, d, heads = spec.latent_attention, spec.hidden_size, spec.num_heads
        q, p = heads * mla.qk_head_dim, "self_attn."
        kv_down = mla.kv_lora_rank + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            query = {"q_proj": Target("q_proj", p + "q_proj", Q_PROJ, "column", d, q, served=False)}
            kv_a = Target(
                "kv_a_proj_with_mqa", p + "kv_a_proj_with_mqa", KV_DOWN, "replicated", d, kv_down, served=False
            )
        else:
            q_a = Target("q_a_proj", p + "q_a_proj", Q_DOWN, "replicated", d, mla.q_lora_rank)
            query = {
                "q_a_proj": dataclasses.replace(q_a, served_with=("kv_a_proj_with_mqa",)),
                "q_b_proj": Target("q_b_proj", p + "q_b_proj", Q_UP, "column", mla.q_lora_rank, q),
            }
            kv_a = Target(
                "kv_a_proj_with_mqa",
                p + "kv_a_proj_with_mqa",
                KV_DOWN,
                "replicated",
                d,
                kv_down,
                served_with=("q_a_proj",),
            )
        kv_b = Target(
            "kv_b_proj",
            p + "kv_b_proj",
            KV_UP,
            "column",
            mla.kv_lora_rank,
            heads * (mla.qk_nope_head_dim + mla.v_head_dim),
        )
        o = Target("o_proj", p + "o_proj", PROJ, "row", heads * mla.v_head_dim, d)
        return query | {"kv_a_proj_with_mqa": kv_a, "kv_b_proj": kv_b, "o_proj": o}

    def latent_lora_layout(self, spec: ModelSpec, module: str) -> Layout:
        """Each latent linear adapts one projection: the up-projections' rows by head (split over TP
        as their weights are), the down-projections' whole; where rope_interleave is false the
        rotary rows of a query head and of the rotary key are halves in HF's rows and interleaved in
        Megatron's (the weights' own reorder, interleave_rope)."""
        mla, heads = spec.latent_attention, spec.num_heads
        rope = mla.qk_rope_head_dim
        name, groups, width = {
            Q_PROJ: ("q_proj", heads, mla.qk_head_dim),
            Q_UP: ("q_b_proj", heads, mla.qk_head_dim),
            Q_DOWN: ("q_a_proj", 1, mla.q_lora_rank),
            KV_DOWN: ("kv_a_proj_with_mqa", 1, mla.kv_lora_rank + rope),
            KV_UP: ("kv_b_proj", heads, mla.qk_nope_head_dim + mla.v_head_dim),
        }[module]
        rotary = () if mla.rope_interleave or name in ("q_a_proj", "kv_b_proj") else ((name, rope),)
        split = "none" if module in (Q_DOWN, KV_DOWN) else "groups"
        return Layout(groups, ((name, width),), split, rope=rotary)

    # -- Megatron
    def config_class(self, spec: ModelSpec) -> type:
        return megatron_classes()[2]

    def transformer_fields(self, spec: ModelSpec) -> dict[str, Any]:
        mla = spec.latent_attention
        fields = super().transformer_fields(spec) | {
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_head_dim": mla.qk_nope_head_dim,
            "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "qk_layernorm": True,  # MLA's latent norms (q_layernorm, kv_layernorm) are its qk norms
            "rotary_base": spec.rope_theta,
        }
        yarn = mla.yarn
        if yarn is None:  # mscale_all_dim 0: a softmax scale of 1 / sqrt(q head width), as transformers'
            return fields | {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}
        return fields | {
            "rope_type": "yarn",
            "rotary_scaling_factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            # transformers scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) only
            # when both are set, else by mscale(factor); Megatron does the latter when its mscale is None
            "mscale": yarn.mscale if yarn.mscale and yarn.mscale_all_dim else None,
            "mscale_all_dim": yarn.mscale_all_dim,
        }

    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        from megatron.core.models.gpt import gpt_layer_specs as specs

        if te:
            return specs.get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, qk_layernorm=True)
        return local_layer(
            specs.get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
        )


# -- Megatron's MLA on the local spec


def local_layer(layer: Any) -> Any:
    """A local-spec MLA layer spec whose attention builds without Transformer Engine or CUDA, its norms
    stored under Transformer Engine's names (as the other families' local layers store theirs)."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.spec_utils import ModuleSpec

    core, attention_class, _ = megatron_classes()
    attention = layer.submodules.self_attention
    # the down-projections replicated over TP, as Transformer Engine's MLA has them: the local spec's
    # column-parallel ones gather their outputs, and the gather's backward keeps only this rank's
    # heads' share of the rotary key's gradient (every head uses that key)
    submodules = dataclasses.replace(
        attention.submodules, core_attention=core, linear_q_down_proj=Linear, linear_kv_down_proj=Linear
    )
    attention = ModuleSpec(module=attention_class, params=attention.params, submodules=submodules)
    stored = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    stored |= {"self_attention." + k: "self_attention." + v for k, v in TE_NORMS.items()}
    submodules = dataclasses.replace(layer.submodules, self_attention=attention, sharded_state_dict_keys_map=stored)
    return ModuleSpec(module=layer.module, params=layer.params, submodules=submodules)


@contextlib.contextmanager
def _buildable_without_te_or_cuda(config: Any) -> Iterator[None]:
    """While an MLA module is built: HAVE_TE false where TE is absent, and YaRN's buffers on the CPU
    where the config asks for CPU initialisation (restored after)."""
    from megatron.core.transformer import multi_latent_attention as mla

    saved = mla.HAVE_TE, mla.YarnRotaryEmbedding
    try:
        if not isinstance(mla.TELinear, type):  # Megatron's placeholder for an absent TE
            mla.HAVE_TE = False
        if config.use_cpu_initialization:
            mla.YarnRotaryEmbedding = functools.partial(saved[1], use_cpu_initialization=True)
        yield
    finally:
        mla.HAVE_TE, mla.YarnRotaryEmbedding = saved


@functools.cache
def megatron_classes() -> tuple[type, type, type]:
    """(core attention, self-attention, config) classes of MLA on the local spec, built on first use
    (the package imports no Megatron until a model is built)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class LatentCoreAttention(sdpa_attention()):
        """The local core attention (models/local_attention.py) taking MLA's key and value widths: its
        output is v_channels a head."""

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    class LatentSelfAttention(MLASelfAttention):
        """MLASelfAttention built without Transformer Engine or CUDA where there is none."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any):
            with _buildable_without_te_or_cuda(config):
                super().__init__(config, *args, **kwargs)

    class LatentConfig(MLATransformerConfig):
        """MLATransformerConfig with RoPE unfused: 0.16.1 fuses MLA's RoPE for YaRN only (refusing
        plain RoPE, Moonlight's) and calls that fusion experimental."""

        def __post_init__(self) -> None:
            self.apply_rope_fusion = False
            super().__post_init__()

    return LatentCoreAttention, LatentSelfAttention, LatentConfig
