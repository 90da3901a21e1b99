"""Every field path a run's reward reads, checked on the first records of the training data and of
every evaluation set before any engine starts (rollout/inputs.py), and by `--dry-run` alike: a
wrong data.answer_field is one error naming the file, the record, the field path and the record's
fields, not a step of generation whose every reward call fails with KeyError: 'answer'."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.rollout import inputs as inputs_module
from bapo_megatron.rollout.inputs import RolloutInputs
from tests.helpers import verl_parquet, word_tokenizer

VERL_FIELDS = (
    "ability, data_source, extra_info.index, extra_info.split, prompt, reward_model.ground_truth, reward_model.style"
)


@pytest.fixture(autouse=True)
def chat_tokenizer(monkeypatch):
    """The model directory's tokenizer, with a chat template: verl's prompts are chat messages."""
    monkeypatch.setattr(inputs_module, "load_tokenizer", lambda path: word_tokenizer())


def verl_data(tmp_path, fmt: str, answers=("w9", "w8", "w7")):
    """verl's layout (chat-message prompts, reward_model.ground_truth), as parquet or jsonl."""
    path = verl_parquet(tmp_path / "train.parquet", ["w5 w6", "w7", "w8"], list(answers))
    if fmt == "jsonl":
        rows = pq.read_table(path).to_pylist()
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def inputs(tmp_path, *overrides: str) -> RolloutInputs:
    cfg = load_config(None, [f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    return RolloutInputs(cfg, tiny_spec())


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_wrong_answer_field_names_the_record_its_fields_and_verls_path(tmp_path, fmt):
    data = f"data.path={verl_data(tmp_path, fmt)}"
    where = "train.parquet record 1" if fmt == "parquet" else r"train.jsonl record 1 \(line 1\)"
    with pytest.raises(BadInputError) as err:
        inputs(tmp_path, data, "reward.function=dapo")  # data.answer_field's default, "answer"
    assert str(err.value) == (
        f"data.path: {tmp_path}/train.{fmt} record 1{' (line 1)' if fmt == 'jsonl' else ''}: no field 'answer' "
        f"(data.answer_field), which reward 'dapo' scores against; the record has {VERL_FIELDS}; verl's layout: "
        "set data.answer_field=reward_model.ground_truth"
    )
    with pytest.raises(BadInputError, match=rf"{where}: no field 'reward_model.truth' \(data.answer_field; "):
        inputs(tmp_path, data, "data.answer_field=reward_model.truth")  # math, the default reward
    ok = inputs(tmp_path, data, "reward.function=dapo", "data.answer_field=reward_model.ground_truth")
    assert ok.prompts.first(1)[0][1]["answer"] == "w9"


def test_an_answer_a_builtin_cannot_read_is_named_past_the_first_record(tmp_path):
    rows = [{"prompt": [5, 6], "sol": "3"}, {"prompt": [7], "sol": "4"}, {"prompt": [8], "sol": ["5", "6"]}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([*rows[:2], {"prompt": [8], "sol": None}]), path)
    with pytest.raises(BadInputError, match=r"train.parquet record 3: reward 'exact' reads record\['answer'\] as "):
        inputs(tmp_path, f"data.path={path}", "data.answer_field=sol", "reward.function=exact")
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        BadInputError, match=r"record 3 \(line 3\): .* it is list \[\"5\", \"6\"\] \(data.answer_field=sol"
    ):
        inputs(tmp_path, f"data.path={jsonl}", "data.answer_field=sol")
    inputs(tmp_path, f"data.path={jsonl}", "data.answer_field=sol", "data.check_records=2")  # record 3: when drawn


def test_a_wrong_field_in_an_evaluation_set_is_named_by_its_key(tmp_path):
    data = verl_data(tmp_path, "parquet")
    aime = tmp_path / "aime.jsonl"
    aime.write_text(
        json.dumps({"prompt": [3], "reward_model": {"ground_truth": "1"}}) + "\n"
        + json.dumps({"prompt": [4], "reward_model": {"answer": "2"}}) + "\n"
    )  # fmt: skip
    common = [f"data.path={data}", "data.answer_field=reward_model.ground_truth"]
    with pytest.raises(BadInputError) as err:
        inputs(tmp_path, *common, f"eval.sets.aime.path={aime}")
    assert str(err.value) == (
        f"eval.sets.aime.path: {aime} record 2 (line 2): no field 'reward_model.ground_truth' (data.answer_field; "
        "reward_model has no 'ground_truth'), which reward 'math' scores against; the record has prompt, "
        "reward_model.answer; did you mean data.answer_field=reward_model.answer?"
    )
    past = ["eval.sets.aime.max_prompts=1", "data.check_records=1"]  # record 2 is never read nor scored
    assert len(inputs(tmp_path, *common, f"eval.sets.aime.path={aime}", *past).sources) == 2


def test_a_user_reward_that_cannot_load_or_take_the_record(tmp_path):
    """A reward of yours: it must import and take (text, ids, record) (ConfigError naming the
    field), and one call on each set's first record (an empty response, in a worker) must not
    raise KeyError for a field the record lacks; other failures there are the empty response's."""
    rewards = tmp_path / "mine.py"
    rewards.write_text(
        "import os\n"
        "def one_arg(text):\n    return 0.0\n"
        "def answer(text, ids, record):\n    return float(text == record['answer'])\n"
        "def solution(text, ids, record):\n    return float(text == record['solution'])\n"
        "def empty(text, ids, record):\n    return float(text.split()[-1] == record['answer'])\n"
        "def table(text, ids, record):\n    return {'a': 1.0}[text]\n"
    )
    (tmp_path / "broken.py").write_text("import a_module_that_is_not_there\n")
    data = verl_data(tmp_path, "jsonl")
    common = [f"data.path={data}"]
    with pytest.raises(ConfigError, match=r"reward.function='\S+broken.py:f': .*does not import: ModuleNotFoundError"):
        inputs(tmp_path, *common, f"reward.function={tmp_path / 'broken.py'}:f")
    with pytest.raises(
        ConfigError, match=r"called as fn\(text, ids, record\), or, .*its signature \(text\) takes neither"
    ):
        inputs(tmp_path, *common, f"reward.function={rewards}:one_arg")
    with pytest.raises(ConfigError, match=r"reward.table=\{'math_dapo': \S+one_arg'\}: reward \S+one_arg' is called"):
        inputs(tmp_path, *common, "reward.by=data_source", f"reward.table={{math_dapo: {rewards}:one_arg}}")
    with pytest.raises(BadInputError) as err:
        inputs(tmp_path, *common, f"reward.function={rewards}:answer")
    assert str(err.value) == (
        f"data.path: {data} record 1 (line 1): reward '{rewards}:answer' raised KeyError: 'answer' on it (one call "
        "before the run, with an empty response): no field 'answer' (data.answer_field); the record has "
        f"{VERL_FIELDS}; verl's layout: set data.answer_field=reward_model.ground_truth"
    )
    fixed = [*common, "data.answer_field=reward_model.ground_truth"]
    with pytest.raises(BadInputError, match=r"KeyError: 'solution' on it .*: no field 'solution'; the record has"):
        inputs(tmp_path, *fixed, f"reward.function={rewards}:solution")
    for name in ("answer", "empty", "table"):  # IndexError, KeyError: '' on the empty response: the run's to count
        inputs(tmp_path, *fixed, f"reward.function={rewards}:{name}")


def test_the_dry_run_refuses_what_the_run_refuses(tmp_path, capsys):
    from bapo_megatron.train import main

    data = verl_data(tmp_path, "parquet")
    common = [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "reward.function=dapo", "--dry-run"]
    with pytest.raises(SystemExit) as exit:
        main(common)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit.value.code == 2 and error.startswith("error: data.path: ") and "no field 'answer'" in error
    main([*common, "data.answer_field=reward_model.ground_truth"])
    assert f"data: data.path={data}: 3 records, the first 3 read, rendered and checked against reward 'dapo'" in (
        capsys.readouterr().out
    )
    main([*common, "eval.sets.aime.path=/nowhere/aime.parquet"])
    assert "data: not checked here (eval.sets.aime.path=/nowhere/aime.parquet: no such file)" in capsys.readouterr().out


def test_the_check_comes_before_any_engine(tmp_path, monkeypatch):
    """The rollout driver checks its inputs before it makes its engines (whose launch follows)."""
    from bapo_megatron import driver

    made = []
    monkeypatch.setattr(driver, "Engines", lambda *args, **kwargs: made.append(args))
    cfg = load_config(None, [f"data.path={verl_data(tmp_path, 'parquet')}", f"data.cache_dir={tmp_path / 'c'}"])
    with pytest.raises(BadInputError, match="no field 'answer'"):
        driver.RolloutDriver(cfg, tiny_spec(), tmp_path / "run")
    assert made == [] and not (tmp_path / "run").exists()
