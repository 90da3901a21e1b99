"""The main job at toy size, end to end on a CPU (`make demo`): the whole stack learns a task.

    python examples/demo.py                 # runs/demo/: about 9 minutes on 2 cores
    python examples/demo.py --quick         # the plumbing only: a few steps of each phase (the test's run)

--quick runs every phase below for a few steps (6 warm-start, 3 BAPO, 100 held-out prompts) to check
that they work together; its accuracy does not move (QUICK_NOTE says why, and the run ends saying so).

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
import subprocess
import sys
import textwrap
import time
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


def phase(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def bapo_train(config: Path, overrides: list[str]) -> None:
    """`bapo-train CONFIG key=value ...` in a process of its own; its output streams through."""
    command = [sys.executable, "-m", "bapo_megatron.train", str(config), *overrides]
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"demo: {' '.join(command[2:4])} failed (exit {done.returncode})")


def export(checkpoint: Path, template: Path, out: Path) -> None:
    from bapo_megatron.trainer.checkpoint import weights_dir

    command = [
        sys.executable,
        str(TOOLS / "convert_checkpoint.py"),
        "mcore-to-hf",
        "--mcore",
        str(weights_dir(checkpoint)),
        "--out",
        str(out),
        "--hf-template",
        str(template),
        "--no-progress",
    ]
    done = subprocess.run(command, cwd=ROOT)
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
    import shutil

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
    hf = sft / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    export(sft / "ckpt", task["model"], hf)
    seconds["sft"] = time.monotonic() - t
    return {"task": task, "sft": sft, "hf": hf, "sft_steps": done_steps, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.sft_steps = args.sft_steps or 6
        args.rl_steps = args.rl_steps or 3
        args.eval_prompts = min(args.eval_prompts, 100)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    sys.path.insert(0, str(ROOT))
    from bapo_megatron.common import quiet

    quiet.hold_known_warnings()  # transformers' known notices in the evaluation: kept in RUNS/NAME/warnings.log
    from bapo_megatron.evaluate import evaluate_hf

    run = args.runs.resolve() / args.name
    run.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    seconds: dict[str, float] = {}

    heldout = max(args.eval_prompts, 200)
    warm = warm_start(args.task, run, seed=args.seed, heldout=heldout, target=args.sft_target, steps=args.sft_steps)
    task, sft, hf_before = warm["task"], warm["sft"], warm["hf"]
    seconds.update(warm["seconds"])
    import shutil

    scored = ", scored by the share of right characters (--quick)" if args.quick else ""
    phase(f"3/6 BAPO with the embedded engine and partial rollout{scored}")
    t = time.monotonic()
    rl = run / "rl"
    rl_overrides = [
        f"model.hf_path={task['model']}",
        f"model.mcore_path={sft / 'ckpt'}",
        f"data.path={task['train']}",
        f"run_dir={rl}",
        f"checkpoint.dir={rl / 'ckpt'}",
        "checkpoint.resume=false",
        f"seed={args.seed}",
        f"rollout.sampling.max_new_tokens={TASKS[args.task].max_new_tokens}",
        # rl.yaml cuts responses every 3 tokens with max_staleness 2: a longer task's responses need
        # a budget that reaches their end within 3 versions
        f"rollout.partial.token_budget={max(3, -(-TASKS[args.task].max_new_tokens // 3))}",
    ]
    if args.rl_steps:
        rl_overrides.append(f"steps={args.rl_steps}")
    if args.quick:  # held-out eval/* in the loop would score the quick reward, not answers: phase 5 scores them
        rl_overrides.append(f"reward.function={QUICK_REWARD}")
    else:
        rl_overrides.append(f"eval.path={task['heldout']}")
    shutil.rmtree(rl, ignore_errors=True)  # every demo run trains its RL phase anew
    bapo_train(CONFIGS / "rl.yaml", rl_overrides)
    seconds["rl"] = time.monotonic() - t

    phase("4/6 export to Hugging Face format")
    t = time.monotonic()
    hf_after = run / "hf"
    shutil.rmtree(hf_after, ignore_errors=True)
    export(rl / "ckpt", task["model"], hf_after)
    seconds["export"] = time.monotonic() - t

    phase(f"5/6 held-out evaluation with transformers ({args.eval_prompts} prompts)")
    t = time.monotonic()
    k = 4
    scores = {}
    for label, directory in (("before_rl", hf_before), ("after_rl", hf_after)):
        scores[label] = evaluate_hf(
            directory, task["heldout"], reward="exact", samples=k, max_prompts=args.eval_prompts, seed=args.seed
        )
        print(f"{label}: {json.dumps(scores[label])}", flush=True)
    seconds["eval"] = time.monotonic() - t

    phase("6/6 plots and summary")
    sys.path.insert(0, str(TOOLS))
    from plot_run import plot, read_metrics

    plot([rl], run / "plots.png", labels=["bapo"])
    plot([sft], run / "sft_plots.png", labels=["sft"])
    rl_records = read_metrics(rl)
    summary = {
        "task": args.task,
        "accuracy_before_rl": scores["before_rl"]["greedy_acc"],
        "accuracy_after_rl": scores["after_rl"]["greedy_acc"],
        f"avg@{k}_before_rl": scores["before_rl"][f"avg@{k}"],
        f"avg@{k}_after_rl": scores["after_rl"][f"avg@{k}"],
        f"pass@{k}_before_rl": scores["before_rl"][f"pass@{k}"],
        f"pass@{k}_after_rl": scores["after_rl"][f"pass@{k}"],
        "heldout_prompts": scores["after_rl"]["prompts"],
        "sft_steps": warm["sft_steps"],
        "steps": max((r["step"] for r in rl_records), default=0),
        "optimizer_steps": max((r.get("train/step", 0) for r in rl_records), default=0),
        "wall_seconds": time.monotonic() - started,
        "phase_seconds": seconds,
        "hf_export_dir": str(hf_after),
        "plots": [str(run / "plots.png"), str(run / "sft_plots.png")],
        "quick": args.quick,
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    quiet.flush(run)
    gain = 100 * (summary["accuracy_after_rl"] - summary["accuracy_before_rl"])
    print(
        f"\nheld-out greedy accuracy {100 * summary['accuracy_before_rl']:.1f}% -> "
        f"{100 * summary['accuracy_after_rl']:.1f}% ({gain:+.1f} points) in {summary['steps']:.0f} BAPO steps; "
        f"{summary['wall_seconds']:.0f} s in all\nsummary: {run / 'summary.json'}\nplots: {run / 'plots.png'}",
        flush=True,
    )
    if args.quick:
        print(textwrap.fill(QUICK_NOTE.format(sft=summary["sft_steps"], rl=summary["steps"]), width=100), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
