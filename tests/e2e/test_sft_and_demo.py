"""The supervised warm start and the demo end to end.

- `algo.loss=sft` lowers the answers' cross-entropy on the addition task, and its checkpoint
  is where an RL run at another layout (TP=2 under torchrun) starts: with a negligible learning
  rate the RL run's exported weights are the warm start's, and the engine it syncs agrees with it.
- `examples/demo.py --quick`: task, SFT, BAPO, export, transformers evaluation, plots and
  summary.json, as `make demo` runs them (fewer steps and prompts).
- the clipping study (`examples/compare_clipping/run.py`) at toy size.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bapo_megatron.tasks import write_task
from tests.online import PORTS, engine_port, metrics, no_engine_left, torchrun, train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def export(checkpoint: Path, template: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from bapo_megatron.trainer.checkpoint import weights_dir

    command = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "mcore-to-hf"]
    command += ["--mcore", str(weights_dir(checkpoint)), "--out", str(out), "--hf-template", str(template)]
    done = subprocess.run([*command, "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def teacher_forced_accuracy(model_dir: Path, records: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """With transformers: whether each answer token (and the end token) is the argmax given the
    true prefix, and whether all of a record's are (what greedy decoding answers exactly)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    per_token, per_answer = [], []
    for line in records.read_text().splitlines():
        rec = json.loads(line)
        prompt = tok(rec["prompt"], add_special_tokens=False)["input_ids"]
        answer = [*tok(rec["answer"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0]
        right = logits[len(prompt) - 1 : -1].argmax(-1) == torch.tensor(answer)
        per_token.append(right)
        per_answer.append(bool(right.all()))
    return torch.cat(per_token), torch.tensor(per_answer)


def test_stop_when_ends_a_run_as_finished_and_it_stays_ended(tmp_path):
    """The mean of train/step over the last 2 steps reaches 4 after step 5 (4.5; 3.5 after step 4):
    the run ends there, saved and "finished"; the same command again trains nothing more; another
    rule resumes it (its window refills from the resumed steps)."""
    task = write_task("addition", tmp_path / "task", train=600, heldout=10)
    run = tmp_path / "sft"
    argv = [
        str(ROOT / "examples" / "demo" / "sft.yaml"),
        f"model.hf_path={task['model']}",
        f"data.path={task['train']}",
        "logging.backends=[jsonl]",
        "logging.interval=1",
        "rollout.prompts_per_step=8",
        "steps=50",
        "stop_when=train/step>=4",
        "stop_window=2",
        f"run_dir={run}",
        f"checkpoint.dir={run / 'ckpt'}",
    ]
    out = train(argv)
    assert "stop_when: the mean train/step of the last 2 steps >= 4: the run ends at step 5 of 50" in out
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4, 5]
    status = json.loads((run / "status.json").read_text())
    assert status == {
        "state": "finished",
        "reason": "stop_when",
        "step": 5,
        "steps": 50,
        "signal": None,
        "stop_when": "train/step>=4",
    }
    assert (run / "ckpt" / "step_00000005").is_dir()
    train(argv)  # resumes at step 5, and stays ended
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4, 5]
    assert json.loads((run / "status.json").read_text()) == status
    train([*argv, "stop_when=train/step>=6"])  # another rule: it goes on (6.5 after step 7)
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4, 5, 6, 7]


def test_sft_warm_start_learns_and_an_rl_run_at_tp2_starts_from_it(tmp_path):
    task = write_task("addition", tmp_path / "task", train=2000, heldout=50)
    sft, rl = tmp_path / "sft", tmp_path / "rl"
    port = engine_port()
    PORTS.setdefault(rl, []).append(port)
    common = [f"model.hf_path={task['model']}", f"data.path={task['train']}", "logging.backends=[jsonl]"]
    train(
        [
            str(ROOT / "examples" / "demo" / "sft.yaml"),
            *common,
            "steps=16",
            "optimizer.warmup_steps=0",
            "logging.interval=1",
            f"run_dir={sft}",
            f"checkpoint.dir={sft / 'ckpt'}",
        ]
    )
    losses = [m["loss/sft"] for m in metrics(sft)]
    assert len(losses) == 16 and sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    logged = set().union(*metrics(sft))  # supervised samples have no reward: nothing claims one
    assert not any(k.startswith("advantage/") or k.startswith("rollout/reward") for k in logged), sorted(logged)
    before = export(sft / "ckpt", task["model"], tmp_path / "sft-hf")

    # sft/token_acc and sft/answer_acc are transformers' teacher-forced argmax accuracies of the
    # same weights on the same records: one step on the 50 held-out records, learning rate ~0
    probe = tmp_path / "probe"
    train(
        [
            str(ROOT / "examples" / "demo" / "sft.yaml"),
            *common[:1],
            f"data.path={task['heldout']}",
            "data.shuffle=false",
            "logging.backends=[jsonl]",
            "logging.interval=1",
            f"model.mcore_path={sft / 'ckpt'}",
            "rollout.prompts_per_step=25",
            "rollout.samples_per_prompt=2",
            "optimizer.lr=1e-12",
            "steps=1",
            f"run_dir={probe}",
        ]
    )
    (record,) = metrics(probe)
    tokens, answers = teacher_forced_accuracy(tmp_path / "sft-hf", task["heldout"])
    assert 0.2 < tokens.float().mean() < 1  # neither trivial nor saturated
    assert abs(record["sft/token_acc"] - tokens.float().mean().item()) <= 1 / tokens.numel() + 1e-9
    assert abs(record["sft/answer_acc"] - answers.float().mean().item()) <= 1 / answers.numel() + 1e-9
    train(
        [
            str(ROOT / "examples" / "demo" / "rl.yaml"),
            *common,
            f"model.mcore_path={sft / 'ckpt'}",
            f"eval.path={task['heldout']}",
            "eval.max_prompts=8",
            "steps=1",
            "optimizer.lr=1e-12",
            "parallel.tensor=2",
            "rollout.prompts_per_step=4",
            "rollout.sync.check_every=1",
            f"rollout.engines.port={port}",
            f"run_dir={rl}",
            f"checkpoint.dir={rl / 'ckpt'}",
        ],
        launcher=torchrun(2),
    )
    (record,) = [m for m in metrics(rl) if "train/grad_norm" in m][-1:]
    assert record["sync/probe_logprob_gap"] <= 1e-5  # the engine serves what the TP=2 trainer loaded
    assert {"eval/greedy_acc", "eval/avg@4", "eval/pass@4"} <= metrics(rl)[0].keys()  # before the first step
    after = export(rl / "ckpt", task["model"], tmp_path / "rl-hf")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=1e-6, msg=name)
    no_engine_left(tmp_path)


