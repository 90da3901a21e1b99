"""Packing efficiency (real over computed tokens) of a step's micro-batches, padded against packed,
on realistic response-length distributions at the presets' layouts, with and without a virtual
pipeline. No model runs: the micro-batch plans are the trainer's own (trainer/packing.py), and
the computed tokens are what the forward passes run over (rows x padded length; a packed row is as
long as its samples, under a virtual pipeline as a rank's longest row, rounded up to the layout's
sequence multiple).

    python benchmarks/bench_packing.py [--seeds 5] [--steps 1]

A step is one optimizer step's samples (prompts x samples per prompt / updates per batch), each
prompt's samples sharing its prompt; response lengths are log-normal with the given median,
capped at the longest response (a reasoning model's long tail: a few responses hit the cap).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass

from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.trainer.megatron_config import sequence_multiple
from bapo_megatron.trainer.packing import PackedLayout, PaddedLayout, ThdAttention


@dataclass(frozen=True)
class Lengths:
    """A response-length distribution: log-normal around `median`, capped at `cap`."""

    name: str
    median: int
    cap: int
    sigma: float = 0.8
    prompt: tuple[int, int] = (100, 600)

    def draw(self, rng: random.Random, prompts: int, per_prompt: int) -> list[int]:
        out = []
        for _ in range(prompts):
            prompt = rng.randint(*self.prompt)
            out += [
                prompt + min(self.cap, max(1, int(rng.lognormvariate(math.log(self.median), self.sigma))))
                for _ in range(per_prompt)
            ]
        return out


DISTRIBUTIONS = [
    Lengths("math, median 1.5k, cap 8k", 1536, 8192),
    Lengths("reasoning, median 4k, cap 16k", 4096, 16384),
    Lengths("long reasoning, median 8k, cap 32k", 8192, 32768),
]

# (name, parallel layout, world size, prompts a step, samples a prompt): the presets' layouts
LAYOUTS = [
    ("7B: TP4, DP2", dict(tensor=4, sequence_parallel=True), 8),
    ("7B: TP4 x PP2 x VPP2", dict(tensor=4, pipeline=2, virtual_pipeline=2, sequence_parallel=True), 8),
    ("32B: TP8 x PP2, DP2", dict(tensor=8, pipeline=2, sequence_parallel=True), 32),
    ("32B: TP8 x PP2 x VPP2, DP2", dict(tensor=8, pipeline=2, virtual_pipeline=2, sequence_parallel=True), 32),
    ("30B-A3B: TP4 x EP8, DP8", dict(tensor=4, expert=8, sequence_parallel=True), 32),
]
SAMPLES_PER_STEP = 512  # the presets: 64 prompts x 16 samples, two optimizer steps a batch


def efficiency(layout, lengths: list[int], dp: int, multiple_of: int) -> tuple[float, int]:
    """(real over computed tokens, micro-batches a rank) of one step."""
    plan = layout.plan(lengths, dp, multiple_of)
    return sum(lengths) / layout.computed_tokens(lengths, plan), len(plan[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="steps drawn per row (median [min, max] shown)")
    parser.add_argument("--samples", type=int, default=SAMPLES_PER_STEP, help="samples per optimizer step")
    args = parser.parse_args()
    model = ModelConfig(transformer_impl="transformer_engine", precision="bf16")
    print("| lengths | layout | budget | padded | packed | micro-batches a rank (padded / packed) |")
    print("|---|---|---|---|---|---|")
    for dist in DISTRIBUTIONS:
        budget = dist.cap + dist.prompt[1]
        for name, fields, world in LAYOUTS:
            parallel = ParallelConfig(**fields, max_tokens_per_microbatch=budget)
            dp = parallel.data_parallel_size(world)
            multiple = parallel.pipeline if parallel.virtual_pipeline else 1
            seq = sequence_multiple(model, parallel)
            padded = PaddedLayout(budget, seq, uniform=parallel.virtual_pipeline is not None)
            packed = PackedLayout(budget, seq, parallel.virtual_pipeline is not None, ThdAttention())
            rows = {"padded": [], "packed": []}
            for seed in range(args.seeds):
                lengths = dist.draw(random.Random(seed), args.samples // 16, 16)
                rows["padded"].append(efficiency(padded, lengths, dp, multiple))
                rows["packed"].append(efficiency(packed, lengths, dp, multiple))
            cells = []
            for kind in ("padded", "packed"):
                values = [e for e, _ in rows[kind]]
                cells.append(f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]")
            counts = " / ".join(str(statistics.median(n for _, n in rows[kind])) for kind in ("padded", "packed"))
            print(f"| {dist.name} | {name} | {budget} | {cells[0]} | {cells[1]} | {counts} |")


if __name__ == "__main__":
    main()
