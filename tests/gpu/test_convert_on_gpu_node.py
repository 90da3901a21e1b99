"""The converters on a GPU node: hf-to-mcore puts nothing on the GPU (its model is on the meta
device, its tensors come from the memory-mapped shards), verify runs the Megatron model on
the GPU against transformers on the CPU, and the round trip is still bitwise."""

import sys
from pathlib import Path

import torch

from tests.dist.launch import run_workers
from tests.helpers import make_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
NAME = "qwen2-gqa2"


def _convert(rank: int, world: int, root: str, model_bytes: int) -> None:
    import convert_checkpoint as cli

    root = Path(root)
    torch.cuda.reset_peak_memory_stats()
    assert cli.main(["hf-to-mcore", "--hf", str(root / NAME), "--out", str(root / "mcore"), "--no-progress"]) == 0
    # NCCL collectives of the save (barriers, gathered metadata) take a few small buffers; the model would not fit
    peak = torch.cuda.max_memory_allocated()
    assert peak < model_bytes // 2, f"hf-to-mcore allocated {peak} bytes on the GPU (the model has {model_bytes})"
    assert cli.main(["verify", "--hf", str(root / NAME), "--mcore", str(root / "mcore")]) == 0
    assert (
        cli.main(
            [
                "mcore-to-hf",
                "--mcore",
                str(root / "mcore"),
                "--out",
                str(root / "back"),
                "--hf-template",
                str(root / NAME),
                "--dtype",
                "float32",
                "--no-progress",
            ]
        )
        == 0
    )


def test_converters_on_a_gpu_node(tmp_path):
    from safetensors.torch import load_file

    original = make_hf_model(tmp_path, NAME)
    model_bytes = sum(t.numel() * t.element_size() for t in original.state_dict().values())
    run_workers(_convert, 1, str(tmp_path), model_bytes, device="cuda")
    back = {}
    for file in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(str(file)))
    for key, tensor in original.state_dict().items():
        assert torch.equal(back[key], tensor), key
