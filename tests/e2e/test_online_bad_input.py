"""`bapo-train` online, on input it cannot use: one `error:` line naming the field and the value,
exit 2, no traceback, and nothing built or started (no run directory, no checkpoint, no engine).

The dataset (missing, empty, a record without the prompt field, a verl record without the answer
field its reward reads, a reward route missing past data.check_records, a data.cache_dir that is a
file), an evaluation set (missing, a bad record past
data.check_records: named by its own key), the reward (unknown, a file that does not import), the
tokenizer (a vocabulary larger than the model's), the engines (a port in use, URLs that do not
answer, an engine serving another shape); the data-parallel split is checked in
tests/unit/test_train_cli.py.
"""

import json
import shutil
import socket

import pytest

from bapo_megatron.engines.launcher import embedded_server
from tests.helpers import make_hf_model, verl_parquet
from tests.online import MODEL, args, start, write_task

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def task(tmp_path_factory, hf_model):
    root = write_task(tmp_path_factory.mktemp("bad"), 8, hf_model(*MODEL))
    (root / "broken_reward.py").write_text("import a_module_that_is_not_there\n")
    (root / "empty.jsonl").write_text("\n")
    (root / "no_prompt.jsonl").write_text(json.dumps({"question": [1, 2]}) + "\n")
    big = root / "big-tokenizer"
    shutil.copytree(root / "m", big)
    import tokenizers

    vocab = {f"t{i}": i for i in range(300)}  # the model has 250 tokens
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")).save(str(big / "tokenizer.json"))
    make_hf_model(root, "other", ("qwen2", 1, False))  # another shape: one key-value head
    chat = root / "chat"  # the model with a chat template
    shutil.copytree(root / "m", chat)
    template = "{% for m in messages %}t1 {{ m['content'] }} t2{% endfor %}{% if add_generation_prompt %} t3{% endif %}"
    (chat / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "unk_token": "t0"}))
    verl_parquet(root / "verl.parquet", ["t5 t6", "t7"], ["t9", "t8"], sources=["math_dapo", "aime"])
    (root / "bad_messages.jsonl").write_text(json.dumps({"prompt": [{"text": "t5"}]}) + "\n")
    (root / "bad_eval.jsonl").write_text(json.dumps({"prompt": [3, 7], "answer": "1"}) + '\n{"prompt": {}}\n')
    verl_parquet(root / "shards" / "a.parquet", ["t5"], ["t9"])
    (root / "shards" / "b.parquet").write_bytes(b"PAR1 not parquet PAR1")
    return root


def fails(task, tmp_path, *overrides: str, phrases: tuple[str, ...]) -> None:
    run = tmp_path / "run"
    proc = start(args(task, run, 2, *overrides))
    out, _ = proc.communicate(timeout=300)
    lines = out.strip().splitlines()
    assert proc.returncode == 2, out[-3000:]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in out, out[-3000:]
    for phrase in phrases:
        assert phrase in lines[-1], (phrase, lines[-1])
    assert not run.exists(), "the run started before the input was checked"


