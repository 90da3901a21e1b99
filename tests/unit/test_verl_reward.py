"""A reward function in verl's form, compute_score(data_source, solution_str, ground_truth,
extra_info), is called as verl calls it, not as fn(text, ids, record): the arguments are those
verl 0.9.1's own reward manager (its run_single, compiled from the wheel and run unchanged) hands
it for the same record, verl's own default_compute_score scores through the run's worker
processes as it scores in verl, and a function whose parameters take neither call is refused
before the first step with one line naming it and its signature."""

import ast
import asyncio
import copy
import json
import types
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_megatron.config import DataConfig, load_config
from bapo_megatron.data.prompts import PromptSource
from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.rewards.functions import load_reward, score
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.tasks import VERL_TASK, split, verl_records
from tests.helpers import VERL_VERSION, verl_module, verl_parquet, word_tokenizer

MANAGER = "verl/experimental/reward_loop/reward_manager/naive.py"

FORMS = """
import asyncio
calls = []
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls.append({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                  "extra_info": extra_info})
    return {"score": float(solution_str.endswith(str(ground_truth))), "acc": True}
def keywords(**kwargs):
    return 1.0
def loose(data_source, solution_str, ground_truth, **kwargs):
    return 2.0
async def later(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return 3.0
def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
def no_extra_info(data_source, solution_str, ground_truth):
    return 1.0
def ours(text, ids, record):
    return float(len(ids))
def ours_with_source(text, ids, record, data_source=None):
    return float(len(ids) + (data_source is None))
def one(text):
    return 1.0
"""


@pytest.fixture(scope="module")
def wheel():
    from tests.sglang_wheel import WheelUnavailable, wheel_path

    try:
        return zipfile.ZipFile(wheel_path("verl", VERL_VERSION))
    except WheelUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    path = tmp_path_factory.mktemp("forms") / "forms.py"
    path.write_text(FORMS)
    return path


@pytest.fixture(scope="module")
def gsm8k_records(tmp_path_factory):
    """The rows `tasks verl-data` writes (verl's gsm8k layout, data_source openai/gsm8k) and each as
    the run's reward gets it: read by the loop's PromptSource with verl's answer field."""
    root = tmp_path_factory.mktemp("verl")
    rows = verl_records(split(VERL_TASK, 12, 0, seed=3)[0], "train")
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    config = DataConfig(
        path=str(root / "train.parquet"), answer_field="reward_model.ground_truth", cache_dir=str(root / "cache")
    )
    source = PromptSource(config, tokenizer=word_tokenizer())
    return rows, [meta for _, meta in source.first()]


def verls_call(wheel: zipfile.ZipFile, record: dict, response: str) -> dict:
    """The keywords verl's NaiveRewardManager.run_single (from the wheel, unchanged) passes
    compute_score for one sample of `record` whose response decodes to `response`: its
    non_tensor_batch is the record's fields and __num_turns__ 2, as verl's single-turn agent loop sets."""
    import torch

    tree = ast.parse(wheel.read(MANAGER).decode())
    manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NaiveRewardManager")
    method = next(n for n in manager.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "run_single")
    namespace = {"DataProto": object}
    exec(compile(ast.Module([method], type_ignores=[]), f"verl-{VERL_VERSION}/{MANAGER}", "exec"), namespace)
    calls = []

    class Item:  # a DataProto of one sample, as run_single reads it (data[-1:], then data[0])
        def __init__(self) -> None:
            self.batch = {"responses": torch.tensor([7, 8, 0]), "attention_mask": torch.tensor([1, 1, 1, 1, 0])}
            self.non_tensor_batch = {**copy.deepcopy(record), "__num_turns__": 2}

        def __getitem__(self, index):
            return self

    async def run() -> None:
        manager = types.SimpleNamespace(
            loop=asyncio.get_running_loop(),
            tokenizer=types.SimpleNamespace(decode=lambda ids, skip_special_tokens: response),
            compute_score=lambda **kwargs: calls.append(kwargs) or 0.0,
            is_async_reward_score=False,
            reward_router_address=None,
        )
        await namespace["run_single"](manager, Item())

    asyncio.run(run())
    return calls[0]


def test_a_verl_form_reward_gets_what_verls_reward_manager_gives_it(wheel, forms, gsm8k_records):
    rows, metas = gsm8k_records
    reward = load_reward(f"{forms}:compute_score")
    module = reward.fn.__globals__
    for row, meta in zip(rows, metas, strict=True):
        text = f"so #### {row['reward_model']['ground_truth']}"
        assert reward(text, [1, 2], meta) == 1.0  # the dict's "score"
        assert module["calls"][-1] == verls_call(wheel, row, text)
    assert module["calls"][0]["extra_info"]["question"] == rows[0]["extra_info"]["question"]
    assert "num_turns" not in metas[0]["extra_info"]  # a copy: the record is left as it was


