"""The main job at toy size, end to end on a CPU (`make demo`): the whole stack learns a task.

    python examples/demo.py                 # runs/demo/: about 9 minutes on 2 cores
    python examples/demo.py --lora          # the same BAPO phase training LoRA adapters (runs/demo/rl-lora)
    python examples/demo.py --quick         # the plumbing only: a few steps of each phase (the test's run)

--quick runs every phase below for a few steps (6 warm-start, 3 BAPO, 100 held-out prompts) to check
that they work together; its accuracy does not move (QUICK_NOTE says why, and the run ends saying so).
--lora trains, in phase 3, rank-16 adapters on every linear projection of the frozen warm start
(LORA_OVERRIDES) instead of the whole model; it shares the run's warm start and writes its own
rl-lora/, hf-lora/ and summary-lora.json beside those of the full fine-tuning run.

1. the task: 3-digit addition data (train and 1,000 held-out prompts), a character tokenizer
   and a tiny Qwen2 made from a config (bapo_megatron/tasks.py; nothing is downloaded)
2. supervised warm start through the Megatron trainer (`bapo-train examples/demo/sft.yaml`,
   algo.loss=sft) until it answers 40% of its batches greedily (stop_when=sft/answer_acc>=0.4,
   at most sft.yaml's steps); a finished warm start is reused on a second run
3. BAPO through `bapo-train examples/demo/rl.yaml`: the embedded engine, partial rollout,
   stale behaviour policies, weight sync every step, held-out eval/* every 25 steps
4. the final checkpoint exported to Hugging Face format (tools/convert_checkpoint.py)
5. the exported model (and the warm start's) evaluated with transformers on the held-out set
6. plots (tools/plot_run.py) and runs/NAME/summary.json

summary.json: accuracy_before_rl and accuracy_after_rl (greedy, held-out), avg@4 and pass@4
before and after, sft_steps, steps (BAPO's), wall_seconds (and each phase's), hf_export_dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "demo"
TOOLS = ROOT / "tools"
QUICK_REWARD = f"{ROOT / 'examples' / 'rewards' / 'right_characters.py'}:right_characters"
QUICK_NOTE = (
    "--quick checks the plumbing only: every phase ran, but {sft} warm-start steps leave the model at chance "
    "(the warm start leaves its loss plateau after 300 to 500 steps), so {rl} BAPO steps cannot move its "
    "accuracy. Its BAPO steps score the share of right characters (examples/rewards/right_characters.py), "
    "not exact answers, which a model at chance never writes: with those every group would be flat and "
    "train on nothing. `make demo` (about 9 minutes on 2 cores) shows it learn."
)
"""What the quick run's last lines say: why its accuracy reads 0.0% -> 0.0% and what shows learning."""
LORA_OVERRIDES = ("model.lora.rank=16", "model.lora.alpha=32", "optimizer.lr=1.0e-3")
"""--lora's BAPO phase: rank 16 on every linear projection (model.lora.target_modules' default,
all-linear), alpha / rank = 2 as PEFT's usual alpha = 2 r, and a learning rate above full fine-tuning's
(rl.yaml's 3e-4), as LoRA needs: 1e-3 gained +28.5 points where full fine-tuning gained +29.5 and +27.4 (seed 0,
150 steps, README.md); 3e-3 drifted away from the warm start (+3.9, its in-loop accuracy falling)."""
K = 4
"""Samples a held-out prompt for avg@K and pass@K."""


@dataclass(frozen=True)
class Mode:
    """What one kind of demo run changes: how long its phases run, what its BAPO phase trains and on
    which reward, and where its results go (beside another mode's, under the same warm start)."""

    suffix: str = ""
    """Of its BAPO run's directory, export, plots and summary ("": rl/, hf/, summary.json)."""
    rl_overrides: tuple[str, ...] = ()
    """bapo-train overrides of its BAPO phase."""
    sft_steps: int | None = None
    rl_steps: int | None = None
    """At most (None: the config's or the command line's)."""
    eval_prompts: int | None = None
    """At most, scored at the end (None: the command line's)."""
    note: str = ""
    """Said at the end (formatted with the warm start's and BAPO's step counts)."""

    def quick(self) -> Mode:
        """This mode for a few steps of each phase, scored by the share of right characters (a model
        at chance writes no exact answer) and evaluated at the end only (eval/* in the loop would
        score that reward, not answers)."""
        extra = (f"reward.function={QUICK_REWARD}",)
        return replace(
            self, sft_steps=6, rl_steps=3, eval_prompts=100, rl_overrides=self.rl_overrides + extra, note=QUICK_NOTE
        )

    def path(self, run: Path, name: str, ext: str = "") -> Path:
        return run / f"{name}{self.suffix}{ext}"


