"""BAPO against fixed clipping in the paper's off-policy regime: methods x staleness x seeds.

    python examples/compare_clipping/run.py                      # the whole study (see README.md)
    python examples/compare_clipping/run.py --methods ppo bapo --staleness 8 --seeds 0   # any subset
    python examples/compare_clipping/run.py --figures-only       # redraw from results.json

Staleness is the paper's (Fig. 2): experience reuse, N optimizer updates on each rollout batch
(`algo.updates_per_batch`: "1", "2", "4", "8"; the authors' recipe is 8), generated on-policy and
in full; and "async4": asynchronous generation (`rollout.mode: async`, tokens up to 4 versions
stale), one update per batch. Methods:
  ppo             fixed bounds (0.8, 1.2)
  clip_higher     fixed bounds (0.8, 1.28), DAPO's
  bapo            BAPO, the seed preset (rho0 0.5, c_low 0.6..0.9, c_high 1.2..3.0), contribution on the loss
  bapo-gradient   the same, contribution of the tokens the bounds let through
Every run starts from the same supervised warm start of the task (examples/demo.py's phases 1-2,
made under OUT/warm when missing) with the same budget: the same steps, prompts, samples and
learning rate. Runs go seed by seed, and within a seed staleness by staleness, every method in
turn, so a slow spell of the machine hits every method alike.

OUT/results.json holds one record per run (method, staleness, seed, the final held-out greedy
accuracy, avg@k and pass@k, and per step the reward, policy entropy, the positive share of the
loss and the negative share of the tokens (measured alike for every method), bapo/rho, the
bounds and token staleness); a rerun of a subset replaces its records and keeps the others.
OUT/figures.py draws the figures and summary.md from it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

METHODS = {
    "ppo": ["algo.loss=ppo", "algo.ppo_eps=0.2"],
    "clip_higher": ["algo.loss=clip_higher", "algo.clip_higher_low=0.8", "algo.clip_higher_high=1.28"],
    "bapo": ["algo.loss=bapo", "algo.bapo.preset=seed", "algo.bapo.contribution=loss"],
    "bapo-gradient": ["algo.loss=bapo", "algo.bapo.preset=seed", "algo.bapo.contribution=gradient"],
}
ON_POLICY = [
    "rollout.mode=sync",
    "rollout.partial.enabled=false",
    "rollout.partial.token_budget=null",
    "rollout.oversample=1.0",
]
STALENESS = {
    "1": [*ON_POLICY, "algo.updates_per_batch=1"],
    "2": [*ON_POLICY, "algo.updates_per_batch=2"],
    "4": [*ON_POLICY, "algo.updates_per_batch=4"],
    "8": [*ON_POLICY, "algo.updates_per_batch=8"],
    "async4": [
        "rollout.mode=async",
        "rollout.partial.enabled=false",
        "rollout.partial.token_budget=null",
        "rollout.max_staleness=4",
        "rollout.oversample=2.0",
        "algo.updates_per_batch=1",
    ],
}
PER_STEP = {
    "reward": "rollout/reward_mean",
    "entropy": "policy/entropy",
    "positive_loss_share": "policy/positive_loss_share",
    "negative_token_share": "policy/negative_token_share",
    "rho": "bapo/rho",
    "rho_start": "bapo/rho_start",
    "clip_low": "bapo/clip_low",
    "clip_high": "bapo/clip_high",
    "response_length": "rollout/response_length",
    "token_staleness_mean": "rollout/token_staleness_mean",
    "token_staleness_max": "rollout/token_staleness_max",
}


def grid(seeds: list[int], staleness: list[str], methods: list[str]) -> list[tuple[int, str, str]]:
    """(seed, staleness, method) in the order the runs go: interleaved, every method in turn."""
    return [(seed, s, m) for seed in seeds for s in staleness for m in methods]


def summarise(run: Path, method: str, staleness: str, seed: int, k: int) -> dict:
    """One run's record in results.json, from its metrics.jsonl."""
    from plot_run import read_metrics

    rows = read_metrics(run)
    trained = [r for r in rows if "policy/entropy" in r]
    evals = [r for r in rows if "eval/greedy_acc" in r]
    if not trained or not evals:
        raise SystemExit(f"compare_clipping: {run} logged no trained step or no final evaluation")
    final = evals[-1]
    return {
        "method": method,
        "staleness": staleness,
        "seed": seed,
        "greedy_acc": final["eval/greedy_acc"],
        f"avg@{k}": final[f"eval/avg@{k}"],
        f"pass@{k}": final[f"eval/pass@{k}"],
        "greedy_acc_start": evals[0]["eval/greedy_acc"] if evals[0]["step"] == 0 else None,
        "steps": [{"step": r["step"], **{key: r.get(name) for key, name in PER_STEP.items()}} for r in trained],
    }


