"""The rollout driver's input, checked before any engine or model: text prompts through the model
directory's tokenizer (with its chat template when asked), and reward functions by name, module
path or file path, whose failures score 0 and are counted."""

import asyncio
import json

import pytest
import tokenizers

from bapo_megatron.common.model_spec import tiny_spec
from bapo_megatron.config import load_config
from bapo_megatron.driver import RolloutDriver
from bapo_megatron.engines.launcher import free_port
from bapo_megatron.errors import ConfigError
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
    driver = _driver(tmp_path, model_dir, *common, "reward.routes={math_dapo: dapo, aime: exact}")
    ids, meta = driver.prompts.first(1)[0]
    assert ids == [1, 5, 6, 2, 3] and meta["answer"] == "t9" and meta["extra_info"]["split"] == "train"
    reward = load_reward(driver.inputs.reward)
    assert reward("t8", [], {"data_source": "aime", "answer": "t8"}) == 1.0
    assert reward("Answer: t9", [], {"data_source": "math_dapo", "answer": "t9"}) == 1.0
    with pytest.raises(BadInputError, match=r"parquet record 2: data_source='aime' has no reward in reward.routes"):
        _driver(tmp_path, model_dir, *common, "reward.routes={math_dapo: dapo}")
    with pytest.raises(BadInputError, match=r"record 1: no field 'source' \(reward.by\)"):
        _driver(tmp_path, model_dir, *common[:2], common[3], "reward.by=source", "reward.routes={x: math}")
