"""Built-in toy tasks that a tiny model learns on two CPU cores: verifiable answers, a
character-level tokenizer and a tiny model of any mapped family made from a config (nothing downloaded).

    python -m bapo_megatron.tasks addition runs/tasks/addition      # data + model directory
    python -m bapo_megatron.tasks addition runs/tasks/moe --architecture qwen3_moe   # another family

--architecture picks the model's family (default qwen2; every family of bapo_megatron/models, listed
below with the config.json architectures it reads): its task model of 0.8 to 2.1M parameters, the same
hidden size, layers and heads in each, with the family's own features (experts, latent or linear
attention, sinks), seeded random weights, and the tokenizer below.

writes, under the output directory:
  train.jsonl    {"prompt": "123+045=", "answer": "0168"} records (data.path of SFT and RL)
  heldout.jsonl  prompts never in train.jsonl, for evaluation
  model/         config.json, model.safetensors (seeded random weights), tokenizer.json and
                 tokenizer_config.json: model.hf_path of the first run, of --architecture's family
A response is the answer's characters followed by <eos>; the "exact" reward compares the
decoded text with the answer.

    python -m bapo_megatron.tasks verl-data runs/tiny-verl-data     # a verl-layout parquet + model

writes train.parquet and test.parquet in verl's gsm8k layout (data_source, prompt as chat
messages, ability, reward_model {style, ground_truth}, extra_info) over one-digit sums
("3+4=", ground truth "7", answered "#### 7"), and model/: the tiny model with the chat
tokenizer (the characters above, " ", "#", role markers and "#### " as tokens, a chat template).

The output directory is new or empty (--force replaces an earlier output directory: one that holds
only the names above, train.jsonl, heldout.jsonl, train.parquet, test.parquet and model/; any other
entry is refused by name, and so are the working directory, the directories above it, the home
directory and the file system's root): it is written whole, in a directory beside it renamed to it
at the end, or not at all; counts, paths and the disk's errors are one `error:` line naming them
(exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bapo_megatron.common.arguments import at_least_one
from bapo_megatron.models import FAMILIES, family_of

SPECIAL = ("<pad>", "<eos>")
SYMBOLS = tuple("0123456789+=s,")
"""Every task's characters: 16 tokens with the two special ones."""


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], tuple[str, str]]
    """One (prompt, answer) pair from the generator."""
    max_answer_chars: int
    doc: str
    max_new_tokens: int = 6
    """rollout.sampling.max_new_tokens for the task (the demo's): room for the longest answer and,
    where the task is about ending, for running past it."""
    prompts: int | None = None
    """How many distinct prompts `make` can draw (None: not known); at most half are held out."""


def _addition(digits: int) -> Callable[[random.Random], tuple[str, str]]:
    def make(rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(10**digits), rng.randrange(10**digits)
        return f"{a:0{digits}d}+{b:0{digits}d}=", f"{a + b:0{digits + 1}d}"  # fixed width: digits line up

    return make


def _sort(length: int) -> Callable[[random.Random], tuple[str, str]]:
    def make(rng: random.Random) -> tuple[str, str]:
        chars = [str(rng.randrange(10)) for _ in range(length)]
        return f"s{''.join(chars)}=", "".join(sorted(chars))

    return make


def _repeat(longest_pattern: int, most_times: int) -> Callable[[random.Random], tuple[str, str]]:
    def make(rng: random.Random) -> tuple[str, str]:
        pattern = "".join(str(rng.randrange(10)) for _ in range(rng.randint(1, longest_pattern)))
        times = rng.randint(1, most_times)
        return f"{pattern},{times}=", pattern * times

    return make


TASKS = {
    "addition": Task("addition", _addition(3), 4, "3-digit addition, zero-padded: '123+045=' -> '0168'", prompts=10**6),
    "sort": Task("sort", _sort(6), 6, "sort 6 digits: 's315024=' -> '012345'", prompts=10**6),
    "repeat": Task(
        "repeat",
        _repeat(3, 6),
        18,
        "a pattern of 1-3 digits, repeated 1-6 times: '37,3=' -> '373737'. Answers of 1 to 18 characters "
        "that the model must end itself: a response that does not stop runs on to rollout.sampling."
        "max_new_tokens and scores 0, so wrong responses run longer than right ones, as in reasoning",
        max_new_tokens=24,
        prompts=(10 + 100 + 1000) * 6,
    ),
}


def _one_digit_sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}=", str(a + b)


