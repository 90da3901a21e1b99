"""Where a step of the online loop spends its time, on the embedded CPU default.

    python benchmarks/bench_loop.py [--steps 8] [--warmup 2] [--repeats 1] [--modes full abort retract]

Runs the real `bapo-train` (python -m bapo_megatron.train: engine, rewards, Megatron trainer,
weight sync, checkpoint every step) on a random tiny Qwen2 with long-tailed responses, once per
mode and repeat, the modes interleaved (full, abort, retract, full, ...), and reads each run's
metrics.jsonl. Modes: "full" generates every response to the end in its step; "abort" is partial
rollout (--budget tokens per request, --oversample x the groups in flight, the rest continued next
step); "retract" keeps requests generating inside the engine while the trainer trains.

Per mode, over the steps after --warmup of every repeat, the median and (min-max) of: the step,
rollout (the trainer waiting for groups), the part of it spent waiting for rewards once generation
had finished, train, weight sync, checkpoint, and two shares of the step: the trainer waiting for
the engines (rollout / step) and the engines waiting for the trainer (1 - the engines' busy share,
from their /metrics). The load average before and after is printed: figures from a loaded machine
are not figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "full": ["rollout.partial.enabled=false"],
    "abort": [
        "rollout.partial.enabled=true",
        "rollout.partial.token_budget={budget}",
        "rollout.oversample={oversample}",
    ],
    "retract": ["rollout.partial.enabled=true", "rollout.partial.mode=retract", "rollout.oversample={oversample}"],
}
COLUMNS = [
    ("step", "time/step"),
    ("rollout", "time/rollout"),
    ("reward_wait", "rollout/reward_wait"),
    ("train", "time/train"),
    ("sync", "time/weight_sync"),
    ("ckpt", "time/checkpoint"),
]


def task(directory: Path, prompts: int, head_scale: float) -> None:
    """The model (bench_rollout's long-tailed tiny Qwen2) and a prompt file; reward: exact token ids."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_rollout import tiny_model

    tiny_model(directory / "model", head_scale=head_scale)
    with open(directory / "prompts.jsonl", "w") as f:
        for i in range(prompts):
            f.write(json.dumps({"prompt": [(7 * i + j) % 200 + 10 for j in range(6)], "answer_ids": [1]}) + "\n")


def run(directory: Path, mode: str, index: int, args) -> list[dict]:
    run_dir = directory / f"{mode}-{index}"
    overrides = [o.format(budget=args.budget, oversample=args.oversample) for o in MODES[mode]]
    command = [
        sys.executable,
        "-m",
        "bapo_megatron.train",
        f"model.hf_path={directory / 'model'}",
        f"data.path={directory / 'prompts.jsonl'}",
        "data.reward=exact_ids",
        f"steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.sampling.max_new_tokens={args.max_new}",
        f"rollout.sampling.temperature={args.temperature}",
        f"rollout.max_staleness={args.steps}",
        f"run_dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        "checkpoint.interval=1",
        "checkpoint.keep_last=1",
        "logging.backends=[jsonl]",
        "optimizer.lr=1e-5",
        "parallel.max_tokens_per_microbatch=4096",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines][args.warmup :]


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f}({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--oversample", type=float, default=2.0)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--head-scale", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads of the trainer process")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        raise SystemExit("--warmup must be below --steps")
    directory = Path(tempfile.mkdtemp(prefix="bench_loop_"))
    load_before = os.getloadavg()
    try:
        task(directory, 256, args.head_scale)
        steps: dict[str, list[dict]] = {mode: [] for mode in args.modes}
        for index in range(args.repeats):
            for mode in args.modes:  # interleaved: a change in the machine's load hits every mode alike
                steps[mode] += run(directory, mode, index, args)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    load_after = os.getloadavg()
    print(
        f"embedded CPU engine, {os.cpu_count()} cores, {args.prompts} prompts x {args.samples} samples, "
        f"max {args.max_new} new tokens; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print("seconds per step: median(min-max) over the steps after warm-up; shares of the step")
    header = ["mode", "steps", *(name for name, _ in COLUMNS), "trainer_waits", "engines_wait"]
    print("  ".join(f"{h:>22}" if i > 1 else f"{h:>8}" for i, h in enumerate(header)))
    print("-" * (8 * 2 + 24 * (len(header) - 2)))
    for mode, rows in steps.items():
        cells = [mode, str(len(rows))]
        cells += [cell([r[key] for r in rows if r.get(key) is not None]) for _, key in COLUMNS]
        cells.append(cell([r["time/rollout"] / r["time/step"] for r in rows]))
        cells.append(cell([1.0 - r["engine/busy_share"] for r in rows if "engine/busy_share" in r]))
        print("  ".join(f"{c:>22}" if i > 1 else f"{c:>8}" for i, c in enumerate(cells)))


if __name__ == "__main__":
    main()
