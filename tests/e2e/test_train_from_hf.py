"""`python -m bapo_megatron.train` starts from model.hf_path's weights.

The replayed batch's behaviour log-probs are transformers' own for the HF model, so the trainer's
first-update log-prob mismatch (rollout_corr/train_rollout_logprob_abs_diff) is ~0 exactly when
it trains from those weights; from a directory with the config but no weights it warns and starts from random ones
(the mismatch is then large).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bapo_megatron.common.batch import RolloutBatch, Sample
from tests.helpers import make_hf_model

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _batch(model, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(4):
        prompt = torch.randint(250, (4,), generator=g).tolist()
        for _ in range(4):
            response = torch.randint(250, (6,), generator=g).tolist()
            with torch.no_grad():
                logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(response)[:, None])[:, 0]
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=response,
                    behaviour_logprobs=logp.tolist(),
                    versions=[0] * 6,
                    reward=float(torch.rand(1, generator=g)),
                    group=group,
                )
            )
    return RolloutBatch(samples=samples)


def _first_mismatch(tmp_path: Path, hf: Path, run: str) -> tuple[float, str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bapo_megatron.train",
            f"model.hf_path={hf}",
            f"rollout.replay={tmp_path / 'batch.safetensors'}",
            "steps=1",
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "logging.backends=[jsonl]",
            f"logging.jsonl_path={tmp_path / (run + '.jsonl')}",
            f"run_dir={tmp_path / run}",  # its own checkpoints: runs/bapo/ckpt would be every such run's
            "parallel.max_tokens_per_microbatch=64",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((tmp_path / (run + ".jsonl")).read_text().splitlines()[0])
    return first["rollout_corr/train_rollout_logprob_abs_diff"], proc.stderr


def test_training_starts_from_the_hf_weights(tmp_path):
    model = make_hf_model(tmp_path, "qwen2-gqa2")
    _batch(model).save(tmp_path / "batch.safetensors")
    mismatch, _ = _first_mismatch(tmp_path, tmp_path / "qwen2-gqa2", "hf")
    assert mismatch <= 1e-5
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(tmp_path / "qwen2-gqa2" / "config.json", bare / "config.json")
    mismatch, stderr = _first_mismatch(tmp_path, bare, "bare")
    assert "RANDOM weights" in stderr and mismatch > 0.1
