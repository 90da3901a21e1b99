"""The wandb backend without an API key: offline, its run directory under the run's, no network."""

import json
import os

import pytest

from bapo_megatron.config import LoggingConfig
from bapo_megatron.logger import MetricLogger


def test_wandb_runs_offline_without_a_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # any attempt to reach the network fails
    cfg = LoggingConfig(backends=("jsonl", "wandb"), wandb_project="bapo-test", wandb_run_name="offline")
    logger = MetricLogger(cfg, job_name="j", config={"algo": {"loss": "bapo"}}, run_dir=tmp_path)
    for step in (1, 2):
        logger.log(step, {"loss/pg": 0.5 / step, "bapo/rho": 0.4})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb")), os.listdir(tmp_path / "wandb")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
