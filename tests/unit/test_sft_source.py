"""algo.loss=sft's batches: each record's answer plus the end token as the response, and bad
records refused up front, naming the file, the record and the field."""

import json

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.sources import SFTSource
from bapo_megatron.tasks import SPECIAL, write_task


def _source(tmp_path, records, *extra):
    paths = write_task("addition", tmp_path / "task", train=10, heldout=10)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(
        None,
        [
            "algo.loss=sft",
            f"model.hf_path={paths['model']}",
            f"data.path={data}",
            "rollout.prompts_per_step=1",
            "rollout.samples_per_prompt=2",
            *extra,
        ],
    )
    return SFTSource(cfg, ModelSpec.from_hf_dir(paths["model"]))


def test_batches_hold_the_answers(tmp_path):
    source = _source(tmp_path, [{"prompt": "001+002=", "answer": "0003"}, {"prompt": "010+020=", "answer": "0030"}])
    batch, _ = source.next_batch(0)
    eos = SPECIAL.index("<eos>")
    assert len(batch.samples) == 2 and {s.group for s in batch.samples} == {0}
    for sample in batch.samples:
        assert sample.response_ids[-1] == eos and len(sample.response_ids) == 5
    state = source.state_dict()
    again = _source(tmp_path, [{"prompt": "001+002=", "answer": "0003"}, {"prompt": "010+020=", "answer": "0030"}])
    again.load_state_dict(state)
    assert again.prompts.position == source.prompts.position


def test_bad_records_are_refused(tmp_path):
    with pytest.raises(BadInputError, match=r"sft.jsonl record 2: no field 'answer' \(data.answer_field\)"):
        _source(tmp_path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    with pytest.raises(BadInputError, match=r"record 1: prompt and answer take 69 tokens, more than the model's 64"):
        _source(tmp_path, [{"prompt": "1" * 60, "answer": "12345678"}])
    with pytest.raises(ConfigError, match="eval.samples"):
        load_config(None, ["eval.samples=0", "eval.greedy=false"])
