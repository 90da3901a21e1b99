"""Prompt data: jsonl and parquet with a field map, clear errors, and a cursor that resumes exactly."""

import json

import pytest

from bapo_megatron.config import DataConfig
from bapo_megatron.rollout.data import PromptSource


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_text_and_ids_with_field_map(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"q": "a b", "sol": "1"}, {"q": [5, 6], "sol": "2"}])
    source = PromptSource(
        DataConfig(path=str(path), prompt_field="q", answer_field="sol", shuffle=False),
        tokenize=lambda text: [len(w) for w in text.split()],
    )
    assert source.next() == ("e0-0", [1, 1], {"sol": "1", "answer": "1", "index": 0})
    assert source.next()[1:] == ([5, 6], {"sol": "2", "answer": "2", "index": 1})
    assert source.next()[0] == "e1-0"  # the next epoch


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [[1, 2], [3]], "answer": ["x", "y"]}), tmp_path / "d.parquet")
    source = PromptSource(DataConfig(path=str(tmp_path / "d.parquet"), format="parquet", shuffle=False))
    assert [source.next()[1] for _ in range(2)] == [[1, 2], [3]]


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        PromptSource(DataConfig(path=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1]}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        PromptSource(DataConfig(path=str(bad)))
    with pytest.raises(ValueError, match="record 1: no field 'question'"):
        PromptSource(DataConfig(path=str(_jsonl(tmp_path / "f.jsonl", [{"prompt": [1]}])), prompt_field="question"))
    with pytest.raises(ValueError, match="no tokenizer"):
        PromptSource(DataConfig(path=str(_jsonl(tmp_path / "t.jsonl", [{"prompt": "text"}]))))
    with pytest.raises(ValueError, match="empty prompt"):
        PromptSource(DataConfig(path=str(_jsonl(tmp_path / "e.jsonl", [{"prompt": []}]))))


def test_cursor_resumes_exactly(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": [i + 1]} for i in range(7)])
    config = DataConfig(path=str(path), shuffle=True, seed=3)
    straight = PromptSource(config)
    expected = [straight.next() for _ in range(17)]
    first = PromptSource(config)
    got = [first.next() for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSource(config)
    resumed.load_state_dict(state)
    got += [resumed.next() for _ in range(8)]
    assert got == expected
    assert sorted(x[1][0] for x in expected[:7]) == list(range(1, 8))  # an epoch is a permutation
    shorter = PromptSource(DataConfig(path=str(_jsonl(tmp_path / "s.jsonl", [{"prompt": [1]}]))))
    with pytest.raises(ValueError, match="not the same data"):
        shorter.load_state_dict(state)
