"""The rollout driver's input, checked before any engine or model: text prompts through the model
directory's tokenizer (with its chat template when asked), and reward functions by name, module
path or file path, whose failures score 0 and are counted."""

import asyncio
import json

import pytest
import tokenizers

from bapo_megatron.config import load_config
from bapo_megatron.driver import RolloutDriver
from bapo_megatron.engines.launcher import free_port
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.rewards.functions import load_reward
from bapo_megatron.rewards.workers import RewardWorkers

TEMPLATE = "{% for m in messages %}t1 {{ m['content'] }} t2{% endfor %}{% if add_generation_prompt %} t3{% endif %}"


@pytest.fixture
def model_dir(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(tiny_spec().to_hf_config()))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    return root


def _driver(tmp_path, model_dir, *overrides):
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "t5 t6 t7", "answer": "t9"}) + "\n")
    cfg = load_config(
        None,
        [
            f"model.hf_path={model_dir}",
            f"data.path={tmp_path / 'data.jsonl'}",
            "reward.function=exact",
            f"rollout.engines.port={free_port()}",
            *overrides,
        ],
    )
    driver = RolloutDriver(cfg, tiny_spec(), tmp_path / "run")
    driver.close()
    return driver


def test_text_prompts_are_tokenised_with_the_models_tokenizer(tmp_path, model_dir):
    driver = _driver(tmp_path, model_dir)
    assert driver.prompts.first(1)[0][0] == [5, 6, 7]
    assert driver.inputs.decode([9, 10]) == "t9 t10"
    assert not (tmp_path / "run").exists()  # nothing written before the run starts


def test_the_chat_template_wraps_text_prompts(tmp_path, model_dir):
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, "unk_token": "t0"})
    )
    assert _driver(tmp_path, model_dir, "data.chat_template=true").prompts.first(1)[0][0] == [1, 5, 6, 7, 2, 3]
    assert _driver(tmp_path, model_dir).prompts.first(1)[0][0] == [5, 6, 7]


