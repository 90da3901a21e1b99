"""The held-out evaluator against transformers' own generate(), and plot_run on recorded metrics."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _greedy_answers(model_dir: Path, heldout: Path, max_new_tokens: int = 6) -> list[dict]:
    """heldout's records with transformers' greedy continuation of each prompt as its answer."""
    import transformers

    from bapo_megatron.data.prompts import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = load_tokenizer(model_dir)
    records = []
    for line in heldout.read_text().splitlines():
        prompt = json.loads(line)["prompt"]
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        out = model.generate(
            ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=0
        )
        records.append({"prompt": prompt, "answer": tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)})
    return records


def test_greedy_answers_are_what_transformers_generates(tmp_path):
    """Records whose answers are transformers' greedy continuations score 1.0 greedy; answers
    that are wrong score 0 (the evaluator's KV-cached, left-padded loop against upstream)."""
    from bapo_megatron.evaluate import evaluate_hf
    from bapo_megatron.tasks import write_task

    paths = write_task("addition", tmp_path, train=10, heldout=40, seed=1)
    records = _greedy_answers(paths["model"], paths["heldout"])
    right = tmp_path / "right.jsonl"
    right.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = evaluate_hf(paths["model"], right, samples=2, max_new_tokens=6, batch_size=16)
    assert got["greedy_acc"] == 1.0 and got["prompts"] == 40
    assert 0 <= got["avg@2"] <= got["pass@2"] <= 1
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps({**r, "answer": r["answer"] + "9"}) + "\n" for r in records))
    assert evaluate_hf(paths["model"], wrong, samples=0, max_new_tokens=6)["greedy_acc"] == 0.0


@pytest.fixture(scope="module")
def addition(tmp_path_factory):
    from bapo_megatron.tasks import write_task

    return write_task("addition", tmp_path_factory.mktemp("evaluate"), train=10, heldout=8, seed=1)