VERL_TASK = Task(
    "verl-data",
    _one_digit_sum,
    2,
    "one-digit sums in verl's gsm8k layout: '3+4=' with ground truth '7', answered '#### 7' (reward gsm8k)",
    max_new_tokens=4,
    prompts=100,
)
"""The verl-layout data set's problems (100 prompts in all): a random model writes the answer mark
and a right sum in about one response of 200, enough for the first groups with a reward."""


def check_counts(task: Task, train: int, heldout: int) -> None:
    """ValueError naming the count: `train` and `heldout` at least 1, `heldout` at most half of the
    task's distinct prompts (the rest are drawn for training; near all of them, the draws of
    distinct held-out prompts would run on)."""
    for name, count in (("train", train), ("heldout", heldout)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name}={count!r}: must be a whole number of prompts, at least 1")
    if task.prompts is not None and heldout > task.prompts // 2:
        raise ValueError(
            f"heldout={heldout}: task {task.name} has {task.prompts} distinct prompts, and at most half of them "
            f"({task.prompts // 2}) are held out: the rest are what it trains on"
        )


def split(task: Task, train: int, heldout: int, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """`train` and `heldout` (prompt, answer) pairs; no held-out prompt appears in the training set
    (training pairs may repeat, as draws from the task do)."""
    rng = random.Random(seed)
    held: dict[str, str] = {}
    misses = 0  # draws in a row that gave no new prompt
    while len(held) < heldout:
        prompt, answer = task.make(rng)
        misses = misses + 1 if prompt in held else 0
        held.setdefault(prompt, answer)
        if misses > 10_000:
            raise ValueError(f"task {task.name}: cannot draw {heldout} distinct held-out prompts")
    pairs: list[tuple[str, str]] = []
    misses = 0
    while len(pairs) < train:
        prompt, answer = task.make(rng)
        if prompt in held:
            misses += 1
            if misses > 10_000:
                raise ValueError(f"task {task.name}: {heldout} held-out prompts leave none to train on")
        else:
            pairs.append((prompt, answer))
            misses = 0
    return pairs, list(held.items())


def char_tokenizer(chat: bool = False):
    """A character-level `tokenizers` tokenizer over SPECIAL + SYMBOLS (ids in that order), and with
    `chat` CHAT_SYMBOLS + CHAT_TOKENS after them (the latter matched whole, before characters)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    tokens = SPECIAL + SYMBOLS + (CHAT_SYMBOLS + CHAT_TOKENS if chat else ())
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    tok.add_special_tokens(list(SPECIAL))
    if chat:
        tok.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in CHAT_TOKENS])
    return tok


CHAT_SYMBOLS = (" ", "#")
CHAT_TOKENS = ("<system>", "<user>", "<assistant>", "#### ")
"""The chat tokenizer's tokens beyond SPECIAL + SYMBOLS: two characters, then tokens matched whole
before characters: the role markers and gsm8k's answer mark ("####" is one token in BPE
vocabularies too), so that a random model writes the mark as often as a digit."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""The chat tokenizer's template: each turn as its role marker and its content."""


def tiny_config(
    architecture: str = "qwen2",
    max_positions: int = 64,
    vocab_size: int = len(SPECIAL) + len(SYMBOLS),
) -> dict:
    """The config.json of family `architecture`'s tiny task model (its task_model: about 1M
    parameters, hidden 128 x 4 layers, 4 heads (2 KV), tied embeddings; Qwen3-MoE with 8 experts of
    width 128, top-2), with the character tokenizer's special tokens (vocabulary 16, the chat
    tokenizer's 22)."""
    family = family_of(architecture)
    return {
        **family.to_hf(family.task_model(vocab_size, max_positions)),
        "bos_token_id": SPECIAL.index("<eos>"),
        "eos_token_id": SPECIAL.index("<eos>"),
        "pad_token_id": SPECIAL.index("<pad>"),
        "torch_dtype": "float32",
    }


