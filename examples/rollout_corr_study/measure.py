"""How far the study's engine is from its trainer, before any training: the size check of README.md.

The embedded engine (as the study runs it: bf16, weights quantised to `levels` or not) samples
held-out prompts of the warm start at temperature 1; the same model in fp32 with transformers (the
trainer's numbers, its own routes for a MoE model) scores the sampled tokens. l = log pi - log mu per
token, and the shares of token, sequence and geometric weights outside verl's usual bounds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

BOUNDS = {"token": (0.5, 2.0), "sequence": (0.5, 2.0), "geometric": (0.95, 1.05)}
"""verl's usual bounds per weight level (IcePop's token bounds; a geometric band of +-5%)."""


def outside(weights: torch.Tensor, bounds: tuple[float, float]) -> float:
    """The share of `weights` outside [low, high] (0 for no weights)."""
    low, high = bounds
    return float(((weights < low) | (weights > high)).float().mean()) if weights.numel() else 0.0


def gap_stats(per_sequence: list[torch.Tensor]) -> dict:
    """The size figures of per-sequence log-ratio vectors l = log pi - log mu (float tensors)."""
    tokens = torch.cat(per_sequence) if per_sequence else torch.zeros(0)
    token_w = tokens.clamp(-20, 20).exp()
    seq_w = torch.tensor([float(s.sum()) for s in per_sequence]).clamp(-20, 20).exp()
    geo_w = torch.tensor([float(s.mean()) for s in per_sequence if s.numel()]).clamp(-20, 20).exp()
    return {
        "sequences": len(per_sequence),
        "tokens": tokens.numel(),
        "mean_abs_log_ratio": float(tokens.abs().mean()) if tokens.numel() else 0.0,
        "max_abs_log_ratio": float(tokens.abs().max()) if tokens.numel() else 0.0,
        "k3_kl": float((token_w - 1 - tokens).mean()) if tokens.numel() else 0.0,
        "token_outside": outside(token_w, BOUNDS["token"]),
        "sequence_outside": outside(seq_w, BOUNDS["sequence"]),
        "geometric_outside": outside(geo_w, BOUNDS["geometric"]),
    }


def _engine_samples(hf_dir: Path, prompts: list[list[int]], levels: int | None, new_tokens: int, seed: int):
    import engine_quantization

    from bapo_megatron.common.protocol import SamplingParams
    from bapo_megatron.engines.embedded import core as core_module
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    engine_quantization.patch_core(core_module, levels)
    core = core_module.EngineCore(hf_dir, seed=seed, max_batch=len(prompts), dtype=torch.bfloat16)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    requests = [EngineRequest(f"m{i}", list(p), sampling) for i, p in enumerate(prompts)]
    for r in requests:
        core.add(r)
    while core.busy:
        core.step()
    engine_quantization.patch_core(core_module, None)
    return [(r.output_ids, r.logprobs) for r in requests]


def measure(warm: Path, levels: int | None, prompts: int = 64, new_tokens: int = 24, seed: int = 0) -> dict:
    """gap_stats of the study's engine against fp32 on `prompts` held-out prompts of warm start `warm`."""
    import transformers

    from bapo_megatron.common.hf_model import load_causal_lm

    hf_dir = warm / "sft" / "hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=False)
    rows = [json.loads(line) for line in (warm / "task" / "heldout.jsonl").read_text().splitlines()][:prompts]
    ids = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    samples = _engine_samples(hf_dir, ids, levels, new_tokens, seed)
    exact = load_causal_lm(hf_dir, torch.float32)
    gaps = []
    with torch.no_grad():
        for prompt, (output, mu) in zip(ids, samples, strict=True):
            if not output:
                continue
            full = torch.tensor([prompt + output])
            logp = torch.log_softmax(exact(full).logits[0, :-1].float(), -1)
            pi = logp[len(prompt) - 1 :].gather(-1, torch.tensor(output)[:, None])[:, 0]
            gaps.append(pi - torch.tensor(mu))
    stats = gap_stats(gaps)
    stats["levels"] = levels
    stats["mean_response_tokens"] = stats["tokens"] / max(1, stats["sequences"])
    assert all(math.isfinite(v) for v in stats.values() if isinstance(v, float))
    return stats
