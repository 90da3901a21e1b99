"""Partial rollout against full-length rollout on the embedded engine, long-tailed response lengths.

    python benchmarks/bench_rollout.py [--steps 16] [--repeats 3] [--prompts 8] [--samples 4] [--max-new 512]
                                       [--budget 128] [--oversample 2 3] [--engine cpu|gpu-model|both]

Two engines, each table labelled: the embedded CPU engine (real decoding; on a CPU a decode
step's cost grows with the sequences it holds, so keeping more in flight buys little), and a
modelled GPU engine (modelled_engine.py: no model, each iteration costs what an H100's does,
flat up to a capacity), where partial rollout's gain is meant to show.

A tiny random Qwen2-shaped model whose output layer is scaled by --head-scale and sampled
at --temperature: its trajectories are nearly deterministic, so some reach one of the
--stop-tokens stop ids within a few tokens and others cycle without one until --max-new
(defaults: median ~150 tokens, ~15% cut at 512): the long tail of RL on reasoning tasks.
Every mode runs the same number of steps, with a weight update (from disk, the same
weights; it flushes the engine's caches) and a new version between steps, as training
does. Full: every group of the step is generated to the end. Partial: a request carries at
most --budget tokens (a sample cut there continues at once while the step still needs
groups, and next step otherwise), --oversample x the groups are kept in flight (a row per
value), and the step returns when --prompts groups are complete. Training itself is not
run: its cost per token is the same in every mode, so the table compares rollout seconds
per trained token (the tokens of the groups a step hands to training). Each mode runs --repeats
times, the modes interleaved; the table gives medians and (min-max) over the repeats, and the
ratio to full-length rollout repeat by repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def tiny_model(directory: Path, seed: int = 0, head_scale: float = 1.0) -> None:
    """A random tiny Qwen2; head_scale sharpens its next-token distributions."""
    import transformers

    from bapo_megatron.models.spec import tiny_spec

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**tiny_spec("qwen2").to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(directory)


async def run_mode(url: str, model: Path, partial: bool, oversample: float, args) -> dict[str, float]:
    from bapo_megatron.common.protocol import SamplingParams
    from bapo_megatron.engines.client import EngineClient
    from bapo_megatron.engines.pool import EnginePool
    from bapo_megatron.rewards.workers import RewardWorkers
    from bapo_megatron.rollout.buffer import RolloutBuffer
    from bapo_megatron.rollout.core import RolloutCore
    from bapo_megatron.rollout.strategies import AbortSteps

    counter = iter(range(10**6))

    def prompts():
        i = next(counter)
        return f"p{i}", [(7 * i + j) % 200 + 10 for j in range(6)], {"answer_ids": [1]}

    stop = tuple(range(args.stop_tokens))
    async with EngineClient(url) as client:
        buffer = RolloutBuffer(args.samples, args.max_new, args.budget if partial else None, args.max_staleness)
        core = RolloutCore(
            EnginePool([client]),
            buffer,
            prompts,
            RewardWorkers("exact_ids", inline=True),
            SamplingParams(max_new_tokens=args.max_new, temperature=args.temperature, stop_token_ids=stop),
        )
        steps = AbortSteps(core, args.prompts, oversample, keep=partial)
        await client.update_weight_version("0")
        seconds, trained, generated, lengths, rounds = 0.0, 0, 0, [], 0
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            groups, stats = await steps.batch(step)
            elapsed = time.perf_counter() - start
            # a training step's weight update (same weights here): the engine's caches are flushed
            await client.update_weights_from_disk(str(model), str(step + 1))
            if step < args.warmup:
                continue
            seconds += elapsed
            generated += stats["rollout/tokens"]
            rounds += stats["rollout/rounds"]
            for g in groups:
                for s in g.samples:
                    trained += len(s.response_ids)
                    lengths.append(len(s.response_ids))
        lengths.sort()
        return {
            "seconds_per_step": seconds / args.steps,
            "trained_per_step": trained / args.steps,
            "trained_per_s": trained / seconds,
            "generated_per_s": generated / seconds,
            "p50": lengths[len(lengths) // 2],
            "p99": lengths[int(len(lengths) * 0.99)],
            "dropped": buffer.counters["dropped_stale"],
            "rounds": rounds / args.steps,
        }


def table(label: str, results: list[tuple[str, list[dict[str, float]]]]) -> None:
    """One row per mode: the median and (min-max) over its repeats, and against full-length rollout
    repeat by repeat (repeat i of each mode ran side by side)."""
    print(label)
    header = (
        f"{'mode':<24} {'s/step':>7} {'trained tok/step':>17} {'trained tok/s':>20} {'vs full':>18} "
        f"{'gen tok/s':>10} {'len p50':>8} {'len p99':>8} {'stale drops':>12} {'rounds/step':>12}"
    )
    print(header)
    print("-" * len(header))
    full = results[0][1]
    for name, runs in results:
        rate = [r["trained_per_s"] for r in runs]
        ratio = [r["trained_per_s"] / f["trained_per_s"] for r, f in zip(runs, full, strict=True)]

        def med(key: str, runs=runs) -> float:
            return statistics.median(r[key] for r in runs)

        print(
            f"{name:<24} {med('seconds_per_step'):>7.2f} {med('trained_per_step'):>17.0f} "
            f"{_spread(rate, '{:.0f}'):>20} {_spread(ratio, '{:.2f}x'):>18} {med('generated_per_s'):>10.0f} "
            f"{med('p50'):>8.0f} {med('p99'):>8.0f} {med('dropped'):>12.0f} {med('rounds'):>12.1f}"
        )


def _spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))}({fmt.format(min(values))}-{fmt.format(max(values))})"


def modes(url: str, model: Path, args, time_scale: float = 1.0) -> list[tuple[str, list[dict[str, float]]]]:
    """Full-length, then partial at each oversample, --repeats times, interleaved (full, partial 2,
    partial 3, full, ...): a change in the machine's load hits every mode alike. Seconds are divided
    by time_scale (the modelled engine sleeps time_scale x its modelled time)."""
    settings = [("full-length", False, 1.0)] + [(f"partial, oversample {o:g}", True, o) for o in args.oversample]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in settings}
    for _ in range(args.repeats):
        for name, partial, oversample in settings:
            r = asyncio.run(run_mode(url, model, partial, oversample, args))
            r["seconds_per_step"] /= time_scale
            r["trained_per_s"] *= time_scale
            r["generated_per_s"] *= time_scale
            runs[name].append(r)
    return list(runs.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--head-scale", type=float, default=8.0)
    parser.add_argument("--temperature", type=float, default=0.4)
    parser.add_argument("--stop-tokens", type=int, default=4, help="stop ids among the 250-token vocabulary")
    parser.add_argument(
        "--oversample",
        type=float,
        nargs="+",
        default=[2.0, 3.0],
        help="groups in flight / groups per step (partial; a row each)",
    )
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument(
        "--engine",
        choices=["cpu", "gpu-model", "both"],
        default="both",
        help="the embedded CPU engine, the modelled GPU engine (modelled_engine.py), or both",
    )
    parser.add_argument(
        "--gpu-time-scale", type=float, default=0.25, help="the modelled engine runs this many times its modelled time"
    )
    args = parser.parse_args()
    from bapo_megatron.engines.launcher import embedded_server

    print(
        f"{args.prompts} prompts x {args.samples} samples per step; max_new_tokens {args.max_new}; partial: budget "
        f"{args.budget}, max_staleness {args.max_staleness}; {args.repeats} interleaved repeats of {args.steps} "
        f"steps after {args.warmup} warm-up; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    root = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    try:
        tiny_model(root / "model", head_scale=args.head_scale)
        if args.engine in ("cpu", "both"):
            server = embedded_server(root / "model", root / "engine.log").start().wait_ready(120)
            try:
                results = modes(server.url, root / "model", args)
            finally:
                server.stop()
            table(
                f"\nCPU: the embedded engine, tiny Qwen2 (vocab 250), {args.stop_tokens} stop ids, "
                f"{torch.get_num_threads()} threads (a CPU decode step costs more with every sequence it holds)",
                results,
            )
        if args.engine in ("gpu-model", "both"):
            from modelled_engine import H100_7B, ModelledEngine

            median = args.max_new * 150 / 512  # the CPU model's shape at the default 512: median 150
            engine = ModelledEngine(
                H100_7B, prompt_len=6, median=median, cap=args.max_new, time_scale=args.gpu_time_scale
            ).start()
            try:
                results = modes(engine.url, root / "model", args, args.gpu_time_scale)
            finally:
                engine.stop()
            table(
                "\nMODELLED GPU (no model runs; seconds are the cost model's): " + H100_7B.source + "; response "
                f"lengths scripted per sample, log-normal, median {median:.0f}, 15% reaching {args.max_new}",
                results,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(
        "vs full: trained tokens per second against full-length rollout (partial rows train the groups that "
        "finish first: compare trained tok/step and len p50); goal >= 1.5x on a GPU: the modelled engine here, "
        "SGLang on an H100 in benchmarks/RESULTS.md"
    )


if __name__ == "__main__":
    main()
