"""BAPO bound search: vectorised one-pass search against the plain loop, and the loss's cost.

    python benchmarks/bench_bapo_search.py                  # CPU, 1e5 / 1e6 / 4e6 tokens
    python benchmarks/bench_bapo_search.py --device cuda    # on a GPU

The data make the search walk its whole path (rho never reaches the target), the worst case
for the loop, which evaluates rho with one full pass over the tokens per path point (and, on
a GPU, one host synchronisation per point).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bapo_megatron.algo.bapo import PRESETS, BAPOConfig, search_clip_bounds, search_path
from bapo_megatron.algo.bapo_reference import search_clip_bounds_reference
from bapo_megatron.algo.losses import PolicyBatch, PolicyLossConfig, policy_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn() in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _tokens(n: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g) * 4
    logprobs = (old + torch.randn(n, generator=g) * 0.5).clamp(max=0)
    adv = torch.randn(n, generator=g) - 0.3
    mask = (torch.rand(n, generator=g) < 0.95).float()
    return [t.to(device) for t in (logprobs, old, adv, mask)]


def bench(n: int, cfg: BAPOConfig, device: torch.device, repeats: int) -> dict[str, float]:
    logprobs, old, adv, mask = _tokens(n, device)
    ratio = torch.exp(logprobs - old)
    fast = search_clip_bounds(ratio, adv, mask, cfg)
    slow = search_clip_bounds_reference(ratio, adv, mask, cfg)
    assert (fast.c_low, fast.c_high) == (slow.c_low, slow.c_high), (fast, slow)
    loss_cfg = PolicyLossConfig(loss="bapo", bapo=cfg)

    def loss_step():
        lp = logprobs.detach().requires_grad_()
        out = policy_loss(PolicyBatch(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask), loss_cfg, bounds=fast)
        (out.loss_sum / out.token_count).backward()

    search_ms = _time(lambda: search_clip_bounds(ratio, adv, mask, cfg), device, repeats)
    loop_ms = _time(lambda: search_clip_bounds_reference(ratio, adv, mask, cfg), device, max(1, repeats // 3))
    return {
        "points": fast.steps + 1,
        "search_ms": search_ms,
        "loop_ms": loop_ms,
        "speedup": loop_ms / search_ms,
        "loss_ms": _time(loss_step, device, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, nargs="+", default=[1e5, 1e6, 4e6])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="seed", choices=sorted(PRESETS))
    args = parser.parse_args()
    device = torch.device(args.device)
    # An unreachable target: the search visits every point of the path.
    cfg = BAPOConfig(**{**PRESETS[args.preset].__dict__, "target_rho": 0.999})
    print(
        f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, preset={args.preset}, "
        f"path of {len(search_path(cfg))} points"
    )
    header = f"{'tokens':>10} {'points':>7} {'search ms':>10} {'loop ms':>10} {'speedup':>8} {'loss f+b ms':>12}"
    print(header)
    print("-" * len(header))
    for n in args.tokens:
        row = bench(int(n), cfg, device, args.repeats)
        print(
            f"{int(n):>10.0e} {row['points']:>7} {row['search_ms']:>10.2f} {row['loop_ms']:>10.1f} "
            f"{row['speedup']:>7.1f}x {row['loss_ms']:>12.2f}"
        )


if __name__ == "__main__":
    main()
