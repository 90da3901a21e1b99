"""benchmarks/bench_vs_trl.py's pairs sample the seeds: one seed's prompts and samples decide a run's
held-out accuracy, so pairs that repeated one seed measured one draw (the project's 0.40 against
TRL's 0.54 at seed 0, while other seeds give both 0.53-0.60)."""

import importlib.util
import json
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "benchmarks" / "bench_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(**over) -> Namespace:
    base = {"pairs": 3, "steps": 2, "warmup": 0, "prompts": 2, "samples": 2, "max_new": 6, "lr": 3e-4}
    return Namespace(**{**base, "seed": 5, "eval_prompts": 0, "stacks": ["project", "trl"], **over})


def test_each_pair_runs_its_own_seed_in_both_stacks(bench, monkeypatch, tmp_path):
    seen = []

    def runner(stack):
        def run(warm, out, args):
            seen.append((stack, args.seed))
            steps = [dict.fromkeys(bench.SPLIT, 1.0) | {"tokens": 1}]
            return {"steps": steps, "peak_rss": 1, "peak_pss": 1, "model": out}

        return run

    monkeypatch.setattr(bench, "run_project", runner("project"))
    monkeypatch.setattr(bench, "run_trl", runner("trl"))
    bench.side_by_side({}, _args(out=str(tmp_path)))
    assert seen == [("project", 5), ("trl", 5), ("project", 6), ("trl", 6), ("project", 7), ("trl", 7)]


def test_the_project_seed_moves_its_prompt_order_as_trl_seed_does(bench, monkeypatch, tmp_path):
    commands = []

    def measured(command, env, log):
        commands.append(command)
        out = Path(next(c for c in command if c.startswith("run_dir=")).split("=", 1)[1])
        out.mkdir(parents=True)
        record = {"time/step": 1.0, "rollout/seconds": 0.5, "time/train": 0.4, "rollout/tokens": 8}
        (out / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        return {"peak_rss": 1, "peak_pss": 1}

    monkeypatch.setattr(bench, "_run_measured", measured)
    warm = dict.fromkeys(("model", "ckpt", "train"), tmp_path)
    bench.run_project(warm, tmp_path / "run", _args(seed=7))
    assert "seed=7" in commands[0] and "data.seed=7" in commands[0]


def test_the_summary_gives_the_accuracy_over_the_seeds_with_its_standard_error(bench):
    step = dict.fromkeys(bench.SPLIT, 1.0) | {"tokens": 1}
    runs = [{"steps": [step], "peak_rss": 1, "peak_pss": 1, "accuracy": a} for a in (0.40, 0.55, 0.60)]
    out = bench.summary(runs)
    assert out["accuracy_after"] == 0.55 and out["accuracy_after_range"] == [0.40, 0.60]
    assert out["accuracy_mean"] == pytest.approx(0.5166667)
    assert out["accuracy_sem"] == pytest.approx(0.0600925)  # stdev 0.1040833 over sqrt(3)
    assert bench.summary(runs[:1])["accuracy_sem"] is None
