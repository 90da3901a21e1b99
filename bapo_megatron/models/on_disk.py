"""How a family's checkpoints lie on disk: where the text model's tensors and config sit (DiskLayout),
and which tensors beside them are carried, not trained (KeptTensors).

The package speaks one naming, the text model's canonical one (`model.embed_tokens.weight`,
`model.layers.N.*`, `model.norm.weight`, `lm_head.weight`, as models/ answer them); a released
multimodal checkpoint (Qwen3.5's Qwen3_5ForConditionalGeneration) keeps the same tensors under
`model.language_model.` and its text config under `text_config`. Every reader and writer of HF
directories maps names through the family's DiskLayout, in one place (common/hf_io.py, the
converter). Kept tensors (a vision tower, multi-token-prediction layers) are named as on disk: they
are never renamed, only copied bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_megatron.errors import BadInputError

CANONICAL_PREFIX = "model."
"""The prefix of the text model's tensors in the package's naming (all but lm_head.weight)."""
INHERITED_KEYS = ("tie_word_embeddings",)
"""Keys a multimodal config.json states at its top level for the text model too: transformers
(modeling_utils) and SGLang 0.5.23's Qwen3_5ForConditionalGeneration read them there only, so the top
level's value is the model's; a text_config stating another is refused."""


@dataclass(frozen=True)
class DiskLayout:
    """Where a checkpoint holds the text model: its tensors under `text_prefix` (lm_head.weight at the
    top level), its config at the top level (`text_config` None) or nested under that key."""

    text_prefix: str = CANONICAL_PREFIX
    text_config: str | None = None

    def disk_name(self, name: str) -> str:
        """A canonical text tensor's name on disk."""
        if name.startswith(CANONICAL_PREFIX):
            return self.text_prefix + name.removeprefix(CANONICAL_PREFIX)
        return name

    def canonical_name(self, disk: str) -> str | None:
        """The canonical name of an on-disk tensor of the text model; None for one outside it."""
        if disk.startswith(self.text_prefix):
            return CANONICAL_PREFIX + disk.removeprefix(self.text_prefix)
        return None if disk.startswith(CANONICAL_PREFIX) else disk

    def text_part(self, config: dict, source: object = "config.json") -> dict:
        """The text model's config of a config.json mapping read from `source` (the mapping itself in
        the text layout), the top level's INHERITED_KEYS over the nested ones; BadInputError naming
        the key when it is missing or no object, or when the nested config states an inherited key
        the top level does not, or otherwise."""
        if self.text_config is None:
            return config
        nested = config.get(self.text_config)
        if not isinstance(nested, dict):
            raise BadInputError(f"{source}: no {self.text_config} object (the text model's config in this layout)")
        for key in INHERITED_KEYS:
            if key in nested and config.get(key) != nested[key]:
                raise BadInputError(
                    f"{source}: {self.text_config}.{key}={nested[key]!r} but {key}={config.get(key)!r} at the top "
                    f"level, which transformers and SGLang read: state one value in both (or at the top level only)"
                )
        inherited = {key: config[key] for key in INHERITED_KEYS if key in config}
        return {**nested, **inherited}

    def model_type(self, config: dict) -> object:
        """The text model's model_type as a config.json mapping states it in this layout (None where it
        does not): what transformers builds the model by, and a config.json without `architectures` says."""
        text = config.get(self.text_config) if self.text_config is not None else config
        return text.get("model_type") if isinstance(text, dict) else None


TEXT_LAYOUT = DiskLayout()
"""A causal LM's checkpoint: model.* and lm_head.weight, config.json the text model's."""
MULTIMODAL_LAYOUT = DiskLayout(text_prefix="model.language_model.", text_config="text_config")
"""An image-text-to-text checkpoint (Qwen3.5/3.6's released one): the text model under
model.language_model., its config under text_config, the vision tower beside them."""


def nested_layout(config: dict) -> DiskLayout:
    """MULTIMODAL_LAYOUT for a config.json that nests its text model's config (text_config), else
    TEXT_LAYOUT: Family.disk_layout of a family released in both layouts (Qwen3.5)."""
    return MULTIMODAL_LAYOUT if MULTIMODAL_LAYOUT.text_config in config else TEXT_LAYOUT


@dataclass(frozen=True)
class KeptTensors:
    """On-disk tensors a checkpoint holds that the trainer does not train, by name prefix: read and
    checked with the checkpoint, carried through conversion and training, written back untouched."""

    prefixes: tuple[str, ...] = ()

    def __contains__(self, disk_name: object) -> bool:
        return isinstance(disk_name, str) and disk_name.startswith(self.prefixes)

    def __bool__(self) -> bool:
        return bool(self.prefixes)


def extra_layers(
    config: dict,
    count_key: str = "num_nextn_predict_layers",
    prefix: str = "model.layers.",
) -> KeptTensors:
    """The layers a checkpoint holds after its decoder's num_hidden_layers (multi-token-prediction
    layers: DeepSeek-V3's and GLM-4.5's `num_nextn_predict_layers`), kept."""
    first, count = int(config["num_hidden_layers"]), int(config.get(count_key) or 0)
    return KeptTensors(tuple(f"{prefix}{first + i}." for i in range(count)))
