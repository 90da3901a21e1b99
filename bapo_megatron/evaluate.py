"""Evaluate a Hugging Face model directory on held-out prompts with transformers (no engine, no
Megatron): greedy accuracy, avg@k and pass@k, scored with a reward of `rollout.rewards`.

    python -m bapo_megatron.evaluate MODEL_DIR HELDOUT.jsonl --reward exact --samples 4

The same figures as the loop's eval/* (bapo_megatron/driver.py), computed independently: this is
the check that the exported checkpoint is the trained policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def evaluate_hf(
    model_dir: str | Path,
    path: str | Path,
    *,
    reward: str = "exact",
    samples: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    max_prompts: int | None = None,
    batch_size: int = 256,
    seed: int = 0,
) -> dict[str, float]:
    """{"greedy_acc", "avg@k", "pass@k", "prompts"} of the model in model_dir on path's records
    (jsonl: prompt text and answer), left-padded batches on the CPU (or the first GPU)."""
    import transformers

    from bapo_megatron.rollout.data import load_tokenizer, read_records
    from bapo_megatron.rollout.rewards import load_reward

    score = load_reward(reward)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir}: no tokenizer")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    records = read_records(path, "jsonl")[:max_prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generator = torch.Generator(device=device).manual_seed(seed)

    def generate(prompts: list[list[int]], greedy: bool) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        out = []
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        cache, step_ids = None, ids
        with torch.no_grad():
            for _ in range(max_new_tokens):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
                result = model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                )
                cache, logits = result.past_key_values, result.logits[:, -1].float()
                if greedy:
                    token = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / temperature, -1)
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                token = torch.where(done, pad, token)
                out.append(token)
                done |= token == tokenizer.eos_token_id
                step_ids = token[:, None]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)  # what follows the end is never read
                if done.all():
                    break
        rows = torch.stack(out, 1).tolist()
        trimmed = []
        for row in rows:
            end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            trimmed.append(row[:end])
        return trimmed

    prompts = [tokenizer.encode(str(r["prompt"]), add_special_tokens=False) for r in records]
    greedy_scores, sampled = [], [[] for _ in records]
    for start in range(0, len(records), batch_size):
        chunk = list(range(start, min(start + batch_size, len(records))))
        for i, response in zip(chunk, generate([prompts[i] for i in chunk], greedy=True), strict=True):
            greedy_scores.append(score(tokenizer.decode(response, skip_special_tokens=True), response, records[i]))
        for _ in range(samples):
            for i, response in zip(chunk, generate([prompts[i] for i in chunk], greedy=False), strict=True):
                sampled[i].append(score(tokenizer.decode(response, skip_special_tokens=True), response, records[i]))
    n = len(records)
    out = {"prompts": float(n), "greedy_acc": sum(greedy_scores) / n}
    if samples:
        out[f"avg@{samples}"] = sum(sum(v) / samples for v in sampled) / n
        out[f"pass@{samples}"] = sum(max(v) for v in sampled) / n
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("heldout", help="jsonl records with prompt and answer")
    parser.add_argument("--reward", default="exact")
    parser.add_argument("--samples", type=int, default=4, help="k of avg@k and pass@k (0: greedy only)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        result = evaluate_hf(
            args.model_dir,
            args.heldout,
            reward=args.reward,
            samples=args.samples,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            max_prompts=args.max_prompts,
            seed=args.seed,
        )
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