@pytest.mark.parametrize(
    ("override", "phrases"),
    [
        ("data.path={root}/missing.jsonl", ("data.path=", "missing.jsonl: no such file")),
        ("data.path={root}/empty.jsonl", ("data.path=", "no records")),
        ("data.path={root}/no_prompt.jsonl", ("record 1 (line 1): no field 'prompt'",)),
        ("reward.function=nope", ("reward.function='nope'", "unknown reward")),
        (
            "reward.function={root}/broken_reward.py:score",
            ("reward.function=", "does not import", "ModuleNotFoundError"),
        ),
        ("reward.function={root}/reward.py:missing", ("reward.function=", "has no function 'missing'")),
        ("model.hf_path={root}/big-tokenizer", ("tokenizer has 300 tokens", "vocabulary of 250")),
        ("parallel.max_tokens_per_microbatch=16", ("parallel.max_tokens_per_microbatch=16: leaves no room",)),
        (
            "parallel.max_tokens_per_microbatch=18",  # 16 new tokens leave 2 for the 3-token prompts
            ("record 1", "exceed parallel.max_tokens_per_microbatch=18", "raise parallel.max_tokens_per_microbatch"),
        ),
        (("data.prompt_field=question.text", "data.path={root}/no_prompt.jsonl"), ("record 1", "'question.text'")),
        (
            ("model.hf_path={root}/chat", "data.path={root}/bad_messages.jsonl"),
            ("bad_messages.jsonl record 1", "message 1 must be {'role': str, 'content': str}"),
        ),
        ("data.path={root}/verl.parquet", ("verl.parquet record 1", "chat messages need the model directory's chat")),
        (
            ("model.hf_path={root}/chat", "data.path={root}/verl.parquet", "reward.function=dapo"),
            (
                "verl.parquet record 1: no field 'answer' (data.answer_field), which reward 'dapo' scores against",
                "verl's layout: set data.answer_field=reward_model.ground_truth",
            ),
        ),
        (
            (
                "model.hf_path={root}/chat",
                "data.path={root}/verl.parquet",
                "reward.by=data_source",
                "data.answer_field=reward_model.ground_truth",
            ),
            ("verl.parquet record 2", "data_source='aime' has no reward in reward.table"),
        ),
        ("data.path={root}/shards", ("b.parquet: not a parquet file",)),
        (
            (
                "model.hf_path={root}/chat",
                "data.path={root}/verl.parquet",
                "reward.by=data_source",
                "data.answer_field=reward_model.ground_truth",
                "data.check_records=1",
            ),
            ("data.path: ", "verl.parquet record 2", "data_source='aime' has no reward in reward.table"),
        ),
        (
            ("eval.sets.aime.path={root}/bad_eval.jsonl", "data.check_records=1"),
            ("eval.sets.aime.path: ", "bad_eval.jsonl record 2 (line 2): 'prompt' must be text"),
        ),
        ("eval.path={root}/missing.jsonl", ("eval.path=", "missing.jsonl: no such file")),
        (
            ("data.path={root}/verl.parquet", "data.cache_dir={root}/reward.py"),
            ("data.cache_dir=", "reward.py': a file, not a directory"),
        ),
    ],
    ids=[
        "missing",
        "empty",
        "no-prompt",
        "unknown-reward",
        "reward-import",
        "reward-name",
        "tokenizer",
        "micro-batch",
        "micro-batch-prompt",
        "field-path",
        "messages",
        "no-template",
        "answer-field",
        "data-source",
        "bad-shard",
        "route-past-checked",
        "eval-record",
        "eval-missing",
        "cache-dir",
    ],
)
def test_bad_data_reward_and_tokenizer(task, tmp_path, override, phrases):
    """(A batch that does not split over the data-parallel ranks: tests/unit/test_train_cli.py.)"""
    given = override if isinstance(override, tuple) else (override,)
    overrides = [o.format(root=task) for o in given]
    if not any(o.startswith("data.cache_dir=") for o in overrides):
        overrides.append(f"data.cache_dir={task / 'cache'}")
    if "reward.by=data_source" in overrides:
        overrides.append("reward.table={math_dapo: dapo}")
    fails(task, tmp_path, *overrides, phrases=phrases)


def test_a_port_in_use(task, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fails(task, tmp_path, f"rollout.engines.port={port}", phrases=(f"rollout.engines.port={port}", "cannot listen"))


def test_engine_urls_that_do_not_answer(task, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    url = f"http://127.0.0.1:{port}"
    fails(task, tmp_path, f"rollout.engines.urls=[{url}]", phrases=("rollout.engines.urls", url, "does not answer"))


def test_an_engine_serving_another_shape(task, tmp_path):
    server = embedded_server(task / "other", tmp_path / "engine.log").start().wait_ready(120)
    try:
        fails(
            task,
            tmp_path,
            f"rollout.engines.urls=[{server.url}]",
            phrases=("rollout.engines.urls", server.url, "num_kv_heads 1 (the trainer's is 2)"),
        )
    finally:
        server.stop()
