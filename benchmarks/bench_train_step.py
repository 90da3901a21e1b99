"""Throughput of one BAPO training step: tokens/s, TFLOP/s and MFU, per precision.

    python benchmarks/bench_train_step.py --shape qwen2.5-1.5b --impl local transformer_engine \
        --precision bf16 fp8 --fp8-recipe tensorwise blockwise         # one H100/H200
    python benchmarks/bench_train_step.py --shape tiny --precision fp32   # CPU smoke run

One row per (layer spec, precision, fp8 recipe): fp8 rows use Transformer Engine's spec only,
and fp32 rows the local one. Peak memory is that row's own (the allocator's peak is reset).

A step is what the trainer does: a forward-only pass (BAPO's step-scope bound search),
then forward and backward through Megatron's schedule, then the optimizer. FLOPs count
that work: 2N per token for the extra forward and 6N for forward + backward (N = matmul
parameters, the output layer included), plus causal attention, 2 * 2 * L * s * d per token
forward (half of the full s x s score matrix), three times that with backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import statistics
import traceback

import torch
from benchutil import SHAPES, timed

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.config import load_config
from bapo_megatron.models.spec import ModelSpec

PEAK_TFLOPS = {("H100", "bf16"): 989.0, ("H100", "fp8"): 1979.0, ("H200", "bf16"): 989.0, ("H200", "fp8"): 1979.0}
"""Dense peak of the SXM parts (NVIDIA's datasheet figures, without sparsity)."""


def matmul_params(spec: ModelSpec) -> int:
    d, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    attn = d * spec.num_heads * spec.head_dim + 2 * d * kv + spec.num_heads * spec.head_dim * d
    mlp = 3 * d * spec.ffn_hidden_size
    return spec.num_layers * (attn + mlp) + spec.vocab_size * d


def step_flops(spec: ModelSpec, tokens: int, seq: int) -> float:
    dense = 8 * matmul_params(spec) * tokens  # 2N forward-only pass + 6N forward/backward
    attention_fwd = 2 * 2 * spec.num_layers * (seq / 2) * spec.num_heads * spec.head_dim * tokens
    return dense + 4 * attention_fwd  # forward-only + forward + backward (2x)


def synthetic_batch(spec: ModelSpec, prompts: int, n: int, seq: int, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    samples = []
    prompt_len = seq // 4
    for g in range(prompts):
        prompt = [rng.randrange(spec.vocab_size) for _ in range(prompt_len)]
        for _ in range(n):
            r = seq - prompt_len
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(spec.vocab_size) for _ in range(r)],
                    behaviour_logprobs=[-2.0 + rng.gauss(0, 0.3) for _ in range(r)],
                    versions=[0] * r,
                    reward=rng.random(),
                    group=g,
                )
            )
    return RolloutBatch(samples=samples)