FULL = Mode()
LORA = Mode(suffix="-lora", rl_overrides=LORA_OVERRIDES)


def phase(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def bapo_train(config: Path, overrides: list[str]) -> None:
    """`bapo-train CONFIG key=value ...` in a process of its own; its output streams through."""
    command = [sys.executable, "-m", "bapo_megatron.train", str(config), *overrides]
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"demo: {' '.join(command[2:4])} failed (exit {done.returncode})")


def export(checkpoint: Path, template: Path, out: Path) -> None:
    """The checkpoint as a Hugging Face model at `out` (a LoRA run's: its adapters merged)."""
    from bapo_megatron.trainer.checkpoint import weights_dir

    command = [sys.executable, str(TOOLS / "convert_checkpoint.py"), "mcore-to-hf"]
    command += ["--mcore", str(weights_dir(checkpoint)), "--out", str(out), "--hf-template", str(template)]
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([*command, "--no-progress"], cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"demo: the export of {checkpoint} failed (exit {done.returncode})")


def warm_start(
    task_name: str,
    run: Path,
    *,
    seed: int,
    heldout: int,
    target: float,
    steps: int | None,
    architecture: str = "qwen2",
) -> dict:
    """Phases 1 and 2: the task under run/task and its supervised warm start under run/sft (reused
    when it ended before), exported to run/sft/hf. Returns the task's paths ("task"), the warm
    start's run directory ("sft"), its export ("hf"), its step count and each phase's seconds."""
    from bapo_megatron.runinfo import RunStatus
    from bapo_megatron.tasks import write_task

    seconds = {}
    phase(f"1/6 the {task_name} task, its tokenizer and a tiny {architecture} model ({run / 'task'})")
    t = time.monotonic()
    task = write_task(task_name, run / "task", heldout=heldout, seed=seed, architecture=architecture)
    seconds["task"] = time.monotonic() - t

    phase(f"2/6 supervised warm start (algo.loss=sft) until it answers {target:.0%} of its batches")
    t = time.monotonic()
    sft = run / "sft"
    overrides = [
        f"model.hf_path={task['model']}",
        f"data.path={task['train']}",
        f"run_dir={sft}",
        f"checkpoint.dir={sft / 'ckpt'}",
        f"seed={seed}",
    ]
    if target > 0:
        overrides.append(f"stop_when=sft/answer_acc>={target}")
    if steps:
        overrides.append(f"steps={steps}")
    # sft/answer_acc is the greedy exact-match accuracy of each batch (teacher-forced argmax, before
    # the batch's update): the warm start stops as it leaves the loss plateau, whose length varies
    # with the seed, and RL starts with room to gain. A warm start that ended is not trained again
    # (bapo-train resumes it and finds it ended).
    bapo_train(CONFIGS / "sft.yaml", overrides)
    done_steps = RunStatus.read(sft).step
    export(sft / "ckpt", task["model"], sft / "hf")
    seconds["sft"] = time.monotonic() - t
    return {"task": task, "sft": sft, "hf": sft / "hf", "sft_steps": done_steps, "seconds": seconds}


STALE_BF16_REGIME = (
    "rollout.mode=async",
    "rollout.max_staleness=2",
    "rollout.oversample=2.0",
    "rollout.partial.enabled=false",
    "rollout.partial.token_budget=null",
    "rollout.engines.dtype=bfloat16",
    "algo.updates_per_batch=1",
)
"""The off-policy regime the studies of the engine-trainer gap run in (moe_replay_study,
rollout_corr_study): asynchronous, tokens up to 2 versions stale, whole samples (no partial
rollout), a bf16 engine beside the fp32 trainer, one update a batch."""


