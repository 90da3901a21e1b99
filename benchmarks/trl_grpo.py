"""TRL's GRPOTrainer on the demo's warm start, each step timed: bench_vs_trl.py's TRL half, run
under a Python that has trl (never imported by the package or the tests).

    python benchmarks/trl_grpo.py OUT --hf SFT_EXPORT --train TRAIN.jsonl [--steps 30] [--prompts 32] ...

Writes OUT/steps.json (per step: seconds of the step, of generation, of the reward, of the rest
(train), generated tokens) and OUT/model (the trained model, HF format).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def train(args) -> None:
    """GRPOTrainer on the warm start, timing each step's generation, reward and the rest."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    out = Path(args.out)
    # as the project reads it (bapo_megatron/data/prompts.py load_tokenizer): tokenizer.json as it is;
    # AutoTokenizer would rebuild it as config.json's family does (Qwen2's adds a token)
    settings = json.loads((Path(args.hf) / "tokenizer_config.json").read_text())
    special = {k: v for k, v in settings.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token") and v}
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(args.hf) / "tokenizer.json"), **special)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32, trust_remote_code=False)
    rows = [json.loads(line) for line in Path(args.train).read_text().splitlines()]
    for r in rows[:50]:  # the project encodes prompts without special tokens: TRL's call must agree
        if tokenizer(r["prompt"])["input_ids"] != tokenizer.encode(r["prompt"], add_special_tokens=False):
            raise SystemExit(f"{args.hf}: TRL would tokenize {r['prompt']!r} unlike the project")
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows])

    def exact(completions, answer, **_) -> list[float]:  # the project's reward.function=exact
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        **{"per_device_train_batch_size": args.prompts * args.samples, "num_generations": args.samples},
        **{"max_completion_length": args.max_new, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
        **{"learning_rate": args.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0},
        **{"max_grad_norm": 1.0, "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "num_iterations": 1},
        **{"bf16": False, "fp16": False, "gradient_checkpointing": False, "use_cpu": True},
        **{"max_steps": args.steps, "logging_steps": 1, "report_to": "none", "save_strategy": "no"},
        **{"seed": args.seed, "disable_tqdm": True, "dataloader_num_workers": 0},
    )
    clock = StepClock()
    trainer = timed_trainer(GRPOTrainer, clock)(
        model=model, reward_funcs=exact, args=config, train_dataset=data, processing_class=tokenizer
    )
    trainer.add_callback(clock.callback())
    trainer.train()
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    (out / "steps.json").write_text(json.dumps(clock.steps))


class StepClock:
    """Seconds spent in named parts of the current step; a step's record when it ends."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.tokens = 0
        self.steps: list[dict] = []
        self.last = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    def end_step(self) -> None:
        now = time.perf_counter()
        step, p = now - self.last, self.parts
        self.steps.append(
            {
                "step": step,
                "generate": p.get("generate", 0.0),
                "reward": p.get("reward", 0.0),
                "train": step - p.get("rollout", 0.0),  # the rest: log-probs, loss, backward, optimizer
                "sync": 0.0,  # generation runs on the trained weights themselves
                "tokens": self.tokens,
            }
        )
        self.parts, self.tokens, self.last = {}, 0, now

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class StepEnd(TrainerCallback):
            def on_train_begin(self, *a, **k):
                clock.last = time.perf_counter()

            def on_step_end(self, *a, **k):
                clock.end_step()

        return StepEnd()


def timed_trainer(base, clock: StepClock):
    """GRPOTrainer with its generation, reward and whole-rollout calls timed into `clock`."""

    def timed(name: str, method):
        def wrapper(self, *a, **k):
            start = time.perf_counter()
            try:
                return method(self, *a, **k)
            finally:
                clock.add(name, time.perf_counter() - start)

        return wrapper

    def generate(self, *a, **k):
        completion_ids, logprobs = base._generate_single_turn(self, *a, **k)
        clock.tokens += sum(len(c) for c in completion_ids)
        return completion_ids, logprobs

    return type(
        "TimedGRPOTrainer",
        (base,),
        {
            "_generate_single_turn": timed("generate", generate),
            "_calculate_rewards": timed("reward", base._calculate_rewards),
            "_generate_and_score_completions": timed("rollout", base._generate_and_score_completions),
        },
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--hf", required=True, help="the warm start's HF export")
    parser.add_argument("--train", required=True, help="the task's train.jsonl (prompt, answer)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
