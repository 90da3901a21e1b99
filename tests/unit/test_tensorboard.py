"""The tensorboard backend, read back with tensorboard's own reader; an unknown backend's one error."""

import pytest

from bapo_megatron.config import LoggingConfig, load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.logger import MetricLogger

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _read(directory):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _steps(cfg, run_dir, resume_step, steps):
    logger = MetricLogger(
        cfg, job_name="j", config={"algo": {"loss": "bapo"}, "steps": 3}, run_dir=run_dir, resume_step=resume_step
    )
    for step, metrics in steps.items():
        logger.log(step, metrics)
    logger.close()


def test_tensorboard_holds_every_metric_at_its_step_and_the_config_once(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = LoggingConfig(backends=("tensorboard",))
    first = {step: {"loss/pg": 0.5 / step, "rollout/reward_mean": 0.25 * step} for step in (1, 2, 3)}
    _steps(cfg, tmp_path, None, first)
    # a resume from step 2's checkpoint: the interrupted run's step 3 gives way to the resumed run's
    _steps(cfg, tmp_path, 2, {3: {"loss/pg": 7.0, "rollout/reward_mean": 8.0}, 4: {"loss/pg": 9.0}})
    events = _read(tmp_path / "tensorboard")
    expected = {
        "loss/pg": [(1, 0.5), (2, 0.25), (3, 7.0), (4, 9.0)],
        "rollout/reward_mean": [(1, 0.25), (2, 0.5), (3, 8.0)],
    }
    for name, points in expected.items():
        read = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in read] == [s for s, _ in points], name
        assert [v for _, v in read] == pytest.approx([v for _, v in points]), name  # stored as float32
    texts = events.Tensors("config/text_summary")
    assert len(texts) == 1 and texts[0].step == 0
    shown = texts[0].tensor_proto.string_val[0].decode()
    assert "loss: bapo" in shown and "steps: 3" in shown


def test_an_unknown_backend_is_one_error_naming_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "examples" / "tiny_verl.yaml", ["logging.backends=[console,tensorbord]"])
    assert "logging.backends[1]='tensorbord'" in str(err.value)
    for known in ("console", "jsonl", "wandb", "tensorboard"):
        assert repr(known) in str(err.value)