def train(args, warm: dict, seed: int, staleness: str, method: str) -> Path:
    from demo import study_command

    run = args.out / "runs" / f"{method}-{staleness}-s{seed}"
    shutil.rmtree(run, ignore_errors=True)
    command = [
        *study_command(warm, run, args, seed),
        f"eval.samples={args.k}",
        f"rollout.sampling.max_new_tokens={TASKS[args.task].max_new_tokens}",
        *STALENESS[staleness],
        *METHODS[method],
    ]
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL if args.quiet else None)
    if done.returncode:
        what = f"{method} at staleness {staleness}, seed {seed}"
        raise SystemExit(f"compare_clipping: {what} failed (exit {done.returncode})")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="repeat", choices=sorted(TASKS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--staleness", nargs="+", default=list(STALENESS), choices=list(STALENESS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20, help="rollout batches per run")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per batch (a multiple of 8)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts scored before and after")
    parser.add_argument("-k", type=int, default=4, help="samples per held-out prompt for avg@k and pass@k")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "compare_clipping", help="OUT")
    parser.add_argument("--warm-target", type=float, default=0.4, help="the warm start's greedy batch accuracy")
    parser.add_argument("--warm-steps", type=int, default=None, help="the warm start's steps at most")
    parser.add_argument("--quiet", action="store_true", help="keep the runs' console output out")
    parser.add_argument("--figures-only", action="store_true", help="redraw OUT's figures from its results.json")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    results_path = args.out / "results.json"
    if not args.figures_only:
        run_study(args, results_path)
    from figures import draw

    drawn = draw(results_path, args.out)
    print("\n" + (args.out / "summary.md").read_text())
    print("figures: " + ", ".join(str(p) for p in drawn))
    return 0


def run_study(args, results_path: Path) -> None:
    if any(args.prompts % int(s) for s in args.staleness if s.isdigit()):
        raise SystemExit(f"compare_clipping: --prompts {args.prompts} must split into every staleness's updates")
    budget = {"steps": args.steps, "prompts": args.prompts, "samples": args.samples}
    budget.update({"eval_prompts": args.eval_prompts, "k": args.k})
    previous = json.loads(results_path.read_text()) if results_path.is_file() else {"runs": []}
    for key, value in (("task", args.task), ("budget", budget)):
        if previous.get(key, value) != value:  # runs of another budget cannot stand beside these
            raise SystemExit(f"compare_clipping: {results_path} holds runs of {key} {previous[key]}, not {value}")
    sys.path.insert(0, str(ROOT / "examples"))
    from demo import warm_start

    warm_dir = args.out / "warm"
    heldout = max(args.eval_prompts, 200)
    warm = warm_start(args.task, warm_dir, seed=0, heldout=heldout, target=args.warm_target, steps=args.warm_steps)
    records = {(r["method"], r["staleness"], r["seed"]): r for r in previous["runs"]}
    started = time.monotonic()
    order = grid(args.seeds, args.staleness, args.methods)
    for i, (seed, staleness, method) in enumerate(order, 1):
        print(f"=== {i}/{len(order)}: {method}, staleness {staleness}, seed {seed}", flush=True)
        t = time.monotonic()
        run = train(args, warm, seed, staleness, method)
        record = summarise(run, method, staleness, seed, args.k)
        record["wall_s"] = round(time.monotonic() - t, 1)
        records[(method, staleness, seed)] = record
        study = {
            "task": args.task,
            "budget": budget,
            "warm_start": {"dir": str(warm_dir), "sft_steps": warm["sft_steps"]},
            "runs": sorted(records.values(), key=lambda r: (r["staleness"], r["method"], r["seed"])),
        }
        # after every run: an interrupted study keeps what ran
        results_path.write_text(json.dumps(study, indent=1) + "\n")
    print(f"{len(order)} runs in {time.monotonic() - started:.0f} s", flush=True)


sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(HERE))
from bapo_megatron.tasks import TASKS  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
