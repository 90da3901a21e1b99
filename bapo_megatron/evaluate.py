"""Evaluate a Hugging Face model directory on held-out prompts with transformers (no engine, no
Megatron): greedy accuracy, avg@k and pass@k, read and scored as the loop reads and scores them.

    python -m bapo_megatron.evaluate MODEL_DIR HELDOUT --config runs/NAME/config.yaml
    python -m bapo_megatron.evaluate MODEL_DIR --config run.yaml eval.path=aime24.parquet data.chat_template=true
    python -m bapo_megatron.evaluate MODEL_DIR HELDOUT.jsonl --reward exact --max-new-tokens 8

The records go through the loop's readers (bapo_megatron/data/): jsonl, JSON or parquet (through
the Arrow cache), a file, a directory of shards or a glob, with the run's field map
(data.prompt_field, data.answer_field), chat template and system prompt; the reward is the run's
reward section (reward.function, reward.by with reward.table, the overlong penalty). --config
takes a run's config (its config.yaml, or the YAML it was started with) and key=value overrides
as bapo-train does; without it the config's defaults apply. Flags override the config. MODEL_DIR
without a tokenizer borrows the config's model.hf_path's; prompts of token ids need none (the
reward then sees the ids and empty text, as in the loop).

The same figures as the loop's eval/*, computed independently: this is the check that the
exported checkpoint is the trained policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import torch

from bapo_megatron.common import quiet
from bapo_megatron.common.hf_model import load_causal_lm
from bapo_megatron.config import DataConfig, JobConfig


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
    data: DataConfig | None = None,
    tokenizer_dir: str | Path | None = None,
    field: str = "heldout",
) -> dict[str, float]:
    """{"greedy_acc", "avg@k", "pass@k", "prompts"} of the model in model_dir on path's records,
    left-padded batches on the CPU (or the first GPU). data: the field map, chat template, system
    prompt and format to read them with (None: DataConfig's, text "prompt" and "answer");
    tokenizer_dir: where the tokenizer is when model_dir has none; field: what named `path`, for
    errors. reward is a reward.function name or a reward_spec. (The defaults are the demo's.)"""

    # Everything checked before the model is built: the directory, the reward, the records, the lengths.
    model = _Model(model_dir, tokenizer_dir)
    from bapo_megatron.rewards.functions import load_reward
    from bapo_megatron.rewards.functions import score as scored

    load_reward(reward)
    records = _read(model, path, field, data or DataConfig(), max_new_tokens, max_prompts, reward)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = load_causal_lm(model_dir, torch.float32).to(device)  # a quantized release dequantized
    generator = torch.Generator(device=device).manual_seed(seed)
    ends = torch.tensor(sorted(model.ends) or [-1], device=device)

    def generate(prompts: list[list[int]], greedy: bool) -> list[list[int]]:
        sampling = None if greedy else (temperature, generator)
        return _generate(net, model, prompts, max_new_tokens, sampling, ends)

    def score(response: list[int], record: dict) -> float:
        return scored(reward, model.decode(response), response, record)[0]  # unscorable: 0, as in training

    greedy_scores, sampled = [], [[] for _ in records]
    for start in range(0, len(records), batch_size):
        chunk = list(range(start, min(start + batch_size, len(records))))
        prompts = [records[i][0] for i in chunk]
        for i, response in zip(chunk, generate(prompts, greedy=True), strict=True):
            greedy_scores.append(score(response, records[i][1]))
        for _ in range(samples):
            for i, response in zip(chunk, generate(prompts, greedy=False), strict=True):
                sampled[i].append(score(response, records[i][1]))
    n = len(records)
    out = {"prompts": float(n), "greedy_acc": sum(greedy_scores) / n}
    if samples:
        out[f"avg@{samples}"] = sum(sum(v) / samples for v in sampled) / n
        out[f"pass@{samples}"] = sum(max(v) for v in sampled) / n
    return out


def _generate(net, model: _Model, prompts: list[list[int]], max_new_tokens: int, sampling, ends) -> list[list[int]]:
    """`net`'s responses to `prompts`, left-padded into one batch with a KV cache, each cut at its first
    end token (`ends`); sampling: (temperature, generator), or None for greedy decoding."""
    device = ends.device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[model.pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = []
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    cache, step_ids = None, ids
    with torch.no_grad():
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            result = net(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = result.past_key_values, result.logits[:, -1].float()
            if sampling is None:
                token = logits.argmax(-1)
            else:
                temperature, generator = sampling
                probs = torch.softmax(logits / temperature, -1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            token = torch.where(done, model.pad, token)
            out.append(token)
            done |= torch.isin(token, ends)
            step_ids = token[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)  # what follows the end is never read
            if done.all():
                break
    return [model.trim(row) for row in torch.stack(out, 1).tolist()]


class _Model:
    """A HF model directory's shape (its tensors checked against config.json), tokenizer (or
    tokenizer_dir's) and end tokens: the tokenizer's, config.json's and generation_config.json's
    eos_token_id, as the engines stop on them (none: responses run to --max-new-tokens)."""

    def __init__(self, model_dir: str | Path, tokenizer_dir: str | Path | None) -> None:
        from bapo_megatron.common.hf_io import HFCheckpoint
        from bapo_megatron.data.prompts import load_tokenizer

        root = Path(model_dir)
        if not (root / "config.json").is_file():
            raise ValueError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
        self.dir, self.spec = root, HFCheckpoint(model_dir).spec  # tensors, shapes and dtypes against config.json
        self.tokenizer = load_tokenizer(model_dir)
        source = model_dir
        if self.tokenizer is None and tokenizer_dir is not None:
            self.tokenizer, source = load_tokenizer(tokenizer_dir), tokenizer_dir
        if self.tokenizer is not None and len(self.tokenizer) > self.spec.vocab_size:
            raise ValueError(
                f"{source}: the tokenizer has {len(self.tokenizer)} tokens, more than the model's vocabulary "
                f"of {self.spec.vocab_size}"
            )
        self.ends = set()
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.ends.add(self.tokenizer.eos_token_id)
        for name in ("config.json", "generation_config.json"):
            if (root / name).is_file():
                self.ends |= _token_ids(root / name)
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        self.pad = pad if pad is not None else min(self.ends, default=0)

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"the prompt is text and {self.dir} has no tokenizer (tokenizer.json or tokenizer_config.json); "
                "give --config with the run's model.hf_path, or copy its tokenizer files there"
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def trim(self, row: list[int]) -> list[int]:
        """A generated row up to its first end token (kept), or whole."""
        end = next((i + 1 for i, t in enumerate(row) if t in self.ends), len(row))
        return row[:end]


def _token_ids(config_file: Path) -> set[int]:
    """The eos_token_id (an id or a list of them) a HF config file declares."""
    try:
        value = json.loads(config_file.read_text()).get("eos_token_id")
    except (ValueError, AttributeError):
        raise ValueError(f"{config_file}: not a JSON object") from None
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def _read(
    model: _Model,
    path: str | Path,
    field: str,
    data: DataConfig,
    max_new_tokens: int,
    max_prompts: int | None,
    reward: str,
) -> list[tuple[list[int], dict]]:
    """(prompt ids, the record as the reward gets it) of the first max_prompts usable records, read
    with the loop's PromptSource; ValueError naming `field`, the file and the record."""
    from bapo_megatron.data.prompts import PromptLimits, PromptSource
    from bapo_megatron.rewards.functions import load_reward

    context = model.spec.max_position_embeddings
    limits = PromptLimits(
        vocab_size=model.spec.vocab_size,
        max_tokens=context - max_new_tokens,
        reason=f"+ --max-new-tokens {max_new_tokens} exceed the model's context of {context}",
    )
    router = load_reward(reward)
    check = None
    if getattr(router, "by", None):

        def check(meta: dict) -> None:
            try:
                router.route(meta)
            except KeyError as err:
                raise ValueError(f"{err.args[0]} (reward.by)") from None

    source = PromptSource(
        dataclasses.replace(data, path=str(path), shuffle=False),
        model.tokenize,
        tokenizer=model.tokenizer,
        limits=limits,
        field=field,
        check=check,
    )
    records = source.first(max_prompts)
    if not records:
        raise ValueError(f"{field}={path}: no records")
    return records


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


OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.\w+)*=")
"""A key=value override among the positional arguments (a path has a / or a suffix before any =)."""


def _parser() -> argparse.ArgumentParser:
    base = JobConfig()
    sampling = base.rollout.sampling

    def default(key: str, value) -> str:
        return f"(default: {key} of --config and the overrides; {value} when neither sets it)"

    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m bapo_megatron.evaluate MODEL_DIR [HELDOUT] [--config RUN.yaml] [KEY=VALUE ...] [options]",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a Hugging Face model directory (an export)")
    parser.add_argument(
        "rest",
        nargs="*",
        metavar="HELDOUT | KEY=VALUE",
        help="the held-out records: a jsonl, JSON or parquet file, a directory of shards or a glob (default: "
        "the config's eval.path); then config overrides, as bapo-train takes them (data.prompt_field=question)",
    )
    parser.add_argument("--config", help="a run's config (runs/NAME/config.yaml, or the YAML it started with)")
    parser.add_argument(
        "--reward", help=f"a reward.function name {default('the reward section', repr(base.reward.function))}"
    )
    parser.add_argument(
        "--samples",
        type=_number(int, 0, "an integer"),
        help=f"k of avg@k and pass@k, 0: greedy only {default('eval.samples', base.eval.samples)}",
    )
    parser.add_argument(
        "--temperature",
        type=_number(float, 0.01, "a number"),
        help=default("rollout.sampling.temperature", sampling.temperature),
    )
    parser.add_argument(
        "--max-new-tokens",
        type=_number(int, 1, "an integer"),
        help=default("rollout.sampling.max_new_tokens", sampling.max_new_tokens),
    )
    parser.add_argument(
        "--max-prompts",
        type=_number(int, 1, "an integer"),
        help=f"the first this many records {default('eval.max_prompts', 'all')}",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the sampled answers (default: 0)")
    return parser


def _settings(args: argparse.Namespace) -> dict:
    """evaluate_hf's arguments from the config (--config and the overrides) and the flags over it."""
    from bapo_megatron.config import load_config
    from bapo_megatron.rewards.functions import reward_spec

    overrides = [a for a in args.rest if OVERRIDE.match(a)]
    paths = [a for a in args.rest if not OVERRIDE.match(a)]
    if len(paths) > 1:
        raise ValueError(f"one held-out set at a time, got {', '.join(paths)} (an override: section.field=value)")
    cfg = load_config(args.config, overrides)
    field, path = ("heldout", paths[0]) if paths else ("eval.path", cfg.eval.path)
    if path is None:
        sets = ", ".join(f"{name}: {one.path}" for name, one in cfg.eval.sets.items())
        raise ValueError(f"give HELDOUT, or a config with eval.path{f' (its eval.sets: {sets})' if sets else ''}")
    new = cfg.rollout.sampling.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    r = cfg.reward
    reward = args.reward or reward_spec(r.function, r.by, r.table, r.overlong_buffer, r.overlong_penalty_factor, new)
    return {
        "path": path,
        "field": field,
        "reward": reward,
        "samples": cfg.eval.samples if args.samples is None else args.samples,
        "temperature": cfg.rollout.sampling.temperature if args.temperature is None else args.temperature,
        "max_new_tokens": new,
        "max_prompts": cfg.eval.max_prompts if args.max_prompts is None else args.max_prompts,
        "seed": args.seed,
        "data": cfg.data,
        "tokenizer_dir": cfg.model.hf_path,
        "run_dir": cfg.run_path if args.config is not None and cfg.run_path.is_dir() else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    run_dir = None
    try:
        settings = _settings(args)
        run_dir = settings.pop("run_dir")
        # transformers' known notices off the console: in the run's warnings.log, as the run keeps
        # them (without a run, dropped: flush(None))
        quiet.hold_known_warnings()
        shown = {k: v for k, v in settings.items() if k not in ("data", "tokenizer_dir")}
        print(f"evaluate {args.model_dir}: {json.dumps(shown)}", file=sys.stderr, flush=True)
        result = evaluate_hf(args.model_dir, **settings)
    except (ValueError, OSError, KeyError) as err:  # (a config.json the spec cannot read: KeyError)
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        quiet.flush(run_dir)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
