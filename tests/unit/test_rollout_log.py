"""rollouts.jsonl (logger.RolloutLog, logging.samples): the first samples of a step's batch as text
with their reward, lengths and versions; the model's and the data's text written as escaped JSON;
a resumed run's file cut back to its checkpoint, a line cut by a kill dropped."""

import json
import math

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.logger import RolloutLog, truncate_after
from bapo_megatron.rollout.buffer import GroupState, SampleState

HOSTILE = 'a "quote"\n{"step": 99}\u2028\x00\\'  # a newline and a JSON line inside, a line separator, NUL


def sample(uid: str, response: list[int], reward: float, versions: list[int]) -> SampleState:
    return SampleState(uid, [1, 2], response, [-0.5] * len(response), versions, "stop", reward)


def groups() -> list[GroupState]:
    """Three prompt groups of two samples, as the buffer hands them to a step."""
    out = []
    for g, answer in enumerate(["7", HOSTILE, "9"]):
        uid = f"p{g}"
        samples = [sample(f"{uid}/0", [5, 6, 7], 1.0, [3, 3, 4]), sample(f"{uid}/1", [8], 0.0, [1])]
        out.append(GroupState(uid, [1, 2], {"answer": answer, "data_source": "gsm8k", "index": g}, samples))
    return out


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_step_writes_its_first_samples_as_text_with_reward_lengths_and_versions(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    batch = groups()
    batch[0].samples[1].reward, batch[0].samples[1].reward_error = math.nan, "TimeoutError: 5 s"
    batch[0].samples[1].regenerated = 2
    log = RolloutLog(path, 3, lambda ids: HOSTILE if 8 in ids else " ".join(f"t{i}" for i in ids))
    log.write(4, batch, oldest_allowed=2)
    first, second, third = lines(path)
    assert (first["step"], first["group"], first["sample"]) == (4, "p0", 0)
    assert [(r["group"], r["sample"]) for r in (second, third)] == [("p0", 1), ("p1", 0)]  # whole groups first
    assert first["prompt"] == "t1 t2" and first["response"] == "t5 t6 t7" and first["answer"] == "7"
    assert first["data_source"] == "gsm8k" and first["reward"] == 1.0 and "reward_error" not in first
    assert (first["prompt_tokens"], first["response_tokens"], first["finish"]) == (2, 3, "stop")
    assert (first["version_min"], first["version_max"], first["stale_tokens"]) == (3, 4, 0)
    assert second["response"] == HOSTILE and third["answer"] == HOSTILE  # untrusted text round-trips
    assert second["reward"] is None and second["reward_error"] == "TimeoutError: 5 s"
    assert second["stale_tokens"] == 1 and second["regenerated"] == 2
    assert path.read_bytes().isascii() and path.read_text().count("\n") == 3
    assert "prompt_ids" not in first


def test_without_a_tokenizer_the_token_ids_are_written_and_zero_writes_nothing(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    RolloutLog(path, 100, None).write(1, groups(), oldest_allowed=0)
    got = lines(path)
    assert len(got) == 6 and [r["step"] for r in got] == [1] * 6  # fewer samples than asked: all of them
    assert got[0]["prompt_ids"] == [1, 2] and got[0]["response_ids"] == [5, 6, 7] and "prompt" not in got[0]
    RolloutLog(tmp_path / "off.jsonl", 0, None).write(1, groups(), oldest_allowed=0)
    assert not (tmp_path / "off.jsonl").exists()


def test_a_resumed_run_keeps_its_checkpoints_steps_and_drops_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    log = RolloutLog(path, 2, str)
    for step in (1, 2, 3):
        log.write(step, groups(), oldest_allowed=0)
    with path.open("a") as f:
        f.write('{"step": 4, "group": "p0", "prom')  # the kill landed inside step 4's write
    truncate_after(path, 2)  # resumed from the checkpoint of step 2 (sources.OnlineSource.start)
    assert [r["step"] for r in lines(path)] == [1, 1, 2, 2]
    log.write(3, groups(), oldest_allowed=0)  # step 3 again, after the resume
    assert [r["step"] for r in lines(path)] == [1, 1, 2, 2, 3, 3]
    truncate_after(path, None)  # a new run in the same directory starts an empty file
    assert path.read_text() == ""


def test_logging_samples_is_checked():
    assert load_config(None, []).logging.samples == 16
    assert load_config(None, ["logging.samples=0"]).logging.samples == 0
    with pytest.raises(ConfigError, match=r"logging.samples=-1: must be >= 0"):
        load_config(None, ["logging.samples=-1"])


def test_a_steps_records_are_its_groups_samples_and_saved_batch_cut_back_on_resume(tmp_path):
    """logger.StepRecords: samples.jsonl names the step's groups, rollouts.jsonl holds its first
    samples, batches/ its batch with logging.save_batches; a resume keeps both logs to its step."""
    from bapo_megatron.common.batch import RolloutBatch
    from bapo_megatron.logger import StepRecords

    cfg = load_config(None, ["logging.samples=1", "logging.save_batches=true"]).logging
    records = StepRecords(tmp_path, cfg, None)
    batch = RolloutBatch.from_groups(groups(), temperature=1.0)
    for step in (1, 2):
        records.write(step, groups(), batch, oldest_allowed=0)
    assert lines(tmp_path / "samples.jsonl") == [{"step": s, "groups": ["p0", "p1", "p2"]} for s in (1, 2)]
    assert [(r["step"], r["group"], r["sample"]) for r in lines(tmp_path / "rollouts.jsonl")] == [
        (1, "p0", 0),
        (2, "p0", 0),
    ]
    saved = RolloutBatch.load(tmp_path / "batches" / "step_00000002.safetensors")
    assert [s.response_ids for s in saved.samples] == [s.response_ids for s in batch.samples]
    records.truncate_after(1)
    assert [r["step"] for r in lines(tmp_path / "samples.jsonl") + lines(tmp_path / "rollouts.jsonl")] == [1, 1]
    unsaved = StepRecords(tmp_path / "other", load_config(None, []).logging, None)
    (tmp_path / "other").mkdir()
    unsaved.write(1, groups(), batch, oldest_allowed=0)
    assert not (tmp_path / "other" / "batches").exists()
