"""Live streaming export from a TP=2 x PP=2 model reassembles exactly into the HF state dict."""

import json
from pathlib import Path

import torch

from tests.dist.launch import run_workers
from tests.helpers import make_hf_model

BUCKET_BYTES = 40_000


def _convert(rank: int, world: int, root: str, names: tuple[str, ...]) -> None:
    from bapo_megatron.weights.convert import hf_to_mcore

    for name in names:
        hf_to_mcore(Path(root) / name, Path(root) / f"{name}-mcore")


def _export(rank: int, world: int, root: str, names: tuple[str, ...]) -> None:
    for name in names:  # one launch for both models: the same layout, the same groups
        _export_one(rank, root, name)


def _export_one(rank: int, root: str, name: str) -> None:
    from safetensors.torch import save_file

    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.export import stream_hf_buckets

    activate_cpu_shim()
    root = Path(root)
    spec = ModelSpec.from_hf_dir(root / name)
    cfg = load_config(None, ["parallel.tensor=2", "parallel.pipeline=2"])
    trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    trainer.load_weights(root / f"{name}-mcore")
    # A model built to be loaded (no random init) carries the same tensor-parallel marks the gathers read.
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.dist_ckpt import unwrap

    live = unwrap(trainer.model[0])
    bare = mc.build_gpt_model(
        spec, cfg.model, cfg.parallel, pre_process=live.pre_process, post_process=live.post_process, initialize=False
    )

    def marks(model):
        return {
            n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1))
            for n, p in model.named_parameters()
        }

    assert marks(bare) == marks(live) and any(m[0] for m in marks(bare).values())
    names, sizes, tensors = [], [], {}
    for bucket in stream_hf_buckets(trainer.model, spec, trainer.info, bucket_bytes=BUCKET_BYTES):
        sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        for key, tensor in bucket:
            assert key not in tensors, f"{key} sent twice"
            names.append(key)
            tensors[key] = tensor.clone()
    save_file(tensors, str(root / f"{name}-export-{rank}.safetensors"))
    (root / f"{name}-export-{rank}.json").write_text(
        json.dumps({"names": names, "sizes": sizes, "pp": trainer.info.pp_rank})
    )


def test_stream_reassembles_the_hf_state_dict(tmp_path):
    from safetensors.torch import load_file

    # TP=2 needs an even number of key/value heads: both models have 2.
    cases = {"qwen2-gqa2": ("qwen2", 2, False), "llama-gqa2-tied": ("llama", 2, True)}
    originals = {name: make_hf_model(tmp_path, name, case).state_dict() for name, case in cases.items()}
    run_workers(_convert, 1, str(tmp_path), tuple(cases))
    run_workers(_export, 4, str(tmp_path), tuple(cases))
    for name, original in originals.items():
        if "tied" in name:
            original.pop("lm_head.weight")
        per_rank = [
            (
                json.loads((tmp_path / f"{name}-export-{r}.json").read_text()),
                load_file(str(tmp_path / f"{name}-export-{r}.safetensors")),
            )
            for r in range(4)
        ]
        stages: dict[int, dict] = {}
        for meta, tensors in per_rank:
            if meta["pp"] in stages:  # the other TP rank of the stage sends the same tensors
                assert stages[meta["pp"]].keys() == tensors.keys()
                assert all(torch.equal(stages[meta["pp"]][k], t) for k, t in tensors.items())
            stages.setdefault(meta["pp"], tensors)
            largest = max(t.numel() * t.element_size() for t in tensors.values())
            assert all(size <= max(BUCKET_BYTES, largest) for size in meta["sizes"]) and len(meta["sizes"]) > 1
        assert not stages[0].keys() & stages[1].keys()  # each tensor exactly once
        merged = {**stages[0], **stages[1]}
        assert merged.keys() == original.keys()
        for key, tensor in original.items():
            assert torch.equal(merged[key], tensor), (name, key)
        first = json.loads((tmp_path / f"{name}-export-0.json").read_text())["names"]
        assert first[0] == "model.embed_tokens.weight" and first[1].startswith("model.layers.0.")