def test_verls_default_compute_score_scores_through_the_workers_as_in_verl(wheel, tmp_path, gsm8k_records):
    """verl's own default_compute_score (its reward_score package from the wheel, the one import
    it makes of the rest of verl stubbed) as reward.function, called in the run's worker process:
    the scores verl's gsm8k.compute_score gives, where it was all zeros (fn(text, ids, record))."""
    package = tmp_path / "verl_src"
    for name in wheel.namelist():
        if name.startswith("verl/utils/reward_score/"):
            wheel.extract(name, package)
    (package / "verl" / "__init__.py").write_text("")
    (package / "verl" / "utils" / "__init__.py").write_text("")
    (package / "verl" / "utils" / "import_utils.py").write_text("def deprecated(*a, **k):\n    return lambda f: f\n")
    (tmp_path / "verl_default.py").write_text(
        f"import sys\nsys.path.insert(0, {str(package)!r})\nfrom verl.utils.reward_score import default_compute_score\n"
    )
    rows, metas = gsm8k_records
    gsm8k = verl_module("verl/utils/reward_score/gsm8k.py")
    texts = ["#### {}", "#### 1{}", "{}", "the sum is #### {}"]
    cases = [
        (t.format(row["reward_model"]["ground_truth"]), meta)
        for row, meta in zip(rows, metas, strict=True)
        for t in texts
    ]
    workers = RewardWorkers(f"{tmp_path / 'verl_default.py'}:default_compute_score", workers=1, memory_mb=0)

    async def calls():
        return [await workers(text, [1], meta) for text, meta in cases]

    try:
        results = asyncio.run(calls())
    finally:
        workers.close()
    assert [r.error for r in results] == [None] * len(cases)
    assert [r.value for r in results] == [gsm8k.compute_score(text, meta["answer"]) for text, meta in cases]
    assert {r.value for r in results} == {0.0, 1.0}


def test_what_a_verl_form_reward_may_be_and_return(forms):
    meta = {"data_source": "s", "answer": "7", "index": 0}
    assert score(f"{forms}:keywords", "x", [], meta) == (1.0, None)
    assert score(f"{forms}:loose", "x", [], meta) == (2.0, None)
    assert score(f"{forms}:later", "x", [], meta) == (3.0, None)  # async def, as verl awaits it
    assert score(f"{forms}:ours", "x", [1, 2, 3], meta) == (3.0, None)  # (text, ids, record): as it was
    assert score(f"{forms}:ours_with_source", "x", [1, 2, 3], meta) == (4.0, None)  # a later verl name: still ours
    value, error = score(f"{forms}:no_score", "x", [], meta)
    assert value == 0.0 and error.startswith("ValueError: returned a dict without 'score'"), error
    value, error = score(f"{forms}:compute_score", "x", [], {"answer": "7"})
    assert value == 0.0 and error == "KeyError: 'data_source'"  # as verl's manager fails on such a record


@pytest.mark.parametrize(
    "name, said",
    [
        ("one", r"is called as fn\(text, ids, record\), or, .*; its signature \(text\) takes neither"),
        ("no_extra_info", r"its signature \(data_source, solution_str, ground_truth\) has verl's parameter names"),
    ],
)
def test_a_reward_that_takes_neither_call_is_refused_in_one_line(forms, tmp_path, monkeypatch, name, said):
    with pytest.raises(ValueError, match=said):
        RewardWorkers(f"{forms}:{name}")
    from bapo_megatron.rollout import inputs as inputs_module

    monkeypatch.setattr(inputs_module, "load_tokenizer", lambda path: word_tokenizer())
    data = verl_parquet(tmp_path / "train.parquet", ["w5 w6"], ["w9"])
    cfg = load_config(
        None, [f"data.path={data}", f"data.cache_dir={tmp_path / 'c'}", f"reward.function={forms}:{name}"]
    )
    with pytest.raises(ConfigError, match=rf"^reward.function='\S+:{name}': reward '\S+:{name}'.*{said}") as err:
        inputs_module.RolloutInputs(cfg, _spec())
    assert "\n" not in str(err.value)


def test_the_fields_a_verl_form_reward_is_handed_are_checked_before_the_run(forms, tmp_path, monkeypatch):
    from bapo_megatron.rollout import inputs as inputs_module

    monkeypatch.setattr(inputs_module, "load_tokenizer", lambda path: word_tokenizer())
    data = verl_parquet(tmp_path / "train.parquet", ["w5 w6", "w7"], ["w9", "w8"])
    common = [f"data.path={data}", f"data.cache_dir={tmp_path / 'c'}", f"reward.function={forms}:compute_score"]
    with pytest.raises(BadInputError, match=r"record 1: no field 'answer' \(data.answer_field\), which reward "):
        inputs_module.RolloutInputs(load_config(None, common), _spec())
    fixed = [*common, "data.answer_field=reward_model.ground_truth"]
    assert inputs_module.RolloutInputs(load_config(None, fixed), _spec()).reward.endswith(":compute_score")
    rows = pq.read_table(data).to_pylist()
    del rows[1]["data_source"]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    mixed = [*fixed, f"data.path={tmp_path / 'mixed.jsonl'}"]
    with pytest.raises(BadInputError, match=r"mixed.jsonl record 2 \(line 2\): no field 'data_source', which reward"):
        inputs_module.RolloutInputs(load_config(None, mixed), _spec())


def _spec():
    from bapo_megatron.models.spec import tiny_spec

    return tiny_spec()
