"""HF <-> Megatron dist checkpoint conversion, and a logits check between the two.

Each conversion validates its input completely (config, shards, shapes, layout) before
building anything, runs as a world of one process, and writes its output through a
temporary directory renamed into place when complete. A Megatron checkpoint keeps its
model's HF config beside it (hf_config.json) with the tokenizer files of the HF directory it came
from (the converted one, or the run's model.hf_path), so mcore-to-hf needs no template; a template
(an override) gives the config and tokenizer files instead, its config checked against the tensors
and against the model the checkpoint records (its hf_config.json, its run.json): top-k and the
vocabulary inside its padding show in no tensor. Nothing in a model directory or a checkpoint is run:
a config asking transformers to import code from its directory (auto_map) is refused on the way in and
left out of an export. A checkpoint converts back to the layout it came in (its family's DiskLayout:
Qwen3.5's multimodal one keeps the text model under model.language_model.), with the tensors its family
keeps untrained (a vision tower, multi-token-prediction layers), which hf-to-mcore carries in the
Megatron checkpoint (hf_kept.safetensors, streamed) and mcore-to-hf writes back bitwise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bapo_megatron.common.hf_io import (
    MAX_SHARD_BYTES,
    TOKENIZER_FILES,
    HFCheckpoint,
    finish_hf_checkpoint,
    hf_writer,
)
from bapo_megatron.common.hf_model import load_causal_lm
from bapo_megatron.common.progress import byte_progress
from bapo_megatron.common.safetensors_stream import StreamingWriter, plan_files
from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import inside
from bapo_megatron.fsutil import atomic_directory
from bapo_megatron.models.spec import ModelSpec, check_layout
from bapo_megatron.trainer.checkpoint import model_files, weights_dir
from bapo_megatron.trainer.megatron_config import EXTRA_STATE
from bapo_megatron.weights import sglang_shards
from bapo_megatron.weights.layout import megatron_recipes, recipe_region
from bapo_megatron.weights.lora_merge import MergedModel, merged_onto_base
from bapo_megatron.weights.mcore_io import McoreCheckpoint, streaming_save_strategy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TEMPLATE_HELP = (
    "an override: a HF model directory whose config.json and tokenizer files replace those the checkpoint "
    "carries (needed only for a checkpoint written before checkpoints carried them)"
)
"""--hf-template of mcore-to-hf and reshard."""


def config_dtype(config: dict) -> str:
    """The dtype a HF config.json declares (transformers 5: `dtype`, before: `torch_dtype`), as one of
    DTYPES; float32 when it declares none: the default export is then lossless."""
    declared = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    if declared not in DTYPES:
        raise ValueError(f"config.json declares dtype {declared!r}; pass --dtype (one of {sorted(DTYPES)})")
    return declared


def _megatron_world_of_one() -> None:
    import torch.distributed as dist

    from bapo_megatron.trainer.parallel import init_distributed, init_model_parallel, single_process_env

    single_process_env()
    init_distributed()
    if not torch.cuda.is_available():
        from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

        activate_cpu_shim()
    if dist.get_world_size() != 1:
        raise RuntimeError("the converter runs as one process; start it without torchrun")
    init_model_parallel(ParallelConfig(), seed=0)


def _model(spec: ModelSpec, lora: LoRAConfig | None = None):
    """A TP=1 model of `spec` on the CPU (or under a default-device context: meta), GPU or not; its
    padded vocabulary is the one every TP dividing vocab_pad_tp uses; `lora`: with those adapters."""
    from bapo_megatron.trainer import megatron_config as mc

    model = ModelConfig() if lora is None else ModelConfig(lora=lora, transformer_impl="local")
    return mc.build_gpt_model(
        spec, model, ParallelConfig(), pre_process=True, post_process=True, initialize=False, cpu_init=True
    ).eval()  # every weight is loaded right after


def hf_to_mcore(
    hf_dir: str | Path,
    out: str | Path,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "float32",
    progress: bool = True,
    ep: int = 1,
) -> Path:
    """A Megatron dist checkpoint of a HF checkpoint, loadable by the trainer at any PP, at any EP
    dividing the experts and at every TP dividing model.vocab_pad_tp (8); `tp`, `pp` and `ep` are
    checked against the model's shape.

    The checkpoint's keys and shards are those of a model built on the meta device (no memory);
    each tensor is made from the memory-mapped HF shards when the writer reaches it, so one
    tensor at a time is held (fc1's gate and up halves, an expert's too, are the HF tensors
    themselves). Experts are stored over their global index, so the expert-parallel size that
    loads the checkpoint is free.
    """
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.dist_ckpt import model_sharded_state_dict, save_sharded

    hf = HFCheckpoint(hf_dir)
    check_layout(hf.spec, tp, pp, expert=ep)
    if Path(out).exists():
        raise FileExistsError(f"{out} exists already; refusing to overwrite it")
    _megatron_world_of_one()
    spec, torch_dtype = hf.spec, DTYPES[dtype]
    with torch.device("meta"):
        model = _model(spec)
    params = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith(EXTRA_STATE)}
    recipes = megatron_recipes(spec, mc.padded_vocab(spec, ModelConfig(), ParallelConfig()))
    if set(recipes) != set(params):
        raise RuntimeError(f"layout map and model disagree: {sorted(set(recipes) ^ set(params))[:3]}")
    name_of = {id(tensor): name for name, tensor in params.items()}

    def make(sharded) -> torch.Tensor:
        data = sharded.data if sharded.data._base is None else sharded.data._base  # a factory's slice
        start = tuple(sharded.global_offset[sharded.prepend_axis_num :])
        whole = tuple(sharded.global_shape[sharded.prepend_axis_num :])  # a part's, where Megatron splits into parts
        return recipe_region(recipes[name_of[id(data)]], hf, start, tuple(sharded.local_shape), whole, sharded.key)

    size = sum(p.numel() for p in params.values()) * torch_dtype.itemsize
    with byte_progress(size, "hf-to-mcore", progress) as bar:
        save_sharded(
            model_sharded_state_dict([model]),
            out,
            streaming_save_strategy(make, torch_dtype, bar.update, spec=spec),
            extra_files=model_files(spec, str(hf_dir)),  # its config.json and tokenizer, as a run's carry them
        )
    return Path(out)


def mcore_to_hf(
    mcore_dir: str | Path,
    out: str | Path,
    hf_template: str | Path | None = None,
    dtype: str | None = None,
    sglang_tp: int | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = True,
    base: str | Path | None = None,
    dequantized: bool = False,
) -> Path:
    """mcore_dir (a converted checkpoint, a run's step directory, or a run's checkpoint.dir: the step
    a resume would load) as safetensors shards (<= max_shard_bytes), index, config.json and the
    tokenizer files (the template's, else those the checkpoint carries); with sglang_tp, per-rank
    files for SGLang's sharded_state loader instead (dense models). A LoRA run's checkpoint of the
    adapters alone is merged onto its base (weights/lora_merge.py): the one its lora_base.json
    records, or `base`, checked to have the recorded base's weights.

    Streams: one decoder layer (a MoE layer's dense part, then each expert) is read from the
    checkpoint, renamed, written to its place in the output files and dropped before the next is
    read. Experts are written one tensor each (`mlp.experts.E.gate_proj.weight`, ...), the names
    of HF checkpoints on disk, which transformers and SGLang load.
    """
    template = Path(hf_template) if hf_template else None
    if template is not None and not template.is_dir():
        raise ValueError(f"--hf-template {template}: no such directory")
    if Path(out).exists():
        raise FileExistsError(f"{out} exists already; refusing to overwrite it")
    # a quantized release's model is written quantized as it came, or `dequantized` (models/quantized.py)
    source = McoreCheckpoint(weights_dir(mcore_dir), template, dequantized)  # memory-mapped; no process group
    tensors = _with_base(source, base)
    tokenizer = template if template is not None else _carried_tokenizer(source.dir)
    dtype = dtype or config_dtype(source.config)
    layout, split = _output_layout(tensors, DTYPES[dtype], sglang_tp, max_shard_bytes)
    from bapo_megatron.trainer.dist_ckpt import SPACE_MARGIN, check_free_space

    with atomic_directory(out) as tmp:
        writers = layout(tmp)
        check_free_space(Path(out), int(sum(w.total_bytes for w in writers) * SPACE_MARGIN), "the HF model")
        with byte_progress(sum(w.total_bytes for w in writers), "mcore-to-hf", progress) as bar:
            for w in writers:
                w.progress = bar
            for group in tensors.hf_groups(on_disk=sglang_tp is None):
                for writer, tensors in zip(writers, split(group), strict=True):
                    for name, tensor in tensors.items():
                        writer.write(name, tensor)
        for w in writers:
            w.close()
        finish_hf_checkpoint(
            tmp, {**source.config, "torch_dtype": dtype}, tokenizer, writers[0] if sglang_tp is None else None
        )
    return Path(out)


def _with_base(source: McoreCheckpoint, base: str | Path | None) -> McoreCheckpoint | MergedModel:
    """What the export reads: `source`, or for a LoRA checkpoint of the adapters alone, them merged
    onto their base (`base`, else lora_base.json's), checked to be the base they were trained on."""
    if source.holds_base:
        _no_base_given(source.dir, base)
        return source
    return merged_onto_base(source, lambda: _meta_model(source.spec, source.lora), base)


def _no_base_given(directory: Path, base: str | Path | None) -> None:
    if base is not None:  # (never silently ignored: the user meant another base)
        raise ValueError(f"--base {base}: {directory} holds its model's base itself (give no --base)")


def _meta_model(spec: ModelSpec, lora: LoRAConfig | None):
    """The TP=1 model of `spec` built on the meta device (no memory): its keys, shards and shapes."""
    _megatron_world_of_one()
    with torch.device("meta"):
        return _model(spec, lora)


def _output_layout(
    source: McoreCheckpoint | MergedModel, torch_dtype: torch.dtype, sglang_tp: int | None, max_shard_bytes: int
):
    """(the writers of the output files in a directory, a group of HF tensors -> each writer's part):
    HF shards in the layout the model came in (its kept tensors too), or with sglang_tp each SGLang
    rank's files (the text model's tensors only)."""
    spec = source.spec
    if sglang_tp is None:

        def layout(tmp: Path) -> list[StreamingWriter]:
            return [hf_writer(tmp, source.hf_entries(torch_dtype), max_shard_bytes)]

        def split(group: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
            return [group]

        return layout, split
    sglang_shards.check_sglang_tp(spec, sglang_tp)
    entries = sglang_shards.rank_entries(spec, sglang_tp, torch_dtype)

    def sglang_layout(tmp: Path) -> list[StreamingWriter]:
        return [
            StreamingWriter(
                tmp,
                plan_files(entries, max_shard_bytes, lambda i, n, r=r: sglang_shards.PATTERN.format(rank=r, part=i)),
            )
            for r in range(sglang_tp)
        ]

    def sglang_split(group: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return [sglang_shards.rank_tensors(spec, group, sglang_tp, r) for r in range(sglang_tp)]

    return sglang_layout, sglang_split


def _carried_tokenizer(directory: Path) -> Path:
    """A checkpoint directory as the source of the tokenizer files it carries (checksummed with it,
    verified by McoreCheckpoint); one that is a link out of it is refused before anything is copied."""
    for name in TOKENIZER_FILES:
        if (directory / name).exists() or (directory / name).is_symlink():
            inside(directory, name, directory)
    return directory


def verify_conversion(
    hf_dir: str | Path,
    mcore_dir: str | Path,
    seed: int = 0,
    batch: int = 2,
    seq: int = 32,
    base: str | Path | None = None,
) -> dict[str, float]:
    """Logits of the HF model (transformers, on the CPU) and the Megatron checkpoint (on the GPU
    where there is one, in float32 without TF32) on random token ids; a LoRA checkpoint of the
    adapters alone on its base (lora_base.json's, or `base`, checked as mcore_to_hf checks it)."""

    hf = HFCheckpoint(hf_dir)
    _megatron_world_of_one()
    from bapo_megatron.trainer.dist_ckpt import saved_lora

    directory = weights_dir(mcore_dir)  # a step, a run's checkpoint.dir or its run directory
    model = _model(hf.spec, saved_lora(directory))  # a LoRA run's: the trainer's model, adapters on
    _load_weights(model, directory, base)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    reference = load_causal_lm(hf_dir, torch.float32)  # a quantized release as the trainer reads it
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(hf.spec.vocab_size, (batch, seq), generator=g)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            ours = model.float().to(device)(ids.to(device), positions.to(device), attention_mask=None)
            ours = ours[..., : hf.spec.vocab_size].float().cpu()
            theirs = reference(ids).logits.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    diff = (ours - theirs).abs().max().item()
    return {"max_abs": diff, "max_rel": diff / max(theirs.abs().max().item(), 1e-12)}


def _load_weights(model, directory: Path, base: str | Path | None) -> None:
    """`directory`'s weights into `model` (TP 1); a LoRA checkpoint of the adapters alone onto its base."""
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.dist_ckpt import holds_base, load_model, model_sharded_state_dict
    from bapo_megatron.weights.hf_load import load_hf_weights

    if holds_base(model_sharded_state_dict([model]), directory):
        _no_base_given(directory, base)
        load_model([model], directory)
        return
    merged = _with_base(McoreCheckpoint(directory), base)
    if merged.base.hf is not None:
        vocab = mc.padded_vocab(merged.spec, ModelConfig(), ParallelConfig())
        load_hf_weights([model], merged.spec, merged.base.hf, vocab)
    else:
        load_model([model], merged.base.mcore.dir)
    load_model([model], directory, onto_base=True)