def test_quick_demo_runs_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--quick", "--runs", str(tmp_path), "--name", "demo"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "demo"
    summary = json.loads((run / "summary.json").read_text())
    for key in ("accuracy_before_rl", "accuracy_after_rl", "steps", "wall_seconds", "hf_export_dir"):
        assert key in summary, key
    assert 0 <= summary["accuracy_before_rl"] <= 1 and 0 <= summary["accuracy_after_rl"] <= 1
    assert summary["steps"] == 3 and summary["heldout_prompts"] == 100
    assert (Path(summary["hf_export_dir"]) / "config.json").is_file()
    assert any(Path(summary["hf_export_dir"]).glob("*.safetensors"))
    for png in summary["plots"]:
        assert Path(png).read_bytes()[:4] == b"\x89PNG" and Path(png).stat().st_size > 10_000
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl"):
        assert (run / "rl" / name).stat().st_size > 0, name
    assert "held-out greedy accuracy" in done.stdout
    # the quick run's BAPO steps have rewards that differ within groups, and it says what it checks
    assert "trains on nothing" not in done.stdout + done.stderr
    assert "--quick checks the plumbing only" in done.stdout and summary["quick"] is True
    records = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("train/grad_norm", 0) > 0 for r in records)  # its updates had advantages to follow
    # Megatron's notices that Transformer Engine and Apex are missing (the CPU default's fallbacks)
    # are kept in each run's warnings.log, off the console
    assert "Apex is not installed" not in done.stdout + done.stderr
    assert "Apex is not installed" in (run / "rl" / "warnings.log").read_text()


def test_clipping_study_smoke(tmp_path):
    """examples/compare_clipping/run.py at toy size: its own warm start of the repeat task, a method
    at two staleness settings (experience reuse and asynchronous), one seed; a rerun of another
    method adds its records and keeps the others; results.json, summary.md and the figures of
    both; a rerun with another budget is refused before it trains."""
    out = tmp_path / "study"
    study = [sys.executable, str(ROOT / "examples" / "compare_clipping" / "run.py"), "--out", str(out), "--quiet"]
    study += ["--warm-steps", "8", "--steps", "2", "--prompts", "8", "--samples", "4", "--eval-prompts", "10"]
    done = subprocess.run(
        [*study, "--methods", "ppo", "--staleness", "2", "async4", "--seeds", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = json.loads((out / "results.json").read_text())
    assert first["task"] == "repeat" and first["budget"]["steps"] == 2

    subset = [*study, "--methods", "bapo", "--staleness", "async4", "--seeds", "0"]
    done = subprocess.run(subset, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [r for r in results["runs"] if r["method"] != "bapo"] == first["runs"]  # kept as they were
    runs = {(r["method"], r["staleness"]): r for r in results["runs"]}
    assert set(runs) == {("ppo", "2"), ("ppo", "async4"), ("bapo", "async4")}
    for record in runs.values():
        assert record["seed"] == 0 and 0 <= record["greedy_acc"] <= 1 and 0 <= record["pass@4"] <= 1
        assert [s["step"] for s in record["steps"]] == [1, 2]
        for step in record["steps"]:
            for share in ("positive_loss_share", "negative_token_share"):  # None: no group had an advantage
                assert share in step and (step[share] is None or 0 <= step[share] <= 1)
            assert step["entropy"] > 0 and step["reward"] is not None
    assert {s["clip_low"] for s in runs[("ppo", "2")]["steps"]} == {0.8}
    assert max(s["token_staleness_max"] for s in runs[("ppo", "async4")]["steps"]) <= 4
    table = (out / "summary.md").read_text()
    assert "| 2 | ppo | 1 |" in table and "| async4 | bapo | 1 |" in table
    for name in ("fig2_reward_entropy", "fig4_positive_share", "fig9_bapo_bounds"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name

    study[study.index("--steps") + 1] = "3"
    done = subprocess.run([*study, "--methods", "ppo", "--staleness", "1"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "holds runs of budget" in done.stderr
    assert not (out / "runs" / "ppo-1-s0").exists()  # refused before it trained
