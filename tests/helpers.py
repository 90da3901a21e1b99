"""Shared by the test tiers: small random models and rollout batches, the SGLang launch under test."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from pathlib import Path

import torch

from bapo_megatron.common.batch import RolloutBatch, Sample

CASES = {"qwen2-gqa2": ("qwen2", 2, False), "llama-gqa4-tied": ("llama", 1, True), "qwen2-mha": ("qwen2", 4, False)}
"""Model shapes the conversion and layout tests cover: (architecture, kv heads, tied embeddings)."""


def make_hf_model(root: Path, name: str, case: tuple[str, int, bool] | None = None):
    """A random HF model saved under root/name; `case` = (architecture, kv heads, tied), default CASES[name]."""
    import tokenizers
    import transformers

    from bapo_megatron.models.spec import tiny_spec

    arch, kv, tied = case or CASES[name]
    spec = dataclasses.replace(tiny_spec(arch), num_kv_heads=kv, tie_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**spec.to_hf_config()), dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_((1.0 if "norm" in pname else 0.0) + 0.08 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / name, max_shard_size="100KB")  # several shards and an index
    vocab = {f"t{i}": i for i in range(spec.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.save(str(root / name / "tokenizer.json"))
    return model


def make_batch(seed: int, groups: int = 4, n: int = 4, max_len: int = 12, temperature: float = 1.0) -> RolloutBatch:
    """Random groups of n samples with behaviour log-probs around -5.5, as a replayed rollout batch."""
    rng = random.Random(seed)
    samples = []
    for group in range(groups):
        prompt = [rng.randrange(250) for _ in range(rng.randint(2, 6))]
        for _ in range(n):
            length = rng.randint(1, max_len)
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(250) for _ in range(length)],
                    behaviour_logprobs=[-5.5 + rng.gauss(0, 0.6) for _ in range(length)],
                    versions=[0] * length,
                    reward=rng.random(),
                    group=group,
                )
            )
    return RolloutBatch(samples=samples, temperature=temperature)


SGLANG_DOCUMENTED = (
    "rollout.engines.sglang_args={attention_backend: fa3, chunked-prefill-size: 8192, "
    "disable-decode-cuda-graph: true, disable-prefill-cuda-graph: true, max-running-requests: null}"
)
"""The further SGLang options the config's documentation shows."""

SGLANG_LAUNCH = [
    "rollout.engines.kind=sglang",
    "rollout.engines.colocate=true",
    "rollout.engines.host=10.0.0.5",
    "rollout.engines.servers=2",
    "rollout.engines.tensor_parallel=2",
    "rollout.deterministic=true",
    SGLANG_DOCUMENTED,
]
"""Two colocated deterministic servers beyond loopback (a generated key), the documented further options."""


HOSTILE_REWARDS = """
import os, sys, time
held = []
def good(text, ids, record):
    return float(len(ids))
def hang(text, ids, record):
    time.sleep(3600)
def slow_once(text, ids, record):
    try:  # created atomically: two workers checking at once cannot both be the first
        os.close(os.open(record["flag"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return 1.0
    time.sleep(3600)
def leak(text, ids, record):
    held.append(bytearray(64 * 2**20))  # kept: the worker grows with every call
    return 1.0
def exits(text, ids, record):
    sys.exit(0)
def dies(text, ids, record):
    os._exit(3)
def infinite(text, ids, record):
    return float("inf")
def huge(text, ids, record):
    return 1e308
def nothing(text, ids, record):
    return None
def text_out(text, ids, record):
    return "1.0 maybe"
def arity(text):
    return 1.0
def raises(text, ids, record):
    return 1 / 0
"""
"""Reward functions as users write them by mistake (reward.function="FILE:name"): they hang, leak,
exit, die, or return what is not a reward."""


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def word_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A transformers tokenizer over whitespace-separated words (w0..w63 and the template's role
    markers), with `chat_template`: what a model directory's tokenizer gives PromptSource."""
    import tokenizers
    import transformers

    vocab = {f"w{i}": i for i in range(64)} | {
        m: 64 + i for i, m in enumerate(["<system>", "<user>", "<assistant>", "</s>"])
    }
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, unk_token="w0")


def verl_parquet(path: Path, prompts: list, answers: list[str], sources: list[str] | None = None) -> Path:
    """A parquet file in verl's layout: data_source, prompt (chat messages), ability,
    reward_model {ground_truth, style}, extra_info {index, split}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(prompts)
    table = pa.table(
        {
            "data_source": sources or ["math_dapo"] * n,
            "prompt": [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts],
            "ability": ["MATH"] * n,
            "reward_model": [{"ground_truth": a, "style": "rule-lax"} for a in answers],
            "extra_info": [{"index": i, "split": "train"} for i in range(n)],
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


VERL_VERSION = "0.9.1"


def verl_module(path: str):
    """A module of verl's released wheel (verl==VERL_VERSION, downloaded once as SGLang's is), for
    modules that import only the standard library: verl's own code, run unchanged. Skips the
    calling test when the registry cannot be reached."""
    import types
    import zipfile

    import pytest

    from tests.sglang_wheel import WheelUnavailable, wheel_path

    try:
        wheel = wheel_path("verl", VERL_VERSION)
    except WheelUnavailable as err:
        pytest.skip(str(err))
    module = types.ModuleType(path.replace("/", ".").removesuffix(".py"))
    with zipfile.ZipFile(wheel) as whl:
        exec(compile(whl.read(path).decode(), f"verl-{VERL_VERSION}/{path}", "exec"), module.__dict__)
    return module


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant of it."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def shm_files(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes hold open or mapped now (named semaphores, shared memory):
    what a kill of them could leave behind, and nothing of any other job's. A named semaphore is
    mapped under the temporary name glibc made it with (deleted since), so files are matched by
    inode, not by the name in the map."""
    inodes = set()
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    inodes.add(int(fields[4]))
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).startswith("/dev/shm/"):
                    inodes.add(os.stat(fd).st_ino)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile
    found = set()
    for path in Path("/dev/shm").iterdir() if inodes else ():
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
            if path.stat().st_ino in inodes:
                found.add(str(path))
    return found
