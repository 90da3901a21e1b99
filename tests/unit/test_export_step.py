"""mcore-to-hf says which training step it exported (a run's checkpoint.dir: the newest complete one)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.weights.mcore_io import EMBEDDING, FINAL_NORM, HF_CONFIG, OUTPUT, layer_shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import convert_checkpoint


def _step(directory: Path) -> Path:
    """A dist checkpoint of tiny_spec with a converted one's keys, written by torch DCP alone."""
    spec = tiny_spec()
    state = {EMBEDDING: torch.randn(256, spec.hidden_size), OUTPUT: torch.randn(256, spec.hidden_size)}
    state[FINAL_NORM] = torch.randn(spec.hidden_size)
    for suffix, shape in layer_shapes(spec).items():
        state[f"decoder.layers.{suffix}"] = torch.randn(spec.num_layers, *shape)
    dcp.save(state, storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True), no_dist=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({}, directory / "common.pt")
    (directory / HF_CONFIG).write_text(json.dumps(spec.to_hf_config()))
    return directory


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP writing without a process group, as meant
def test_mcore_to_hf_names_the_step_it_exported(tmp_path, capsys):
    ckpt = tmp_path / "run" / "ckpt"
    step = _step(ckpt / "step_00000007")
    shutil.copytree(step, ckpt / "step_00000003")  # older
    shutil.copytree(step, tmp_path / "converted")
    for source, said in (
        (ckpt, f"from step 7 ({step})"),
        (ckpt / "step_00000003", "from step 3"),
        (tmp_path / "converted", "(a converted checkpoint: no training step)"),
    ):
        out = tmp_path / f"hf-{source.name}"
        assert convert_checkpoint.main(["mcore-to-hf", "--mcore", str(source), "--out", str(out), "--no-progress"]) == 0
        printed = capsys.readouterr().out
        assert printed.startswith(f"wrote {out} from ") and said in printed, printed
