"""A verl-layout parquet trains through `bapo-train` with nothing converted by hand: chat-message
prompts through the model's chat template, the answer at reward_model.ground_truth, rewards
routed by data_source (DAPO's for math_dapo), overlong prompts dropped and counted, two named
evaluation sets logged side by side; examples/tiny_verl.yaml on the data `python -m
bapo_megatron.tasks verl-data` writes."""

import json
import shutil

import pytest

from tests.helpers import verl_parquet
from tests.online import MODEL, PORTS, ROOT, args, engine_port, metrics, no_engine_left, train, write_task

pytestmark = pytest.mark.e2e

TEMPLATE = "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t3{% endif %}"


def test_a_verl_parquet_trains_as_it_is(tmp_path, hf_model):
    import tokenizers

    task = write_task(tmp_path / "task", 4, hf_model(*MODEL))
    chat = task / "chat"  # the task's model, its tokenizer splitting on spaces, with a chat template
    shutil.copytree(task / "m", chat)
    tok = tokenizers.Tokenizer.from_file(str(chat / "tokenizer.json"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(chat / "tokenizer.json"))
    (chat / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "unk_token": "t0"}))
    prompts = [" ".join(f"t{5 + (i * 7 + j) % 40}" for j in range(2 + i % 3)) for i in range(24)]
    prompts[3] = " ".join(["t9"] * 40)  # over data.max_prompt_tokens: dropped
    sources = ["math_dapo" if i % 2 else "even" for i in range(24)]
    answers = [str(i) for i in range(24)]
    data = verl_parquet(task / "train" / "part-0.parquet", prompts, answers, sources)
    verl_parquet(task / "aime.parquet", prompts[:4], ["1", "2", "3", "4"], ["math_dapo"] * 4)
    verl_parquet(task / "mixed.parquet", prompts[4:8], ["5", "6", "7", "8"], sources[4:8])
    run = tmp_path / "run"
    argv = args(task, run, 2, f"model.hf_path={chat}", f"data.path={data.parent}")
    argv += [
        "data.answer_field=reward_model.ground_truth",
        "reward.by=data_source",
        f"reward.table={{math_dapo: dapo, even: {task / 'reward.py'}:even}}",
        "data.max_prompt_tokens=12",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.system_prompt=t4",
        f"eval.sets={{aime: {{path: {task / 'aime.parquet'}, samples: 2}}, mixed: {{path: {task / 'mixed.parquet'}}}}}",
        "eval.samples=1",
    ]
    train(argv)
    got = metrics(run)
    assert [m["step"] for m in got if "loss/pg" in m] == [1, 2]
    for m in got:
        if "loss/pg" in m:
            assert m["data/prompts_dropped"] >= 1  # the long prompt, found among those checked up front
            assert -1.0 <= m["rollout/reward_mean"] <= 1.0 and m["rollout/reward_errors"] == 0
    evaluated = [m for m in got if "eval/aime/prompts" in m]
    assert [m["step"] for m in evaluated] == [0, 2]
    for m in evaluated:
        assert m["eval/aime/prompts"] == 3 and m["eval/mixed/prompts"] == 4  # evaluation drops the long one too
        assert {"eval/aime/avg@2", "eval/aime/pass@2", "eval/mixed/avg@1", "eval/mixed/greedy_acc"} <= m.keys()
        assert m["eval/aime/greedy_acc"] == -1.0  # DAPO's -1: a tiny model writes no "Answer:" line
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rollouts] == [1] * 16 + [2] * 16  # logging.samples' default: 4 groups of 4
    for r in rollouts:  # the text as the tokenizer decodes it, the record's answer and source beside it
        assert r["prompt"].startswith("t1 t4 t2") and isinstance(r["response"], str), r
        assert r["answer"] in answers and r["data_source"] in ("math_dapo", "even"), r
        assert r["response_tokens"] <= 16 and r["version_max"] <= r["step"] - 1, r
    no_engine_left(run)


def test_tiny_verl_example_trains_on_generated_verl_data(tmp_path):
    """The README's CPU path for verl data: the generated gsm8k-layout parquet and chat model, trained
    by examples/tiny_verl.yaml as it is (its paths and step count overridden, the run kept tiny),
    scored by the gsm8k reward and evaluated on the generated test split."""
    from bapo_megatron.tasks import write_verl_data

    data = write_verl_data(tmp_path / "data", train=64, heldout=8)
    run = tmp_path / "run"
    port = engine_port()
    PORTS.setdefault(run, []).append(port)
    argv = [
        str(ROOT / "examples" / "tiny_verl.yaml"),
        f"model.hf_path={data['model']}",
        f"data.path={data['train']}",
        f"eval.path={data['test']}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"run_dir={run}",
        f"rollout.engines.port={port}",
        "steps=2",
        "eval.interval=2",
        "eval.samples=1",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "logging.backends=[jsonl]",
        "logging.save_batches=true",
    ]
    train(argv)
    got = metrics(run)
    trained = [m for m in got if "loss/pg" in m]
    assert [m["step"] for m in trained] == [1, 2]
    assert all(0.0 <= m["rollout/reward_mean"] <= 1.0 and m["rollout/reward_errors"] == 0 for m in trained)
    assert [m["step"] for m in got if "eval/greedy_acc" in m] == [0, 2]
    no_engine_left(run)
    # the trainer's half alone: the saved batches, replayed without engines, give the run's first step
    from bapo_megatron.common.batch import RolloutBatch

    saved = sorted((run / "batches").glob("*.safetensors"))
    assert [f.name for f in saved] == ["step_00000001.safetensors", "step_00000002.safetensors"]
    first = RolloutBatch.load(saved[0])
    assert (
        len(first) == 16 and abs(sum(s.reward for s in first.samples) / 16 - trained[0]["rollout/reward_mean"]) < 1e-6
    )
    replay = tmp_path / "replay"
    train(
        [
            *argv[:2],
            f"rollout.replay={run / 'batches'}",
            f"run_dir={replay}",
            "steps=1",
            "eval.interval=0",
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "logging.backends=[jsonl]",
        ]
    )
    assert metrics(replay)[-1]["loss/pg"] == pytest.approx(trained[0]["loss/pg"], rel=1e-5, abs=1e-7)