def write_model(directory: str | Path, seed: int = 0, architecture: str = "qwen2", chat: bool = False) -> Path:
    """A tiny model (tiny_config(architecture)) with seeded random weights and the character tokenizer, in
    HF format; with `chat`, the chat tokenizer (char_tokenizer(chat=True)) and CHAT_TEMPLATE."""
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = char_tokenizer(chat)
    config = transformers.AutoConfig.for_model(**tiny_config(architecture, vocab_size=tokenizer.get_vocab_size()))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": config.max_position_embeddings}
    if chat:
        settings["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


TASK_OUTPUTS = {"train": "train.jsonl", "heldout": "heldout.jsonl", "model": "model"}
"""What write_task writes under its directory, by the key of the paths it returns."""
VERL_OUTPUTS = {"train": "train.parquet", "test": "test.parquet", "model": "model"}
"""What write_verl_data writes under its directory, by the key of the paths it returns."""
OUTPUT_DIRS = frozenset({"model"})
OUTPUT_FILES = frozenset({*TASK_OUTPUTS.values(), *VERL_OUTPUTS.values()}) - OUTPUT_DIRS
"""The entries of an earlier output directory (of any task: one may be rewritten as another), the
only ones --force replaces."""


def write_task(
    name: str, out: str | Path, train: int = 20000, heldout: int = 1000, seed: int = 0, architecture: str = "qwen2"
) -> dict[str, Path]:
    """train.jsonl, heldout.jsonl and model/ (tiny_config(architecture)) for task `name` under `out`;
    returns their paths."""
    if name not in TASKS:
        raise ValueError(f"data.task={name!r}: expected one of {sorted(TASKS)}")
    check_counts(TASKS[name], train, heldout)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pairs, held = split(TASKS[name], train, heldout, seed)
    paths = {key: out / name for key, name in TASK_OUTPUTS.items()}
    for key, rows in (("train", pairs), ("heldout", held)):
        paths[key].write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    write_model(paths["model"], seed, architecture)
    return paths


def verl_records(pairs: list[tuple[str, str]], split_name: str) -> list[dict]:
    """(question, answer) pairs as the rows of verl's gsm8k preprocessing (examples/data_preprocess/
    gsm8k.py): the ground truth is the bare number, extra_info.answer the solution a model writes."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split_name, "index": i, "answer": f"#### {answer}", "question": question},
        }
        for i, (question, answer) in enumerate(pairs)
    ]


def write_verl_data(
    out: str | Path, train: int = 2000, heldout: int = 20, seed: int = 0, architecture: str = "qwen2"
) -> dict[str, Path]:
    """train.parquet and test.parquet (verl's gsm8k layout, VERL_TASK's problems; no test prompt in
    train) and model/ (the tiny model with the chat tokenizer) under `out`; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_counts(VERL_TASK, train, heldout)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pairs, held = split(VERL_TASK, train, heldout, seed)
    paths = {key: out / name for key, name in VERL_OUTPUTS.items()}
    for key, rows in (("train", pairs), ("test", held)):
        pq.write_table(pa.Table.from_pylist(verl_records(rows, key)), paths[key])
    write_model(paths["model"], seed, architecture, chat=True)
    return paths


def staged(out: str, force: bool, write: Callable[[Path], dict[str, Path]]) -> dict[str, Path]:
    """write(directory) into a new directory beside `out`, renamed to `out` when it is done, so that
    a failure leaves `out` as it was and nothing beside it. `out` must be new or an empty directory
    (force: or an earlier output directory, which is replaced), never empty text, something else,
    nor a directory the user stands in or lives in (_target); a symlink to a directory is followed.
    ValueError naming the path for each, and for any OSError on the way."""
    try:
        target = _target(out)
        held = _held(out, target, force)
        target.parent.mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        umask = os.umask(0)
        os.umask(umask)
        fresh.chmod(0o777 & ~umask)  # mkdtemp's is private; the directory is the user's as mkdir makes it
    except OSError as err:
        raise ValueError(f"{out}: {_said(err, Path(os.path.abspath(out)))}") from None
    try:
        paths = write(fresh)
        _swap(fresh, target, replace=bool(held))
    except OSError as err:
        raise ValueError(f"{out}: {_said(err, target)}; nothing was written") from None
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # gone already, renamed, unless the write failed
    return {key: target / path.relative_to(fresh) for key, path in paths.items()}


def _target(out: str) -> Path:
    """`out` as an absolute path (a symlink's directory, followed), or ValueError naming it: empty
    text, a dangling symlink, not a directory, or one that replacing would pull from under the user
    (the working directory or one above it: renamed away, the process stands nowhere; the home
    directory; the root)."""
    if not out.strip():
        raise ValueError("the output directory is empty text: name one (it is made, with its parents)")
    target = Path(os.path.abspath(out))  # "." too: the new directory goes beside it, not inside
    try:
        os.stat(target)  # a symlink loop: ELOOP here, where Path.exists would say False
    except FileNotFoundError:
        if target.is_symlink():
            raise ValueError(f"{out}: a symlink to nothing ({os.readlink(target)})") from None
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    real = Path(os.path.realpath(target))  # the directory that would be replaced, whatever names it
    if real.parent == real:
        raise ValueError(f"{out}: the file system's root: name a new directory under it")
    cwd = Path(os.getcwd())
    if real == cwd:
        raise ValueError(f"{out}: the working directory ({cwd}): name a new directory, inside it or elsewhere")
    if real in cwd.parents:
        raise ValueError(f"{out}: holds the working directory ({cwd}): name a new directory")
    home = os.path.expanduser("~")
    if home != "~" and real == Path(os.path.realpath(home)):
        raise ValueError(f"{out}: the home directory ({home}): name a new directory under it")
    if target.exists() and not target.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    return target


def _held(out: str, target: Path, force: bool) -> list[str]:
    """The entries of `target` (none when it is new), or ValueError naming them: any at all without
    `force`; with it, any that no task writes (OUTPUT_FILES, OUTPUT_DIRS), which are not replaced."""
    held = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    foreign = [name for name in held if not _is_output(target / name)]
    if held and not force:
        hint = "" if foreign else ", or replace it with --force"
        raise ValueError(f"{out}: not empty ({_listed(held)}): name a new or empty directory{hint}")
    if foreign:
        raise ValueError(
            f"{out}: holds {_listed(foreign)}, which no task writes: --force replaces only an earlier output "
            f"directory ({', '.join(sorted(OUTPUT_FILES))}, {'/, '.join(sorted(OUTPUT_DIRS))}/); "
            "name a new or empty directory"
        )
    return held


def _is_output(path: Path) -> bool:
    """Whether `path` is one that a task writes: by name and kind (the tool writes no symlinks)."""
    if path.is_symlink():
        return False
    return path.is_dir() if path.name in OUTPUT_DIRS else path.name in OUTPUT_FILES and path.is_file()


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _swap(fresh: Path, target: Path, replace: bool) -> None:
    """`fresh` renamed to `target` (an empty directory there is replaced by the rename itself; a
    full one, when `replace`, is set aside first and removed after)."""
    if not replace:
        os.rename(fresh, target)
        return
    aside = fresh.with_name(fresh.name + ".old")
    os.rename(target, aside)
    try:
        os.rename(fresh, target)
    except OSError:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _said(err: OSError, target: Path) -> str:
    """An OSError as words, with the file it names when that is not `target` itself."""
    what = err.strerror or str(err)
    where = err.filename if err.filename and Path(err.filename) != target else None
    return f"{what} ({where})" if where else what


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=[*sorted(TASKS), VERL_TASK.name])
    parser.add_argument("out", help="a new or empty directory (made with its parents); written whole or not at all")
    parser.add_argument("--train", type=at_least_one, help="training prompts (default 20000; verl-data 2000)")
    parser.add_argument(
        "--heldout",
        type=at_least_one,
        help="held-out prompts, at most half of the task's distinct ones (default 1000; verl-data 20 of its 100)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--architecture",
        default="qwen2",
        choices=sorted(FAMILIES),
        metavar="FAMILY",
        help="the tiny model's family (default qwen2), by the config.json architectures it reads: "
        + "; ".join(f"{name} ({', '.join(FAMILIES[name].architectures)})" for name in sorted(FAMILIES)),
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT when it is an earlier output directory: one holding only "
        f"{', '.join(sorted(OUTPUT_FILES))} and {'/, '.join(sorted(OUTPUT_DIRS))}/ (any other entry is refused); "
        "never the working directory nor one above it, the home directory or the root",
    )
    args = parser.parse_args(argv)
    verl = args.task == VERL_TASK.name
    train = args.train if args.train is not None else 2000 if verl else 20000
    heldout = args.heldout if args.heldout is not None else 20 if verl else 1000
    try:
        check_counts(VERL_TASK if verl else TASKS[args.task], train, heldout)  # before anything is made
        if verl:
            paths = staged(
                args.out, args.force, lambda d: write_verl_data(d, train, heldout, args.seed, args.architecture)
            )
        else:
            paths = staged(
                args.out, args.force, lambda d: write_task(args.task, d, train, heldout, args.seed, args.architecture)
            )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for key, path in paths.items():
        print(f"{key}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
