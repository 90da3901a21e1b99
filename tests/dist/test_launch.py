"""The dist tier's workers run on CPU over gloo even where the machine has GPUs (CUDA hidden
from them), and the caller's environment is left as it was."""

import json
import os
from pathlib import Path

import pytest

from tests.dist.launch import run_workers


def _report(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    Path(out, f"{rank}.json").write_text(
        json.dumps(
            {
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "backend": dist.get_backend(),
                "cuda": torch.cuda.is_available(),
                "world": dist.get_world_size(),
            }
        )
    )


@pytest.mark.dist
def test_workers_see_no_gpu_and_join_over_gloo(tmp_path):
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    run_workers(_report, 2, str(tmp_path))
    for rank in range(2):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        assert report == {"visible": "", "backend": "gloo", "cuda": False, "world": 2}
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before
    with pytest.raises(ValueError, match="device"):
        run_workers(_report, 1, str(tmp_path), device="tpu")