def bench(
    spec: ModelSpec, impl: str, precision: str, recipe: str, seq: int, prompts: int, n: int, steps: int, mb_tokens: int
) -> dict:
    from bapo_megatron.trainer.memory.estimate import trainer_memory
    from bapo_megatron.trainer.parallel import init_distributed, init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    cfg = load_config(
        None,
        [
            f"model.precision={precision}",
            f"model.transformer_impl={impl}",
            f"model.fp8_recipe={recipe}",
            f"parallel.max_tokens_per_microbatch={mb_tokens}",
            f"rollout.prompts_per_step={prompts}",
            f"rollout.samples_per_prompt={n}",
            "optimizer.lr=1e-6",
        ],
    )
    estimate = trainer_memory(spec, cfg.model, cfg.parallel, 1, distributed_optimizer=torch.cuda.is_available())
    init_distributed()
    if torch.cuda.is_available():  # this precision's peak only, not an earlier row's
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    batch = synthetic_batch(spec, prompts, n, seq)
    tokens = sum(s.length for s in batch.samples)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = timed(functools.partial(trainer.train_step, batch), steps, sync)
    seconds = statistics.median(times)
    tflops = step_flops(spec, tokens, seq) / seconds / 1e12
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    peak = next((v for (name, p), v in PEAK_TFLOPS.items() if name in device and p == precision), None)
    if torch.cuda.is_available():
        memory = torch.cuda.max_memory_allocated() / 2**30
    else:  # the process's peak resident set (CPU runs have one precision, fp32)
        import resource

        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    del trainer
    return {
        "impl": impl,
        "precision": precision,
        "recipe": recipe if precision == "fp8" else "-",
        "tokens": tokens,
        "seconds": seconds,
        "spread": (min(times), max(times)),
        "tokens_per_s": tokens / seconds,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "memory_gib": memory,
        "estimate_gib": estimate.peak / 2**30,
        "device": device,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument(
        "--layers", type=int, default=None, help="the shape's layers cut to this many (a 7B layer shape on one GPU)"
    )
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16", "fp8"])
    parser.add_argument(
        "--impl",
        nargs="+",
        default=None,
        choices=["local", "transformer_engine"],
        help="layer specs (default: by device)",
    )
    parser.add_argument(
        "--fp8-recipe", nargs="+", default=["tensorwise"], choices=["delayed", "tensorwise", "blockwise"]
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample (default 4096 GPU, 128 CPU)")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up (median reported)")
    parser.add_argument("--microbatch-tokens", type=int, default=None, help="token budget (default 2 samples)")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu:
        from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

        activate_cpu_shim()
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    from bapo_megatron.trainer.parallel import single_process_env

    single_process_env()
    spec = SHAPES[args.shape]
    if args.layers:
        spec = dataclasses.replace(spec, num_layers=args.layers)
    seq = args.seq or (4096 if gpu else 128)
    prompts = args.prompts or (8 if gpu else 2)
    mb_tokens = args.microbatch_tokens or 2 * seq
    impls = args.impl or (["transformer_engine"] if gpu else ["local"])
    plan = []
    for impl in impls:
        for precision in args.precision:
            if precision == "fp8" and impl != "transformer_engine":
                continue  # fp8 needs Transformer Engine's layers
            if precision == "fp32" and gpu:
                continue  # not a training precision on a GPU
            for recipe in args.fp8_recipe if precision == "fp8" else ["tensorwise"]:
                plan.append((impl, precision, recipe))
    rows, failed = [], []
    for impl, precision, recipe in plan:
        try:
            rows.append(
                bench(spec, impl, precision, recipe, seq, prompts, args.samples_per_prompt, args.steps, mb_tokens)
            )
        except Exception as err:  # one row's failure (an unsupported recipe, say) leaves the others standing
            traceback.print_exc()
            failed.append(f"{impl} {precision} {recipe}: {type(err).__name__}: {err}")
    if not rows:
        raise SystemExit("every row failed:\n" + "\n".join(failed))
    print(
        f"shape={args.shape}, {spec.num_layers} layers ({matmul_params(spec) / 1e6:,.1f}M matmul params), seq={seq}, "
        f"{prompts}x{args.samples_per_prompt} samples per step, {mb_tokens} tokens per micro-batch, "
        f"device={rows[0]['device']}, torch {torch.__version__}, median of {args.steps} steps"
    )
    header = (
        f"{'spec':>18} {'precision':>9} {'recipe':>10} {'tokens':>8} {'step s':>8} {'min-max s':>13} "
        f"{'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} {'est GiB':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"  # no peak figure for this device
        spread = f"{r['spread'][0]:.3f}-{r['spread'][1]:.3f}"
        print(
            f"{r['impl']:>18} {r['precision']:>9} {r['recipe']:>10} {r['tokens']:>8} {r['seconds']:>8.3f} "
            f"{spread:>13} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.2f} {mfu:>6} {_gib(r['memory_gib']):>8} "
            f"{_gib(r['estimate_gib']):>8}"
        )
    bf16 = next((r for r in rows if r["precision"] == "bf16" and r["impl"] == "transformer_engine"), None)
    for r in rows:
        if bf16 and r["precision"] == "fp8":
            print(f"fp8 ({r['recipe']}) / bf16 step throughput: {r['tokens_per_s'] / bf16['tokens_per_s']:.2f}x")
    for line in failed:
        print(f"failed: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "seq": seq, "prompts": prompts, "rows": rows, "failed": failed}, f, indent=1)


def _gib(value: float) -> str:
    """GiB to two decimals; a tiny model's below 0.01 to two significant digits (not 0.00)."""
    return f"{value:.2f}" if value >= 0.01 else f"{value:.1e}"


if __name__ == "__main__":
    main()
