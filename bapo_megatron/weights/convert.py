"""HF <-> Megatron dist checkpoint conversion, and a logits check between the two.

Each conversion validates its input completely (config, shards, shapes, layout) before
building anything, runs as a world of one process, and writes its output through a
temporary directory renamed into place when complete. The Megatron checkpoint keeps the
HF config beside it (hf_config.json), so mcore-to-hf needs no template for the config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.trainer.model_spec import ModelSpec, check_layout
from bapo_megatron.weights.hf_io import HFCheckpoint, atomic_directory, write_hf_checkpoint
from bapo_megatron.weights.layout import hf_to_megatron, megatron_to_hf

HF_CONFIG = "hf_config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _model(spec: ModelSpec):
    """A TP=1 model of `spec`; its padded vocabulary is the one every TP dividing vocab_pad_tp uses."""
    from bapo_megatron.trainer import megatron_config as mc

    return mc.build_gpt_model(spec, ModelConfig(), ParallelConfig(), pre_process=True, post_process=True,
                              initialize=False).eval()  # every weight is loaded right after


def hf_to_mcore(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, dtype: str = "float32") -> Path:
    """A Megatron dist checkpoint of a HF checkpoint, loadable by the trainer at any PP and at every
    TP dividing model.vocab_pad_tp (8); `tp` and `pp` are checked against the model's shape."""
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.checkpoint import save_model

    hf = HFCheckpoint(hf_dir)
    check_layout(hf.spec, tp, pp)
    if Path(out).exists():
        raise FileExistsError(f"{out} exists already; refusing to overwrite it")
    _megatron_world_of_one()
    model = _model(hf.spec)
    padded = mc.padded_vocab(hf.spec, ModelConfig(), ParallelConfig())
    state = {k: v.to(DTYPES[dtype]) for k, v in hf_to_megatron(hf.spec, hf, padded).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("_extra_state") for k in missing):
        raise RuntimeError(f"layout map and model disagree: missing {missing}, unexpected {unexpected}")
    out = Path(out)
    save_model([model], out)
    (out / HF_CONFIG).write_text(json.dumps(hf.config, indent=2))
    return out


def load_mcore_state(mcore_dir: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The full (TP=1) Megatron state dict of a dist checkpoint (converted or saved by the trainer)."""
    from bapo_megatron.trainer.checkpoint import load_model

    model = _model(spec)
    load_model([model], mcore_dir)
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _mcore_spec(mcore_dir: Path, template: Path | None) -> tuple[ModelSpec, dict]:
    source = mcore_dir / HF_CONFIG if (mcore_dir / HF_CONFIG).is_file() else None
    if source is None and template is not None:
        source = template / "config.json"
    if source is None or not source.is_file():
        raise ValueError(f"{mcore_dir}: no {HF_CONFIG}; pass --hf-template DIR with the model's config.json")
    config = json.loads(source.read_text())
    return ModelSpec.from_hf_config(config), config


def mcore_to_hf(mcore_dir: str | Path, out: str | Path, hf_template: str | Path | None = None,
                dtype: str = "bfloat16") -> Path:
    """safetensors shards (<= 5 GB), index, config.json and the template's tokenizer files."""
    mcore_dir = Path(mcore_dir)
    template = Path(hf_template) if hf_template else None
    if not (mcore_dir / "metadata.json").is_file():
        raise ValueError(f"{mcore_dir}: not a complete Megatron dist checkpoint (no metadata.json)")
    spec, config = _mcore_spec(mcore_dir, template)
    if Path(out).exists():
        raise FileExistsError(f"{out} exists already; refusing to overwrite it")
    _megatron_world_of_one()
    state = load_mcore_state(mcore_dir, spec)
    tensors = {k: v.to(DTYPES[dtype]) for k, v in megatron_to_hf(spec, state).items()}
    config = {**config, "torch_dtype": dtype}
    with atomic_directory(out) as tmp:
        write_hf_checkpoint(tensors, tmp, config, template)
    return Path(out)


def verify(hf_dir: str | Path, mcore_dir: str | Path, seed: int = 0, batch: int = 2,
           seq: int = 32) -> dict[str, float]:
    """Logits of the HF model (transformers) and the Megatron checkpoint on random token ids."""
    import transformers

    hf = HFCheckpoint(hf_dir)
    _megatron_world_of_one()
    model = _model(hf.spec)
    from bapo_megatron.trainer.checkpoint import load_model

    load_model([model], mcore_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(hf.spec.vocab_size, (batch, seq), generator=g)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    with torch.no_grad():
        ours = model.float()(ids, positions, attention_mask=None)[..., : hf.spec.vocab_size].float()
        theirs = reference(ids).logits.float()
    diff = (ours - theirs).abs().max().item()
    return {"max_abs": diff, "max_rel": diff / max(theirs.abs().max().item(), 1e-12)}
