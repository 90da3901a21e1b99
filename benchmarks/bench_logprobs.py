"""Log-prob and entropy of every token from [tokens, vocab] logits, forward + backward: the
per-chunk work op by op against the torch.compile'd kernels (model.fused_logprobs).

    python benchmarks/bench_logprobs.py                        # one GPU: 8192 tokens x 151,936, bf16
    python benchmarks/bench_logprobs.py --tokens 256 --vocab 32000 --dtype float32   # CPU smoke run

"x floor": against the least any kernels can take, reading the logits once forward and once
backward and writing their gradient once: 1.5 device-to-device copies of the logits, as timed here.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from benchutil import timed

from bapo_megatron.trainer.logprobs import vocab_parallel_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--budget-mb", type=int, default=1024, help="model.logprob_memory_mb")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    logits = torch.randn(args.tokens, args.vocab, device=device, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(args.vocab, (args.tokens,), device=device, generator=g)

    def run(fused: bool):
        logits.grad = None
        logp, entropy = vocab_parallel_logprobs(
            logits, targets, group=None, memory_budget_bytes=args.budget_mb << 20, fused=fused
        )
        (logp.sum() + entropy.sum()).backward()

    copy = timed(lambda: logits.detach().clone(), args.repeat, sync)
    floor = 1.5 * statistics.median(copy)  # a copy reads and writes the logits' size once each
    rows = [
        ("op by op", timed(lambda: run(False), args.repeat, sync)),
        ("fused (torch.compile)", timed(lambda: run(True), args.repeat, sync)),
    ]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{args.tokens} tokens x {args.vocab} vocab, {args.dtype}, device={name}, median of {args.repeat}")
    header = f"{'forward + backward':<22} {'ms':>9} {'min-max ms':>17} {'x floor':>8}"
    print(header)
    print("-" * len(header))
    for label, times in rows:
        median = statistics.median(times)
        print(
            f"{label:<22} {median * 1e3:>9.2f} {f'{min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}':>17} "
            f"{median / floor:>8.2f}"
        )


if __name__ == "__main__":
    main()
