"""Where a step of the online loop spends its time, synchronous against asynchronous.

    python benchmarks/bench_loop.py [--engine modelled|embedded] [--modes sync async] [--repeats 3] [--json PATH]

Runs the real `bapo-train` (python -m bapo_megatron.train: driver, rewards, Megatron trainer,
weight sync over a gloo weight-update group) on a tiny random Qwen2, once per mode and repeat,
the modes interleaved (sync, async, sync, async, ...: a change in the machine's load hits every
mode alike), and reads each run's metrics.jsonl.

Engines (--engine):
- modelled: benchmarks/modelled_engine.py served over HTTP from this process (rollout.engines.urls):
  no model, each decode iteration costs what an H100's does (scaled by --time-scale), response
  lengths long-tailed; it joins the weight-update group and receives every weight update (bytes
  discarded), and pauses as SGLang does. The trainer runs on this machine's CPU, the engine costs
  no CPU: the overlap async mode buys is what a node of GPUs generating beside the trainer gets.
- embedded: the CPU engine of this package, a process of its own. With one thread each (--threads 1,
  the engine inherits it), the trainer and the engine take one core each of a 2-core machine, so
  their overlap shows; with more threads each they would compete for the same cores.

Modes (--modes): sync (each step generates whole responses, then trains), abort and retract (sync
partial rollout), async (rollout.mode async: generation goes on while the trainer trains, tokens
at most --max-staleness versions stale).

Per mode, over the steps after --warmup of every repeat: the median and (min-max) of the step,
the trainer waiting for its batch, training, the weight sync; the shares of the step in which the
trainer waits (trainer_wait / step) and in which the engines wait (engine/idle_share: holding no
request, or paused); trained tokens per second (a repeat's tokens over its seconds, median and
min-max over repeats). The ideal speedup of overlapping is (T_rollout + T_rest) / max(T_rollout,
T_rest) from the sync run's own split (T_rest: the step less the wait for the batch). Async can
pass it: besides the overlap, its engines never wait for a step's slowest response (new groups
start as others finish), which the sync split's T_rollout includes; the abort mode (sync partial
rollout, oversampled) shows how much of that a sync step recovers alone. The defaults balance
rollout and training on the 2-core development machine (T_rollout ~ T_rest). The load average
before and after is printed: figures from a loaded machine are not figures.
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
    "sync": ["rollout.mode=sync"],
    "abort": [
        "rollout.mode=sync",
        "rollout.partial.enabled=true",
        "rollout.partial.token_budget={budget}",
        "rollout.oversample={oversample}",
    ],
    "retract": [
        "rollout.mode=sync",
        "rollout.partial.enabled=true",
        "rollout.partial.mode=retract",
        "rollout.oversample={oversample}",
    ],
    "async": ["rollout.mode=async", "rollout.oversample={oversample}", "rollout.pause_mode={pause_mode}"],
}
COLUMNS = [
    ("step", "time/step"),
    ("trainer_wait", "time/trainer_wait"),
    ("train", "time/train"),
    ("sync", "time/weight_sync"),
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
    """One bapo-train run of `mode`; its step records after the warm-up."""
    run_dir = directory / f"{mode}-{index}"
    options = {"budget": args.budget, "oversample": args.oversample, "pause_mode": args.pause_mode}
    overrides = [o.format(**options) for o in MODES[mode]]
    engine = None
    if args.engine == "modelled":
        sys.path.insert(0, str(Path(__file__).parent))
        from modelled_engine import H100_7B, ModelledEngine

        engine = ModelledEngine(
            H100_7B, prompt_len=6, median=args.max_new * 150 / 512, cap=args.max_new, time_scale=args.time_scale
        ).start()
        overrides += [f"rollout.engines.urls=[{engine.url}]", "rollout.sync.host=127.0.0.1"]
    command = [
        sys.executable,
        "-m",
        "bapo_megatron.train",
        f"model.hf_path={directory / 'model'}",
        f"data.path={directory / 'prompts.jsonl'}",
        "reward.function=exact_ids",
        f"steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.sampling.max_new_tokens={args.max_new}",
        f"rollout.sampling.temperature={args.temperature}",
        f"rollout.max_staleness={args.max_staleness}",
        f"run_dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        f"checkpoint.interval={args.checkpoint_interval}",
        "checkpoint.keep_last=1",
        "logging.backends=[jsonl]",
        "optimizer.lr=1e-5",
        "parallel.max_tokens_per_microbatch=4096",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        if engine is not None:
            engine.stop()
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines][args.warmup :]


def summary(repeats: list[list[dict]]) -> dict:
    """A mode's figures over its repeats (each a list of step records)."""
    rows = [r for steps in repeats for r in steps]
    rates = [
        sum(r["perf/tokens_per_s"] * r["time/step"] for r in steps) / sum(r["time/step"] for r in steps)
        for steps in repeats
    ]
    out = {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_range": [min(rates), max(rates)],
        "steps": len(rows),
    }
    for name, key in COLUMNS:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[name] = statistics.median(values) if values else None
        out[f"{name}_range"] = [min(values), max(values)] if values else None
    waits = [r["time/trainer_wait"] / r["time/step"] for r in rows]
    idle = [r["engine/idle_share"] for r in rows if "engine/idle_share" in r]
    out["trainer_waits"], out["trainer_waits_range"] = statistics.median(waits), [min(waits), max(waits)]
    if idle:
        out["engines_wait"], out["engines_wait_range"] = statistics.median(idle), [min(idle), max(idle)]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["modelled", "embedded"], default="modelled")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["sync", "async"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--oversample", type=float, default=2.0)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--pause-mode", choices=["retract", "abort", "in_place"], default="retract")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--head-scale", type=float, default=8.0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="modelled engine: this x its modelled time")
    parser.add_argument("--checkpoint-interval", type=int, default=0, help="0: a checkpoint at the end only")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads of the trainer process")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        raise SystemExit("--warmup must be below --steps")
    directory = Path(tempfile.mkdtemp(prefix="bench_loop_"))
    load_before = os.getloadavg()
    try:
        task(directory, 512, args.head_scale)
        repeats: dict[str, list[list[dict]]] = {mode: [] for mode in args.modes}
        for index in range(args.repeats):
            for mode in args.modes:  # interleaved
                repeats[mode].append(run(directory, mode, index, args))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    load_after = os.getloadavg()
    results = {mode: summary(r) for mode, r in repeats.items()}
    if "sync" in results:
        sync = results["sync"]
        rollout, rest = sync["trainer_wait"], sync["step"] - sync["trainer_wait"]
        results["ideal_speedup"] = (rollout + rest) / max(rollout, rest)
        for r in results.values():
            if isinstance(r, dict):
                r["vs_sync"] = r["tokens_per_s"] / sync["tokens_per_s"]
        if "async" in results:
            results["async_of_ideal"] = results["async"]["vs_sync"] / results["ideal_speedup"]
    engine = (
        f"modelled H100 engine (time scale {args.time_scale})"
        if args.engine == "modelled"
        else f"embedded CPU engine (a process of its own: with --threads {args.threads} the trainer and the engine "
        "each take a core of this machine's; with more threads each they would compete for them)"
    )
    print(
        f"{engine}; trainer on {os.cpu_count()} CPU cores, {args.threads} thread(s); {args.prompts} prompts x "
        f"{args.samples} samples, max {args.max_new} new tokens, max_staleness {args.max_staleness}; {args.repeats} "
        f"interleaved repeats of {args.steps} steps ({args.warmup} warm-up); load average {load_before[0]:.2f} "
        f"before, {load_after[0]:.2f} after"
    )
    print("seconds per step and shares of the step: median(min-max) over the steps after warm-up")
    header = ["mode", "steps", "tok/s", "vs sync", *(name for name, _ in COLUMNS), "trainer_waits", "engines_wait"]
    print("  ".join(f"{h:>22}" if i > 1 else f"{h:>8}" for i, h in enumerate(header)))
    print("-" * (8 * 2 + 24 * (len(header) - 2)))
    for mode in args.modes:
        r = results[mode]
        cells = [mode, str(r["steps"])]
        low, high = r["tokens_per_s_range"]
        cells.append(f"{r['tokens_per_s']:.0f}({low:.0f}-{high:.0f})")
        cells.append(f"{r['vs_sync']:.2f}x" if "vs_sync" in r else "-")
        for name, _ in COLUMNS:
            cells.append(_cell(r.get(name), r.get(f"{name}_range")))
        cells.append(_cell(r["trainer_waits"], r["trainer_waits_range"]))
        cells.append(_cell(r.get("engines_wait"), r.get("engines_wait_range")))
        print("  ".join(f"{c:>22}" if i > 1 else f"{c:>8}" for i, c in enumerate(cells)))
    if "ideal_speedup" in results:
        line = f"ideal overlap bound from the sync run's split: {results['ideal_speedup']:.2f}x"
        if "async_of_ideal" in results:
            line += f"; async reaches {results['async_of_ideal']:.2f} of it"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def _cell(value, bounds) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}({bounds[0]:.3f}-{bounds[1]:.3f})"


if __name__ == "__main__":
    main()
