"""Rollout routing replay (R3) under off-policy staleness: a tiny Qwen3-MoE, seeds x {off, on}.

    python examples/moe_replay_study/run.py                      # 3 seeds x 2 arms (see README.md)
    python examples/moe_replay_study/run.py --seeds 0 --steps 4  # a smoke run
    python examples/moe_replay_study/run.py --summary-only       # the table again, from results.json

The regime real MoE RL runs are in, at toy size: the engine generates in bfloat16 (the embedded
engine, rollout.engines.dtype), the trainer trains in float32, asynchronously with tokens up to 2
versions stale (rollout.mode async, max_staleness 2), BAPO as the loss. Both arms record the
engine's routes (rollout.record_routes), so both measure how often the trainer's routers would
choose other experts than the engine did (moe/router_disagreement); the "on" arm replays the
engine's routes in training (algo.routing_replay). Per run: the mean over steps of the log-prob
mismatch on tokens the very weights sampled (rollout_corr/train_rollout_logprob_abs_diff_same_version:
the train-inference mismatch proper), of the mismatch over all tokens (staleness included), of the
router disagreement and of BAPO's positive share of the loss; and the final held-out greedy
accuracy. Asynchronous at staleness 2, every token after the first step is 2 versions old: the
mismatch and disagreement there mix the policy's own change with the engine's numerics. The first
step's tokens were sampled by the starting weights, which the trainer still holds: its mismatch
and disagreement (first_mismatch, first_disagreement) are the engine's numerics alone (bf16
against fp32). The table gives each arm's median over seeds with its range.

Every run starts from the same supervised warm start (examples/demo.py's phases 1-2 with the tiny
Qwen3-MoE of bapo_megatron/tasks.py, made under OUT/warm when missing), with the same budget; runs
go seed by seed, both arms in turn, so a slow spell of the machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ARMS = {"off": ["algo.routing_replay=false"], "on": ["algo.routing_replay=true"]}
REGIME = ["rollout.record_routes=true", "algo.loss=bapo"]
"""Beside the demo's STALE_BF16_REGIME."""
FIRST_STEP = {  # record key: the metric at the first step, whose tokens the starting weights sampled
    "first_mismatch": "rollout_corr/train_rollout_logprob_abs_diff_same_version",
    "first_disagreement": "moe/router_disagreement",
}
PER_RUN = {  # record key: the metric whose mean over the run's steps it is (where reported)
    "mismatch_all": "rollout_corr/train_rollout_logprob_abs_diff",
    "router_disagreement": "moe/router_disagreement",
    "positive_loss_share": "policy/positive_loss_share",
    "load_max": "moe/load_max",
}


def train(args, warm: dict, seed: int, arm: str) -> Path:
    from demo import STALE_BF16_REGIME, study_command

    run = args.out / "runs" / f"{arm}-s{seed}"
    shutil.rmtree(run, ignore_errors=True)
    command = [*study_command(warm, run, args, seed), *STALE_BF16_REGIME, *REGIME, *ARMS[arm]]
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL if args.quiet else None)
    if done.returncode:
        raise SystemExit(f"moe_replay_study: replay {arm}, seed {seed} failed (exit {done.returncode})")
    return run


def summarise(run: Path, arm: str, seed: int) -> dict:
    """One run's record: per-run means of PER_RUN's metrics, the final held-out greedy accuracy."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in rows if "policy/entropy" in r]
    evals = [r for r in rows if "eval/greedy_acc" in r]
    if not trained or not evals:
        raise SystemExit(f"moe_replay_study: {run} logged no trained step or no final evaluation")
    record = {"arm": arm, "seed": seed, "steps": len(trained), "greedy_acc": evals[-1]["eval/greedy_acc"]}
    for key, name in PER_RUN.items():
        values = [r[name] for r in trained if r.get(name) is not None]
        record[key] = statistics.fmean(values) if values else None
    for key, name in FIRST_STEP.items():
        record[key] = trained[0].get(name)
    return record


def table(records: list[dict]) -> str:
    """Markdown: each arm's median over seeds and its [min, max], per figure."""
    keys = [*FIRST_STEP, *PER_RUN, "greedy_acc"]
    lines = ["| replay | seeds | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for arm in ARMS:
        mine = [r for r in records if r["arm"] == arm]
        if not mine:
            continue
        cells = []
        for key in keys:
            values = sorted(r[key] for r in mine if r[key] is not None)
            cells.append(f"{statistics.median(values):.4g} [{values[0]:.4g}, {values[-1]:.4g}]" if values else "n/a")
        lines.append(f"| {arm} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="repeat")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=15, help="rollout batches per run")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts scored before and after")
    parser.add_argument("--warm-target", type=float, default=0.4, help="the warm start's greedy batch accuracy")
    parser.add_argument("--warm-steps", type=int, default=None, help="the warm start's steps at most")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "moe_replay_study", help="OUT")
    parser.add_argument("--quiet", action="store_true", help="keep the runs' console output out")
    parser.add_argument("--summary-only", action="store_true", help="print OUT's table from its results.json")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    results = args.out / "results.json"
    if not args.summary_only:
        run_study(args, results)
    summary = table(json.loads(results.read_text())["runs"])
    (args.out / "summary.md").write_text(summary + "\n")
    print(summary)
    return 0


def run_study(args, results: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from demo import warm_start

    budget = {"task": args.task, "steps": args.steps, "prompts": args.prompts, "samples": args.samples}
    previous = json.loads(results.read_text()) if results.is_file() else {"budget": budget, "runs": []}
    if previous["budget"] != budget:
        raise SystemExit(f"moe_replay_study: {results} holds runs of budget {previous['budget']}, not {budget}")
    warm = warm_start(
        args.task,
        args.out / "warm",
        seed=0,
        heldout=max(args.eval_prompts, 200),
        target=args.warm_target,
        steps=args.warm_steps,
        architecture="qwen3_moe",
    )
    records = {(r["arm"], r["seed"]): r for r in previous["runs"]}
    for seed in args.seeds:
        for arm in args.arms:
            print(f"=== replay {arm}, seed {seed}", flush=True)
            t = time.monotonic()
            record = summarise(train(args, warm, seed, arm), arm, seed)
            record["wall_s"] = round(time.monotonic() - t, 1)
            records[(arm, seed)] = record
            study = {"budget": budget, "sft_steps": warm["sft_steps"], "runs": sorted(records.values(), key=str)}
            results.write_text(
                json.dumps(study, indent=1) + "\n"
            )  # after every run: an interrupted study keeps what ran


sys.path.insert(0, str(ROOT))

if __name__ == "__main__":
    raise SystemExit(main())