def study_command(warm: dict, run: Path, args: argparse.Namespace, seed: int) -> list[str]:
    """One run of a study built on the demo (examples/compare_clipping, moe_replay_study,
    rollout_corr_study): BAPO's demo config from the warm start, args.steps batches of args.prompts
    x args.samples, args.eval_prompts held-out prompts scored before the first step and after the
    last, metrics to jsonl only, no checkpoint (a study's runs are read, never resumed), the engines
    on a free port (beside other jobs). The study adds its arm's options after these."""
    from bapo_megatron.engines.launcher import free_port

    task = warm["task"]
    return [
        sys.executable,
        "-m",
        "bapo_megatron.train",
        str(CONFIGS / "rl.yaml"),
        f"model.hf_path={task['model']}",
        f"model.mcore_path={warm['sft'] / 'ckpt'}",
        f"data.path={task['train']}",
        f"eval.path={task['heldout']}",
        f"eval.max_prompts={args.eval_prompts}",
        f"eval.interval={args.steps}",
        f"steps={args.steps}",
        f"seed={seed}",
        f"data.seed={seed}",
        f"run_dir={run}",
        "checkpoint.save=false",
        "logging.backends=[jsonl]",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.engines.port={free_port()}",
    ]


def train_rl(args: argparse.Namespace, mode: Mode, run: Path, warm: dict) -> Path:
    """Phase 3: BAPO from the warm start, in run/rl<suffix> (trained anew every time)."""
    from bapo_megatron.tasks import TASKS

    task, rl = warm["task"], mode.path(run, "rl")
    new_tokens = TASKS[args.task].max_new_tokens
    overrides = [
        f"model.hf_path={task['model']}",
        f"model.mcore_path={warm['sft'] / 'ckpt'}",
        f"data.path={task['train']}",
        f"run_dir={rl}",
        f"checkpoint.dir={rl / 'ckpt'}",
        "checkpoint.resume=false",
        f"seed={args.seed}",
        f"rollout.sampling.max_new_tokens={new_tokens}",
        # rl.yaml cuts responses every 3 tokens with max_staleness 2: a longer task's responses need
        # a budget that reaches their end within 3 versions
        f"rollout.partial.token_budget={max(3, -(-new_tokens // 3))}",
        *([f"steps={args.rl_steps}"] if args.rl_steps else []),
        *([] if mode.note else [f"eval.path={task['heldout']}"]),  # (a quick run's reward is not answers)
        *mode.rl_overrides,
    ]
    shutil.rmtree(rl, ignore_errors=True)
    bapo_train(CONFIGS / "rl.yaml", overrides)
    return rl


def evaluate(args: argparse.Namespace, heldout: Path, models: dict[str, Path]) -> dict[str, dict]:
    """Phase 5: each model's greedy accuracy, avg@K and pass@K on the held-out prompts."""
    from bapo_megatron.evaluate import evaluate_hf

    scores = {}
    for label, directory in models.items():
        scores[label] = evaluate_hf(
            directory, heldout, reward="exact", samples=K, max_prompts=args.eval_prompts, seed=args.seed
        )
        print(f"{label}: {json.dumps(scores[label])}", flush=True)
    return scores