def _bad_input(addition, tmp: Path, case: str) -> list[str]:
    """The command line of one malformed use of the evaluator (files it needs written under tmp)."""
    import shutil

    model, heldout = str(addition["model"]), str(addition["heldout"])
    if case == "no config":
        (tmp / "empty").mkdir()
        return [str(tmp / "empty"), heldout]
    if case == "cut shard":
        shutil.copytree(model, tmp / "cut")
        shard = sorted((tmp / "cut").glob("*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
        return [str(tmp / "cut"), heldout]
    records = {
        "not json": "{not json\n",
        "no prompt": '{"answer": "1"}\n',
        "list prompt": '{"prompt": [1.5, 2], "answer": "1"}\n',
        "parquet as jsonl": b"PAR1\x00\xc0\x15\n",  # not UTF-8
        "not an object": "[1, 2]\n",
        "empty": "",
    }
    if case in records:
        (tmp / "h.jsonl").write_bytes(records[case] if isinstance(records[case], bytes) else records[case].encode())
        return [model, str(tmp / "h.jsonl"), "--max-new-tokens", "6"]
    flags = {
        "no model": ["/nonexistent/model", heldout],
        "no heldout": [model, str(tmp / "missing.jsonl")],
        "negative samples": [model, heldout, "--samples", "-1"],
        "zero temperature": [model, heldout, "--temperature", "0"],
        "nan temperature": [model, heldout, "--temperature", "nan"],
        "zero tokens": [model, heldout, "--max-new-tokens", "0"],
        "past the context": [model, heldout, "--max-new-tokens", "1000000"],
        "zero prompts": [model, heldout, "--max-prompts", "0"],
        "text prompts": [model, heldout, "--max-prompts", "x"],
        "unknown reward": [model, heldout, "--reward", "nope"],
    }
    return flags[case]


BAD_CASES = [
    "no config", "cut shard", "not json", "no prompt", "list prompt", "not an object", "empty", "parquet as jsonl",
    "no model", "no heldout", "negative samples", "zero temperature", "nan temperature", "zero tokens",
    "past the context", "zero prompts", "text prompts", "unknown reward",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_CASES)
def test_the_evaluator_answers_bad_input_with_one_error_line(addition, tmp_path, case, capsys):
    from bapo_megatron.evaluate import main

    try:
        code = main(_bad_input(addition, tmp_path, case))
    except SystemExit as exit_:  # argparse's refusal of an option
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and "error:" in err[-1] and "Traceback" not in "\n".join(err), err
    if (tmp_path / "h.jsonl").exists():  # a bad record: the file is named
        assert str(tmp_path / "h.jsonl") in err[-1], err


def test_a_record_the_reward_cannot_score_scores_zero(addition, tmp_path, capsys):
    from bapo_megatron.evaluate import main

    (tmp_path / "h.jsonl").write_text('{"prompt": "1+2="}\n')  # no answer: the reward raises, as in training
    argv = [str(addition["model"]), str(tmp_path / "h.jsonl"), "--samples", "0", "--reward", "exact"]
    assert main([*argv, "--max-new-tokens", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["greedy_acc"] == 0.0


def _copy_model(addition, to: Path, tokenizer: bool = True, chat_template: str | None = None) -> Path:
    import shutil

    shutil.copytree(addition["model"], to)
    if not tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (to / name).unlink()
    if chat_template is not None:
        (to / "chat_template.jinja").write_text(chat_template)
    return to


def test_the_evaluator_reads_a_verl_parquet_with_the_runs_field_map_chat_template_and_reward(
    addition, tmp_path, capsys
):
    """A parquet file of chat-message prompts and nested answers (verl's layout), read through a run's
    config (field map, reward, lengths, k) with the model's chat template, scores what the same
    records as plain text and answers score: every greedy answer right, where the answers are the
    model's greedy continuations."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bapo_megatron.evaluate import evaluate_hf, main

    # a template that writes the user's text alone: the rendered prompt is the jsonl's text prompt
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    model = _copy_model(addition, tmp_path / "model", chat_template=template)
    rows = _greedy_answers(addition["model"], addition["heldout"])
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    verl = [{"prompt": [{"role": "user", "content": r["prompt"]}], "reward_model": {"ground_truth": r["answer"]}}
            for r in rows]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "heldout.parquet")
    config = tmp_path / "run.yaml"
    config.write_text(
        "data: {answer_field: reward_model.ground_truth}\nreward: {function: exact}\n"
        f"rollout: {{sampling: {{max_new_tokens: 6}}}}\neval: {{samples: 2, path: {tmp_path / 'heldout.parquet'}}}\n"
    )
    assert main([str(model), "--config", str(config), f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    captured = capsys.readouterr()
    assert '"reward": "exact"' in captured.err and '"max_new_tokens": 6' in captured.err, captured.err
    want = evaluate_hf(addition["model"], tmp_path / "heldout.jsonl", reward="exact", samples=2, max_new_tokens=6)
    assert json.loads(captured.out) == want and want["greedy_acc"] == 1.0 and want["prompts"] == 8


def test_the_evaluator_takes_the_runs_tokenizer_or_none_for_token_ids(addition, tmp_path, capsys):
    """An export without a tokenizer: text prompts are refused naming it, evaluated with the
    tokenizer of the config's model.hf_path; prompts of token ids need none."""
    from bapo_megatron.evaluate import main

    bare = _copy_model(addition, tmp_path / "bare", tokenizer=False)
    heldout, flags = str(addition["heldout"]), ["--reward", "exact", "--max-new-tokens", "6", "--samples", "0"]
    assert main([str(bare), heldout, *flags]) == 2
    err = capsys.readouterr().err
    assert f"{heldout} record 1" in err and f"{bare} has no tokenizer" in err, err
    assert main([str(bare), heldout, *flags, f"model.hf_path={addition['model']}"]) == 0
    borrowed = json.loads(capsys.readouterr().out)
    assert main([str(addition["model"]), heldout, *flags]) == 0
    assert borrowed == json.loads(capsys.readouterr().out)
    (tmp_path / "ids.jsonl").write_text('{"prompt": [3, 4, 5], "answer": ""}\n')
    assert main([str(bare), str(tmp_path / "ids.jsonl"), *flags]) == 0  # text is "" without a tokenizer
    assert json.loads(capsys.readouterr().out)["greedy_acc"] == 1.0


def test_the_evaluators_help_shows_its_defaults(capsys):
    from bapo_megatron.config import JobConfig
    from bapo_megatron.evaluate import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    base = JobConfig()
    for key, value in (
        ("rollout.sampling.max_new_tokens", base.rollout.sampling.max_new_tokens),
        ("eval.samples", base.eval.samples),
        ("the reward section", repr(base.reward.function)),
        ("rollout.sampling.temperature", base.rollout.sampling.temperature),
    ):
        assert f"{key} of --config and the overrides; {value} when neither sets it" in text, key


def _metrics(run: Path, steps: int, with_bapo: bool) -> None:
    run.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "rollout/reward_mean": step / steps, "policy/entropy": 2 - step / steps}
        if with_bapo:
            record.update(
                {
                    "bapo/rho": 0.5,
                    "bapo/clip_low": 0.8,
                    "bapo/clip_high": 1.2 + step / 10,
                    "train/grad_norm": 1.0,
                    "rollout/response_length": 5.0,
                    "rollout/token_staleness_mean": 0.5,
                    "rollout/token_staleness_max": 2.0,
                    "loss/kl": 0.01 * step,
                    "rollout/filtered_groups": 3.0,
                    "rollout/filter_shortfall": 0.0,
                    "moe/load_max": 1.5,
                    "moe/router_disagreement": 0.02,
                    "rollout_corr/kl": 0.001,
                    "rollout_corr/k3_kl": 0.001,
                    "rollout_corr/token_mult_prob_error_same_version": 1.01,
                    "rollout_corr/token_mult_prob_error_older": 1.05,
                    "rollout_corr/ppl_ratio": 1.0,
                    "rollout_corr/rollout_is_mean": 1.0,
                    "rollout_corr/rollout_is_oob_ratio": 0.01,
                    "rollout_corr/rollout_rs_masked_fraction": 0.02,
                    "rollout_corr/rollout_rs_seq_masked_fraction": 0.1,
                }
            )
        if step % 5 == 0:
            record.update({"eval/greedy_acc": 0.1 * step, "eval/avg@4": 0.05 * step, "eval/pass@4": 0.2})
        lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_plot_run_draws_every_panel(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import plot_run

    _metrics(tmp_path / "a", 20, with_bapo=True)
    _metrics(tmp_path / "b", 10, with_bapo=False)
    out = tmp_path / "plots.png"
    drawn = plot_run.plot([tmp_path / "a", tmp_path / "b"], out)
    assert drawn == [panel.title for panel in plot_run.PANELS]  # every panel had data from run a
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert plot_run.main([str(tmp_path / "b"), "--out", str(tmp_path / "b.png")]) == 0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    assert plot_run.main([str(tmp_path / "bad")]) == 2
    for out in (tmp_path / "nowhere" / "p.png", tmp_path):  # no such directory; a directory
        assert plot_run.main([str(tmp_path / "b"), "--out", str(out)]) == 2
    (tmp_path / "odd").mkdir()  # an infinity, a flag, text: left off the axes, not a crash
    (tmp_path / "odd" / "metrics.jsonl").write_text(
        '{"step": 1, "policy/entropy": Infinity}\n{"step": 2, "policy/entropy": true, "bapo/rho": "x"}\n'
    )
    assert plot_run.main([str(tmp_path / "odd"), "--out", str(tmp_path / "odd.png")]) == 0


def test_plot_run_names_a_bad_file(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import plot_run

    (tmp_path / "metrics.jsonl").write_text('\n{"step": "one"}\n')  # line 2: blank lines count
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: a record needs an integer step"):
        plot_run.read_metrics(tmp_path)
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        plot_run.read_metrics(tmp_path / "missing")


def test_plot_run_groups_seeds_of_a_method_under_one_colour_and_legend(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import matplotlib.figure
    import plot_run

    runs = []
    for method in ("bapo", "ppo"):
        for seed in range(3):
            _metrics(tmp_path / f"{method}-s{seed}", 10, with_bapo=method == "bapo")
            runs.append(tmp_path / f"{method}-s{seed}")
    legends = []
    original = matplotlib.figure.Figure.legend
    monkeypatch.setattr(
        matplotlib.figure.Figure,
        "legend",
        lambda self, *a, **k: legends.append([t.get_text() for t in original(self, *a, **k).get_texts()]),
    )
    groups = ["bapo"] * 3 + ["ppo"] * 3
    plot_run.plot(runs, tmp_path / "six.png", groups=groups)
    assert legends == [["bapo", "ppo"]]  # one figure legend, one entry a group, not 6 x 8 panel legends
    with pytest.raises(ValueError, match="5 groups for 6 runs"):
        plot_run.plot(runs, tmp_path / "bad.png", groups=groups[:5])


def test_plot_run_panels_read_metrics_the_package_logs():
    """Each panel's metric is a name the package writes (a renamed metric leaves no panel empty)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import plot_run

    source = "".join(path.read_text() for path in (ROOT / "bapo_megatron").rglob("*.py"))
    for panel in plot_run.PANELS:
        for key in panel.keys:
            # eval/ names are made per evaluation set, rollout_corr/ ones from parts (their own test:
            # tests/unit/test_rollout_correction.py)
            if not key.startswith(("eval/", "rollout_corr/")):
                assert f'"{key}"' in source, (panel.title, key)


@pytest.fixture
def figures(monkeypatch):
    """The axes of each figure plot_run saves, by title."""
    import matplotlib.figure

    saved = []
    original = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append({ax.get_title(): ax for ax in self.axes if ax.axison})
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return saved


def test_plot_run_shows_optional_panels_only_where_logged(tmp_path, figures):
    sys.path.insert(0, str(ROOT / "tools"))
    import plot_run

    _metrics(tmp_path / "plain", 4, with_bapo=False)
    optional = {panel.title for panel in plot_run.PANELS if panel.optional}
    assert plot_run.plot([tmp_path / "plain"], tmp_path / "plain.png") == ["reward", "policy entropy"]
    assert optional and not optional & set(figures[-1])
    assert "gradient norm" in figures[-1]  # a panel of the paper's figure says "not logged" instead
    _metrics(tmp_path / "moe", 4, with_bapo=True)
    plot_run.plot([tmp_path / "plain", tmp_path / "moe"], tmp_path / "both.png")
    assert optional <= set(figures[-1])


def test_a_step_that_trains_nothing_has_no_rho(tmp_path, figures, capsys):
    """BAPO's rho is 1 where no token has an advantage (a share of nothing): not a figure to show."""
    sys.path.insert(0, str(ROOT / "tools"))
    import plot_run

    from bapo_megatron.config import LoggingConfig
    from bapo_megatron.logger import MetricLogger

    steps = {1: 0.5, 2: 0.0, 3: 0.25}  # policy/signal_tokens: the share of tokens with an advantage
    run = tmp_path / "run"
    logger = MetricLogger(LoggingConfig(backends=("console", "jsonl")), job_name="j", config={}, run_dir=run)
    for step, signal in steps.items():
        logger.log(step, {"policy/signal_tokens": signal, "bapo/rho": 1.0 if signal == 0 else 0.4, "loss/pg": 0.1})
    logger.close()
    console = capsys.readouterr().out.splitlines()
    assert ["rho=" in line for line in console] == [True, False, True], console
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert ["bapo/rho" in r for r in records] == [True, False, True]
    # a log written before the logger left it out: the plot leaves it out
    old = tmp_path / "old"
    old.mkdir()
    lines = [{"step": s, "policy/signal_tokens": g, "bapo/rho": 1.0 if g == 0 else 0.4} for s, g in steps.items()]
    lines.append({"step": 4, "advantage/zero_group_frac": 1.0, "bapo/rho": 1.0})  # before signal_tokens was logged
    (old / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    plot_run.plot([old], tmp_path / "old.png")
    (line,) = figures[-1]["positive contribution rho"].get_lines()
    assert list(line.get_xdata()) == [1, 3]


def test_plot_run_draws_one_reward_line_a_run(tmp_path, figures):
    """The loop logs its reward under two names (the rollout's and the advantage's): one line, one
    legend entry."""
    sys.path.insert(0, str(ROOT / "tools"))
    import plot_run

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "rollout/reward_mean": 0.1 * s, "advantage/reward_mean": 0.1 * s} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    plot_run.plot([run], tmp_path / "r.png")
    reward = figures[-1]["reward"]
    assert [t.get_text() for t in reward.get_legend().get_texts()] == ["run"]
    assert len(reward.get_lines()) == 1