def test_reward_functions_by_module_or_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(text, ids, record):\n    return float(len(ids))\n"
        "def broken(text, ids, record):\n    raise KeyError(record['missing'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:length")("", [1, 2, 3], {}) == 3.0
    assert load_reward(f"{tmp_path / 'my_rewards.py'}:length")("", [1], {}) == 1.0
    workers = RewardWorkers(f"{tmp_path / 'my_rewards.py'}:broken", inline=True)
    scored = asyncio.run(workers("x", [1], {}))
    assert scored.value == 0.0 and scored.error.startswith("KeyError") and workers.failures == 1
    assert workers.state_dict() == {"failures": 1, "replaced": 0}
    for name, message in [
        ("nope", "unknown reward 'nope'"),
        ("no_such_module_here:fn", "does not import: ModuleNotFoundError"),
        ("my_rewards:absent", "has no function 'absent'"),
        (f"{tmp_path / 'missing.py'}:fn", "no such file"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_reward(name)


def test_a_prompt_beyond_the_context_is_refused(tmp_path, model_dir):
    with pytest.raises(ConfigError, match="reward.function='nope'"):
        _driver(tmp_path, model_dir, "reward.function=nope")
    from bapo_megatron.errors import BadInputError

    with pytest.raises(BadInputError, match="exceed the model's context of 4096 tokens"):
        _driver(tmp_path, model_dir, "rollout.sampling.max_new_tokens=4094")


def test_sglang_engines_are_checked_before_any_model(tmp_path, model_dir, monkeypatch):
    """rollout.engines.kind=sglang started by the driver: SGLang installed, GPUs here, and room for the
    servers beside the trainer's ranks on this node, each a ConfigError naming the field."""
    import importlib.util

    import torch

    sglang = ["rollout.engines.kind=sglang", "rollout.engines.servers=2", "rollout.engines.tensor_parallel=2"]
    real_find_spec = importlib.util.find_spec

    def installed(present: bool):
        return lambda name, *a: (object() if present else None) if name == "sglang" else real_find_spec(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", installed(False))
    with pytest.raises(ConfigError, match=r"rollout.engines.kind='sglang': SGLang 0.5.23 is not installed here"):
        _driver(tmp_path, model_dir, *sglang)
    monkeypatch.setattr(importlib.util, "find_spec", installed(True))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="SGLang runs on CUDA GPUs and this machine has none"):
        _driver(tmp_path, model_dir, *sglang)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun --nproc-per-node 8: every GPU trains
    with pytest.raises(
        ConfigError, match=r"rollout.engines.servers=2: 2 server\(s\) x TP 2 on GPUs of their own need 4"
    ):
        _driver(tmp_path, model_dir, *sglang)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _driver(tmp_path, model_dir, *sglang).engines.base_gpus == [4, 6]
    assert _driver(tmp_path, model_dir, *sglang, "rollout.engines.colocate=true").engines.base_gpus == [0, 2]
    # engines that run elsewhere need none of it
    urls = "rollout.engines.urls=[http://127.0.0.1:1]"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="rollout.engines.urls"):  # does not answer: the URL check, not SGLang's
        _driver(tmp_path, model_dir, *sglang, urls)


def test_verl_data_with_rewards_routed_by_data_source(tmp_path, model_dir):
    """A verl-layout parquet as it is: chat messages through the chat template, the answer at
    reward_model.ground_truth, each record's reward picked by its data_source; a data_source
    value with no reward is an error naming the record before any engine or model."""
    from bapo_megatron.errors import BadInputError
    from tests.helpers import verl_parquet

    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, "unk_token": "t0"})
    )
    data = verl_parquet(tmp_path / "train.parquet", ["t5 t6", "t7"], ["t9", "t8"], sources=["math_dapo", "aime"])
    common = [
        f"data.path={data}",
        "data.answer_field=reward_model.ground_truth",
        "reward.by=data_source",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    driver = _driver(tmp_path, model_dir, *common, "reward.table={math_dapo: dapo, aime: exact}")
    ids, meta = driver.prompts.first(1)[0]
    assert ids == [1, 5, 6, 2, 3] and meta["answer"] == "t9" and meta["extra_info"]["split"] == "train"
    reward = load_reward(driver.inputs.reward)
    assert reward("t8", [], {"data_source": "aime", "answer": "t8"}) == 1.0
    assert reward("Answer: t9", [], {"data_source": "math_dapo", "answer": "t9"}) == 1.0
    with pytest.raises(BadInputError, match=r"parquet record 2: data_source='aime' has no reward in reward.table"):
        _driver(tmp_path, model_dir, *common, "reward.table={math_dapo: dapo}")
    with pytest.raises(BadInputError, match=r"record 1: no field 'source' \(reward.by\)"):
        _driver(tmp_path, model_dir, *common[:2], common[3], "reward.by=source", "reward.table={x: math}")


@pytest.mark.parametrize("key", ["eval.path", "eval.sets.aime.path"])
def test_every_record_of_an_evaluation_set_is_checked_at_the_start(tmp_path, model_dir, key):
    """An evaluation set is read whole at the start: a record past data.check_records that cannot
    work is a BadInputError then (one error line), and every error about the set names its key."""
    import re

    from bapo_megatron.errors import BadInputError

    good = json.dumps({"prompt": [1, 2], "answer": "t1"})
    bad = tmp_path / "eval.jsonl"
    bad.write_text(f"{good}\n{good}\n" + json.dumps({"prompt": {"text": "t5"}}) + "\n")
    shown = re.escape(key)
    with pytest.raises(BadInputError, match=rf"^{shown}: \S+eval.jsonl record 3 \(line 3\): 'prompt' must be text"):
        _driver(tmp_path, model_dir, f"{key}={bad}", "data.check_records=1")
    bad.write_text(f"{good}\n{good}\n{{oops\n")
    with pytest.raises(BadInputError, match=rf"^{shown}: \S+eval.jsonl:3: not JSON"):
        _driver(tmp_path, model_dir, f"{key}={bad}", "data.check_records=1")
    for path, message in [("missing.jsonl", "no such file"), ("none-*.jsonl", "the pattern matches no file")]:
        with pytest.raises(BadInputError, match=rf"^{shown}=\S+{re.escape(path)}: {message}"):
            _driver(tmp_path, model_dir, f"{key}={tmp_path / path}")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(BadInputError, match=rf"^{shown}=\S+empty.jsonl: no records"):
        _driver(tmp_path, model_dir, f"{key}={tmp_path / 'empty.jsonl'}")
    bad.write_text(f"{good}\n{good}\n")
    assert len(_driver(tmp_path, model_dir, f"{key}={bad}", "data.check_records=1").inputs.eval_sets[0].items) == 2


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_every_training_records_reward_route_is_checked_at_the_start(tmp_path, model_dir, fmt):
    """reward.by: every record's value is read at the start (the one field, not the records whole),
    so a value without an entry in reward.table, or a record without the field, past
    data.check_records, is an error naming the record before any engine, not failed reward calls."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bapo_megatron.errors import BadInputError

    def data(rows):
        path = tmp_path / f"train.{fmt}"
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return [f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "data.check_records=2"]

    rows = [{"prompt": [1], "answer": "t1", "src": s, "info": {"src": s}} for s in ["a", "a", "a", "b", "c"]]
    routes = "reward.table={a: exact, b: exact}"
    where = r"train.parquet record 5" if fmt == "parquet" else r"train.jsonl record 5 \(line 5\)"
    for by in ["src", "info.src"]:
        with pytest.raises(BadInputError, match=rf"data.path: \S+{where}: {by}='c' has no reward in reward.table"):
            _driver(tmp_path, model_dir, *data(rows), f"reward.by={by}", routes)
        _driver(tmp_path, model_dir, *data(rows), f"reward.by={by}", "reward.table={a: exact, b: exact, c: exact}")
    if fmt == "jsonl":  # not text: read record by record, as exact
        numbers = [{**r, "src": n} for r, n in zip(rows, [1, 1, 1, 2, 3], strict=True)]
        with pytest.raises(BadInputError, match=rf"{where}: src=3 has no reward in reward.table"):
            _driver(tmp_path, model_dir, *data(numbers), "reward.by=src", "reward.table={1: exact, 2: exact}")
        absent = [*rows[:4], {"prompt": [1], "answer": "t1"}]
        with pytest.raises(BadInputError, match=rf"{where}: no field 'src' \(reward.by\)"):
            _driver(tmp_path, model_dir, *data(absent), "reward.by=src", routes)


def test_an_evaluation_sets_reward_routes_are_checked_as_it_is_read(tmp_path, model_dir):
    """Every record an evaluation set scores has a route (past data.check_records too); those past
    its max_prompts are never read nor scored."""
    from bapo_megatron.errors import BadInputError

    def jsonl(name, sources):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": [1], "answer": "t1", "src": s}) + "\n" for s in sources))
        return path

    common = [f"data.path={jsonl('train.jsonl', 'aa')}", "data.check_records=1", "reward.by=src"]
    common += ["reward.table={a: exact}", f"eval.sets.aime.path={jsonl('aime.jsonl', 'aac')}"]
    with pytest.raises(BadInputError, match=r"eval.sets.aime.path: \S+aime.jsonl record 3 \(line 3\): src='c' has no"):
        _driver(tmp_path, model_dir, *common)
    assert len(_driver(tmp_path, model_dir, *common, "eval.sets.aime.max_prompts=2").inputs.eval_sets[0].items) == 2