def summarise(args: argparse.Namespace, mode: Mode, run: Path, rl: Path, warm: dict, scores: dict) -> dict:
    """Phase 6: the plots and the summary (written to run/summary<suffix>.json)."""
    sys.path.insert(0, str(TOOLS))
    from plot_run import plot, read_metrics

    plots = [mode.path(run, "plots", ".png"), run / "sft_plots.png"]
    plot([rl], plots[0], labels=["bapo-lora" if mode.suffix else "bapo"])
    plot([warm["sft"]], plots[1], labels=["sft"])
    records = read_metrics(rl)
    summary = {"task": args.task}
    for metric in ("accuracy", f"avg@{K}", f"pass@{K}"):
        for when in ("before_rl", "after_rl"):
            summary[f"{metric}_{when}"] = scores[when]["greedy_acc" if metric == "accuracy" else metric]
    summary |= {
        "heldout_prompts": scores["after_rl"]["prompts"],
        "sft_steps": warm["sft_steps"],
        "steps": max((r["step"] for r in records), default=0),
        "optimizer_steps": max((r.get("train/step", 0) for r in records), default=0),
        "rl_overrides": list(mode.rl_overrides),
        "hf_export_dir": str(mode.path(run, "hf")),
        "plots": [str(p) for p in plots],
        "quick": bool(mode.note),
    }
    return summary


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Mode]:
    from bapo_megatron.tasks import TASKS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="demo", help="RUNS/NAME holds everything")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="RUNS (default: runs/ in the checkout)")
    parser.add_argument("--task", default="addition", choices=sorted(TASKS))
    parser.add_argument("--sft-steps", type=int, default=None, help="at most (default: examples/demo/sft.yaml's)")
    parser.add_argument(
        "--sft-target",
        type=float,
        default=0.4,
        help="warm start until the mean greedy accuracy of its last 10 batches reaches this (0: all its steps)",
    )
    parser.add_argument("--rl-steps", type=int, default=None, help="default: examples/demo/rl.yaml's")
    parser.add_argument("--eval-prompts", type=int, default=1000, help="held-out prompts scored at the end")
    parser.add_argument(
        "--quick", action="store_true", help="the plumbing only: a few steps of each phase, 100 held-out prompts"
    )
    parser.add_argument("--lora", action="store_true", help="BAPO trains LoRA adapters (rank 16, all linear layers)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    mode = LORA if args.lora else FULL
    mode = mode.quick() if args.quick else mode
    args.sft_steps = args.sft_steps or mode.sft_steps
    args.rl_steps = args.rl_steps or mode.rl_steps
    args.eval_prompts = min(args.eval_prompts, mode.eval_prompts or args.eval_prompts)
    return args, mode


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    args, mode = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from bapo_megatron.common import quiet

    quiet.hold_known_warnings()  # transformers' known notices in the evaluation: kept in RUNS/NAME/warnings.log
    run = args.runs.resolve() / args.name
    run.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    heldout = max(args.eval_prompts, 200)
    warm = warm_start(args.task, run, seed=args.seed, heldout=heldout, target=args.sft_target, steps=args.sft_steps)
    seconds = dict(warm["seconds"])

    trains = "LoRA adapters (" + " ".join(mode.rl_overrides[:3]) + ")" if mode.suffix else "the whole model"
    scored = ", scored by the share of right characters (--quick)" if mode.note else ""
    phase(f"3/6 BAPO with the embedded engine and partial rollout, training {trains}{scored}")
    t = time.monotonic()
    rl = train_rl(args, mode, run, warm)
    seconds["rl"] = time.monotonic() - t

    phase("4/6 export to Hugging Face format")
    t = time.monotonic()
    export(rl / "ckpt", warm["task"]["model"], mode.path(run, "hf"))
    seconds["export"] = time.monotonic() - t

    phase(f"5/6 held-out evaluation with transformers ({args.eval_prompts} prompts)")
    t = time.monotonic()
    models = {"before_rl": warm["hf"], "after_rl": mode.path(run, "hf")}
    scores = evaluate(args, warm["task"]["heldout"], models)
    seconds["eval"] = time.monotonic() - t

    phase("6/6 plots and summary")
    summary = summarise(args, mode, run, rl, warm, scores)
    summary |= {"wall_seconds": time.monotonic() - started, "phase_seconds": seconds}
    summary_path = mode.path(run, "summary", ".json")
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    quiet.flush(run)
    gain = 100 * (summary["accuracy_after_rl"] - summary["accuracy_before_rl"])
    print(
        f"\nheld-out greedy accuracy {100 * summary['accuracy_before_rl']:.1f}% -> "
        f"{100 * summary['accuracy_after_rl']:.1f}% ({gain:+.1f} points) in {summary['steps']:.0f} BAPO steps; "
        f"{summary['wall_seconds']:.0f} s in all\nsummary: {summary_path}\nplots: {summary['plots'][0]}",
        flush=True,
    )
    if mode.note:
        print(textwrap.fill(mode.note.format(sft=summary["sft_steps"], rl=summary["steps"]), width=100), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
