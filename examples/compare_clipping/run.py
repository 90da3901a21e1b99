"""BAPO against fixed clipping on the demo task under off-policy pressure, several seeds each.

    python examples/compare_clipping/run.py                    # 4 methods x 3 seeds, about 25 min on 2 cores
    python examples/compare_clipping/run.py --seeds 0 --steps 3 --eval-prompts 20   # a smoke run

Every run starts from the same supervised warm start (the demo's: `examples/demo.py` makes
it when it is missing) and gets the same budget: rollout.max_staleness 4 with partial
rollout (responses cut every 2 tokens), 4 updates per batch, the same steps, prompts and
learning rate. Methods:
  bapo-loss       BAPO, seed preset, contribution measured on the loss (the default)
  bapo-gradient   BAPO, seed preset, contribution of the tokens the bounds let through
  ppo             fixed bounds (0.8, 1.2)
  clip_higher     fixed bounds (0.8, 1.28), DAPO's
Writes RUNS/compare_clipping/: one run directory per method and seed, plots.png (the runs
overlaid, one colour a method), results.md (final held-out greedy accuracy, avg@4, pass@4,
mean policy entropy and rho over the last 10 steps, the share of steps at each BAPO bound
pair; mean and min-max over seeds) and results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = {
    "bapo-loss": ["algo.loss=bapo", "algo.bapo.contribution=loss"],
    "bapo-gradient": ["algo.loss=bapo", "algo.bapo.contribution=gradient"],
    "ppo": ["algo.loss=ppo", "algo.ppo_eps=0.2"],
    "clip_higher": ["algo.loss=clip_higher", "algo.clip_higher_low=0.8", "algo.clip_higher_high=1.28"],
}
PRESSURE = [
    "rollout.partial.enabled=true",
    "rollout.partial.token_budget=2",
    "rollout.max_staleness=4",
    "rollout.oversample=2.0",
    "algo.updates_per_batch=4",
]


def summarise(run: Path) -> dict[str, float]:
    from plot_run import read_metrics

    rows = read_metrics(run)
    trained = [r for r in rows if "policy/entropy" in r]
    last = trained[-10:]
    final = [r for r in rows if "eval/greedy_acc" in r][-1]
    bounds = Counter((r.get("bapo/clip_low"), r.get("bapo/clip_high")) for r in trained)
    top, count = bounds.most_common(1)[0]
    return {
        "greedy_acc": final["eval/greedy_acc"],
        "avg@4": final["eval/avg@4"],
        "pass@4": final["eval/pass@4"],
        "entropy": statistics.mean(r["policy/entropy"] for r in last),
        "rho": statistics.mean(r["bapo/rho"] for r in last),
        "top_bounds": f"[{top[0]:g}, {top[1]:g}]",
        "top_bounds_share": count / len(trained),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="RUNS")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-prompts", type=int, default=1000, help="held-out prompts scored after the last step")
    args = parser.parse_args(argv)
    out = args.runs.resolve() / "compare_clipping"
    demo = args.runs.resolve() / "demo"
    if not (demo / "sft" / "ckpt" / "latest").is_file():
        print("=== the warm start (examples/demo.py's first phases)", flush=True)
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "demo.py"), "--runs", str(args.runs), "--name", "demo"], cwd=ROOT
        )
        if done.returncode:
            raise SystemExit("compare_clipping: the demo (warm start) failed")
    task = demo / "task"
    sys.path.insert(0, str(ROOT / "tools"))
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        for method in args.methods:  # interleaved: a slow spell of the machine hits every method alike
            run = out / f"{method}-s{seed}"
            shutil.rmtree(run, ignore_errors=True)
            print(f"=== {method}, seed {seed}", flush=True)
            command = [
                sys.executable,
                "-m",
                "bapo_megatron.train",
                str(ROOT / "examples" / "demo" / "rl.yaml"),
                f"model.hf_path={task / 'model'}",
                f"model.mcore_path={demo / 'sft' / 'ckpt'}",
                f"data.path={task / 'train.jsonl'}",
                f"eval.path={task / 'heldout.jsonl'}",
                f"eval.max_prompts={args.eval_prompts}",
                "eval.interval=0",
                f"steps={args.steps}",
                f"seed={seed}",
                f"data.seed={seed}",
                f"run_dir={run}",
                "logging.backends=[jsonl]",
                *PRESSURE,
                *METHODS[method],
            ]
            done = subprocess.run(command, cwd=ROOT)
            if done.returncode:
                raise SystemExit(f"compare_clipping: {method} seed {seed} failed (exit {done.returncode})")
            results[method].append({"seed": seed, **summarise(run)})
    from plot_run import plot

    runs = [out / f"{m}-s{s}" for m in args.methods for s in args.seeds]
    plot(
        runs,
        out / "plots.png",
        labels=[f"{m} s{s}" for m in args.methods for s in args.seeds],
        groups=[m for m in args.methods for _ in args.seeds],
    )
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"{len(args.seeds)} seeds, {args.steps} steps each, {args.eval_prompts} held-out prompts; "
        "mean (min-max) over seeds",
        "",
        "| method | greedy acc | avg@4 | pass@4 | entropy (last 10) | rho (last 10) | most frequent bounds (share) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, rows in results.items():
        cells = []
        for key in ("greedy_acc", "avg@4", "pass@4", "entropy", "rho"):
            values = [r[key] for r in rows]
            cells.append(f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})")
        tops = Counter(r["top_bounds"] for r in rows).most_common(1)[0][0]
        share = statistics.mean(r["top_bounds_share"] for r in rows if r["top_bounds"] == tops)
        lines.append(f"| {method} | {' | '.join(cells)} | {tops} ({share:.0%}) |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nplots: {out / 'plots.png'}\nresults: {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
