"""Rollout correction under a real engine-trainer gap: corrections x {ppo, bapo} x seeds x {dense, MoE}.

    python examples/rollout_corr_study/run.py                     # the study of README.md
    python examples/rollout_corr_study/run.py --quick             # the plumbing: 1 seed, 2 arms, 2 steps
    python examples/rollout_corr_study/run.py --measure           # the gap's size only (README.md, step 1)
    python examples/rollout_corr_study/run.py --summary-only      # the tables again, from results.json

The regime of issue 45: the repeat task, the embedded engine in bf16 and the trainer in fp32,
asynchronous with tokens up to 2 versions stale, from a supervised warm start (examples/demo.py's
phases 1-2, made under OUT/{dense,moe}/warm when missing). The engine's weights are quantised to
LEVELS levels a sign (engine_quantization.py), because the bf16 gap alone puts no weight outside
verl's bounds: --measure gives the size of both. Per arm (model, routing replay, loss, correction)
and seed one run; its record holds the mean over its steps of the rollout_corr/ metrics and of
BAPO's positive share, the first step's figures (its tokens were sampled by the weights the trainer
still holds: the engine gap alone) and the final held-out greedy accuracy (through the engine, as
served). Runs go seed by seed, every arm in turn, so that a slow spell of the machine hits all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LEVELS = 2
"""Engine weights in {-2, ..., 2} x a scale per row (5 values, 2.3 bits): the measured gap puts 5-8%
of tokens outside [0.5, 2] (README.md); 3 levels (int3) put 1.6-3.9%, 1 level (ternary) 43%."""
RC = "algo.rollout_correction."
CORRECTIONS = {
    "none": [],
    "token_tis": [f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=2.0"],
    "seq_is_mask": [f"{RC}rollout_is=sequence", f"{RC}rollout_is_threshold=0.5_2.0"],
    "geo_rs": [f"{RC}rollout_rs=seq_mean_k1", f"{RC}rollout_rs_threshold=0.9_1.1"],
    "bypass": [f"{RC}bypass_mode=true"],
}
"""The corrections compared (verl's keys): metrics only; token weights truncated at 2 (TIS); sequence
weights, masked outside [0.5, 2]; sequences rejected whose geometric weight exp(mean l) lies outside
[0.9, 1.1]; bypass (the engine's log-probs are the old policy, no recompute; ppo_clip)."""
LOSSES = ("ppo", "bapo")
REPLAY_OFF = ("none", "token_tis")
"""The corrections the MoE model also runs with routing replay off."""
REGIME = [
    "rollout.sampling.max_new_tokens=24",  # the repeat task's (bapo_megatron/tasks.py)
    "eval.samples=0",  # greedy accuracy only
]
"""Beside the demo's STALE_BF16_REGIME."""
METRICS = {  # record key: the metric whose mean over the run's steps it is
    "kl": "rollout_corr/kl",
    "k3_kl": "rollout_corr/k3_kl",
    "chi2_token": "rollout_corr/chi2_token",
    "chi2_seq": "rollout_corr/chi2_seq",
    "log_ppl_abs_diff": "rollout_corr/log_ppl_abs_diff",
    "abs_diff": "rollout_corr/train_rollout_logprob_abs_diff",
    "mult_prob_error": "rollout_corr/token_mult_prob_error",
    "is_high": "rollout_corr/rollout_is_ratio_fraction_high",
    "is_low": "rollout_corr/rollout_is_ratio_fraction_low",
    "is_ess": "rollout_corr/rollout_is_eff_sample_size",
    "rs_masked": "rollout_corr/rollout_rs_masked_fraction",
    "router_disagreement": "moe/router_disagreement",
    "positive_share": "policy/positive_loss_share",
}
FIRST_STEP = {"first_abs_diff": "rollout_corr/train_rollout_logprob_abs_diff_same_version"}
"""The first step's tokens: the engine's gap alone (no staleness)."""


@dataclass(frozen=True)
class Arm:
    model: str  # "dense" or "moe"
    replay: str  # "on", "off", or "-" (a dense model has no routes)
    loss: str
    correction: str

    @property
    def name(self) -> str:
        return f"{self.model}-replay_{self.replay}-{self.loss}-{self.correction}"

    def overrides(self) -> list[str]:
        routes = ["rollout.record_routes=true", f"algo.routing_replay={self.replay == 'on'}"]
        return [f"algo.loss={self.loss}", *([] if self.model == "dense" else routes), *CORRECTIONS[self.correction]]


def grid(models=("dense", "moe"), losses=LOSSES, corrections=tuple(CORRECTIONS)) -> list[Arm]:
    """Every arm: each model x loss x correction (MoE with replay on), and MoE with replay off for REPLAY_OFF."""
    arms = []
    for model in models:
        for loss in losses:
            for correction in corrections:
                arms.append(Arm(model, "-" if model == "dense" else "on", loss, correction))
                if model == "moe" and correction in REPLAY_OFF:
                    arms.append(Arm(model, "off", loss, correction))
    return arms


def train(args, warm: dict, arm: Arm, seed: int) -> Path:
    from demo import STALE_BF16_REGIME, study_command

    run = args.out / "runs" / f"{arm.name}-s{seed}"
    shutil.rmtree(run, ignore_errors=True)
    command = [*study_command(warm, run, args, seed), *STALE_BF16_REGIME, *REGIME, *arm.overrides(), *args.overrides]
    out = subprocess.DEVNULL if args.quiet else None
    done = subprocess.run(command, cwd=ROOT, env=engine_env(args.levels), stdout=out)
    if done.returncode:
        raise SystemExit(f"rollout_corr_study: {arm.name}, seed {seed} failed (exit {done.returncode}; {run})")
    return run


def engine_env(levels: int | None) -> dict[str, str]:
    """The runs' environment: this folder on PYTHONPATH (its sitecustomize.py quantises the engine) and the levels."""
    env = dict(os.environ)
    env.pop("ROLLOUT_CORR_STUDY_ENGINE_LEVELS", None)
    if levels:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
        env["ROLLOUT_CORR_STUDY_ENGINE_LEVELS"] = str(levels)
    return env


def summarise(rows: list[dict], arm: Arm, seed: int) -> dict:
    """One run's record from its metrics.jsonl rows: METRICS' means over the trained steps (None where
    never logged), FIRST_STEP's at the first trained step, the first and last greedy accuracy."""
    trained = [r for r in rows if "policy/entropy" in r]
    evals = [r for r in rows if "eval/greedy_acc" in r]
    if not trained or not evals:
        raise ValueError(f"rollout_corr_study: {arm.name}, seed {seed} logged no trained step or no evaluation")
    record = {**asdict(arm), "seed": seed, "steps": len(trained)}
    for key, name in METRICS.items():
        values = [r[name] for r in trained if r.get(name) is not None]
        record[key] = statistics.fmean(values) if values else None
    for key, name in FIRST_STEP.items():
        record[key] = trained[0].get(name)
    record["greedy_acc_start"], record["greedy_acc"] = evals[0]["eval/greedy_acc"], evals[-1]["eval/greedy_acc"]
    return record


def arm_of(record: dict) -> Arm:
    return Arm(record["model"], record["replay"], record["loss"], record["correction"])


def cell(values: list[float]) -> str:
    """A median and its [min, max] over seeds; n/a without values."""
    if not values:
        return "n/a"
    values = sorted(values)
    return f"{statistics.median(values):.3g} [{values[0]:.3g}, {values[-1]:.3g}]"


def table(records: list[dict], keys: list[str]) -> str:
    """Markdown: one row per arm (in grid order), each key's median over seeds and its range."""
    head = ["model", "replay", "loss", "correction", "seeds", *keys]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    order = {a: i for i, a in enumerate(grid())}
    for arm in sorted(dict.fromkeys(map(arm_of, records)), key=lambda a: order.get(a, len(order))):
        mine = [r for r in records if arm_of(r) == arm]
        cells = [cell([r[k] for r in mine if r.get(k) is not None]) for k in keys]
        row = [arm.model, arm.replay, arm.loss, arm.correction, str(len(mine)), *cells]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


OUTCOME = ["greedy_acc", "positive_share", "is_high", "is_low", "is_ess", "rs_masked", "first_abs_diff"]
GAP = ["abs_diff", "kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_abs_diff", "mult_prob_error"]
GAP += ["router_disagreement"]


def summary(records: list[dict]) -> str:
    return "Outcome:\n\n" + table(records, OUTCOME) + "\n\nThe gap (rollout_corr/ metrics):\n\n" + table(records, GAP)


def warm_starts(args) -> dict[str, dict]:
    sys.path.insert(0, str(ROOT / "examples"))
    from demo import warm_start

    starts = {}
    for model in args.models:
        starts[model] = warm_start(
            args.task,
            args.out / model / "warm",
            seed=0,
            heldout=200,
            target=args.warm_target,
            steps=args.warm_steps,
            architecture="qwen2" if model == "dense" else "qwen3_moe",
        )
    return starts


def run_study(args, results: Path) -> None:
    budget = {"task": args.task, "steps": args.steps, "prompts": args.prompts, "samples": args.samples}
    budget["levels"] = args.levels
    previous = json.loads(results.read_text()) if results.is_file() else {"budget": budget, "runs": []}
    if previous["budget"] != budget:
        raise SystemExit(f"rollout_corr_study: {results} holds runs of budget {previous['budget']}, not {budget}")
    warm = warm_starts(args)
    records = {(r["model"], r["replay"], r["loss"], r["correction"], r["seed"]): r for r in previous["runs"]}
    arms = [a for a in grid(args.models, args.losses, args.corrections)]
    for seed in args.seeds:
        for arm in arms:
            key = (*asdict(arm).values(), seed)
            if key in records and not args.again:
                continue
            print(f"=== {arm.name}, seed {seed}", flush=True)
            t = time.monotonic()
            run = train(args, warm[arm.model], arm, seed)
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            records[key] = {**summarise(rows, arm, seed), "wall_s": round(time.monotonic() - t, 1)}
            study = {"budget": budget, "runs": sorted(records.values(), key=str)}
            # after every run: an interrupted study keeps what ran
            results.write_text(json.dumps(study, indent=1) + "\n")


def run_measure(args) -> None:
    from measure import measure

    if any(not (args.out / model / "warm" / "sft" / "hf").is_dir() for model in args.models):
        warm_starts(args)  # a finished warm start is not touched: a study running beside reads it
    found = []
    for model in args.models:
        for levels in (None, args.levels):
            stats = {"model": model, **measure(args.out / model / "warm", levels)}
            print(json.dumps(stats), flush=True)
            found.append(stats)
    (args.out / "measure.json").write_text(json.dumps(found, indent=1) + "\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="repeat")
    parser.add_argument("--models", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6, help="rollout batches per run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--eval-prompts", type=int, default=50, help="held-out prompts scored before and after")
    parser.add_argument("--levels", type=int, default=LEVELS, help="the engine's weight levels a sign (0: bf16 only)")
    parser.add_argument("--warm-target", type=float, default=0.4, help="the warm start's greedy batch accuracy")
    parser.add_argument("--warm-steps", type=int, default=None, help="the warm start's steps at most")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "rollout_corr_study", help="OUT")
    parser.add_argument("--again", action="store_true", help="run again the arms results.json already holds")
    parser.add_argument("--quiet", action="store_true", help="keep the runs' console output out")
    parser.add_argument("--measure", action="store_true", help="the gap's size on held-out prompts, no training")
    parser.add_argument("--summary-only", action="store_true", help="print OUT's tables from its results.json")
    parser.add_argument("--quick", action="store_true", help="the plumbing: 1 seed, 2 dense arms, 2 steps of 4x4")
    args = parser.parse_args(argv)
    args.overrides = []
    if args.quick:
        if args.out == parser.get_default("out"):
            args.out = ROOT / "runs" / "rollout_corr_study_quick"  # its own warm start and results.json
        args.models, args.losses, args.corrections, args.seeds = ["dense"], ["ppo"], ["none", "token_tis"], [0]
        args.steps, args.prompts, args.samples, args.eval_prompts = 2, 4, 4, 8
        args.warm_steps, args.warm_target = args.warm_steps or 6, 0.0
        # a warm start of 6 steps answers nothing right: score right characters, so that groups differ
        args.overrides = [f"reward.function={ROOT / 'examples' / 'rewards' / 'right_characters.py'}:right_characters"]
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.measure:
        run_measure(args)
        return 0
    results = args.out / "results.json"
    if not args.summary_only:
        run_study(args, results)
    text = summary(json.loads(results.read_text())["runs"])
    (args.out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


sys.path[:0] = [str(ROOT), str(HERE)]

if __name__ == "__main__":
    raise SystemExit(main())
