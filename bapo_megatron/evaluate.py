"""Evaluate a Hugging Face model directory on held-out prompts with transformers (no engine, no
Megatron): greedy accuracy, avg@k and pass@k, scored with a reward (--reward: any name reward.function takes).

    python -m bapo_megatron.evaluate MODEL_DIR HELDOUT.jsonl --reward exact --samples 4

The same figures as the loop's eval/* (bapo_megatron/driver.py), computed independently: this is
the check that the exported checkpoint is the trained policy.
"""

from __future__ import annotations

import argparse
import json
import math
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

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.data.prompts import load_tokenizer
    from bapo_megatron.fsutil import read_jsonl
    from bapo_megatron.rewards.functions import load_reward
    from bapo_megatron.rewards.functions import score as scored

    # Everything checked before the model is built: the directory, the records, the lengths, the reward.
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    spec = HFCheckpoint(model_dir).spec  # its tensors, shapes and dtypes against config.json
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None or tokenizer.eos_token_id is None:
        raise ValueError(f"{model_dir}: no tokenizer with an end token")
    load_reward(reward)
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    records = read_jsonl(Path(path), _record_problem)[:max_prompts]
    if not records:
        raise ValueError(f"{path}: no records")

    def score(text: str, ids: list[int], record: dict) -> float:
        return scored(reward, text, ids, record)[0]  # a record the reward cannot score: 0, as in training

    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in records]
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    if len(prompts[longest]) + max_new_tokens > spec.max_position_embeddings:
        raise ValueError(
            f"{path} record {longest + 1}: its prompt ({len(prompts[longest])} tokens) + --max-new-tokens "
            f"{max_new_tokens} exceed the model's context of {spec.max_position_embeddings}"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
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


def _record_problem(record: dict) -> str | None:
    if not isinstance(record.get("prompt"), str) or not record["prompt"]:
        return "needs a text 'prompt'"
    return None


def _number(kind: type, low: float, what: str):
    """An argparse type: a finite number of `kind`, at least `low`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"{text} must be {what} >= {low:g}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("heldout", help="jsonl records with prompt and answer")
    parser.add_argument("--reward", default="exact")
    parser.add_argument(
        "--samples", type=_number(int, 0, "an integer"), default=4, help="k of avg@k and pass@k (0: greedy only)"
    )
    parser.add_argument("--temperature", type=_number(float, 0.01, "a number"), default=1.0)
    parser.add_argument("--max-new-tokens", type=_number(int, 1, "an integer"), default=8)
    parser.add_argument("--max-prompts", type=_number(int, 1, "an integer"), default=None)
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
    except (ValueError, OSError, KeyError) as err:  # (a config.json the spec cannot read: KeyError)
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
