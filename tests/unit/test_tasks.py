"""The built-in toy tasks: correct answers, held-out prompts never trained on, a character
tokenizer that round-trips, and a model directory that both Megatron's spec reader and
transformers load."""

import errno
import json
import os
import random
import re
from pathlib import Path

import pytest

from bapo_megatron.models import FAMILIES
from bapo_megatron.tasks import SPECIAL, SYMBOLS, TASKS, char_tokenizer, split, write_task

ROOT = Path(__file__).resolve().parents[2]


def test_answers_are_right():
    rng = random.Random(0)
    for _ in range(200):
        prompt, answer = TASKS["addition"].make(rng)
        a, b = prompt.rstrip("=").split("+")
        assert len(a) == len(b) == 3 and int(answer) == int(a) + int(b) and len(answer) == 4
        prompt, answer = TASKS["sort"].make(rng)
        assert prompt[0] == "s" and answer == "".join(sorted(prompt[1:-1]))
        assert set(prompt + answer) <= set(SYMBOLS)
        prompt, answer = TASKS["repeat"].make(rng)
        pattern, times = prompt.rstrip("=").split(",")
        assert 1 <= len(pattern) <= 3 and 1 <= int(times) <= 6 and answer == pattern * int(times)
        assert set(prompt + answer) <= set(SYMBOLS) and len(answer) <= TASKS["repeat"].max_answer_chars


def test_repeat_answers_vary_in_length():
    """(What the BAPO study needs: right answers of lengths from 1 to 18, pattern length x times.)"""
    rng = random.Random(1)
    lengths = {len(TASKS["repeat"].make(rng)[1]) for _ in range(2000)}
    assert lengths == {k * n for k in (1, 2, 3) for n in range(1, 7)}


def test_heldout_prompts_are_never_trained_on():
    train, held = split(TASKS["addition"], 5000, 500, seed=3)
    assert len(held) == len({p for p, _ in held}) == 500
    assert not {p for p, _ in train} & {p for p, _ in held}
    assert split(TASKS["addition"], 5000, 500, seed=3) == (train, held)  # seeded


def test_too_many_heldout_prompts_is_an_error():
    from bapo_megatron.tasks import Task

    five = Task("five", lambda rng: (str(rng.randrange(5)), "x"), 1, "five prompts in all")
    assert len(split(five, 3, 4, seed=0)[1]) == 4
    with pytest.raises(ValueError, match="5 held-out prompts leave none to train on"):
        split(five, 3, 5, seed=0)
    with pytest.raises(ValueError, match="cannot draw 6 distinct held-out prompts"):
        split(five, 3, 6, seed=0)


def test_tokenizer_round_trips_characters():
    tok = char_tokenizer()
    text = "123+045=0168"
    ids = tok.encode(text).ids
    assert ids == [len(SPECIAL) + SYMBOLS.index(c) for c in text]
    assert tok.decode([*ids, SPECIAL.index("<eos>")], skip_special_tokens=True) == text


def test_task_directory_loads(tmp_path):
    import transformers

    from bapo_megatron.data.prompts import load_tokenizer
    from bapo_megatron.models.spec import ModelSpec

    paths = write_task("addition", tmp_path, train=100, heldout=50)
    records = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert len(records) == 100 and set(records[0]) == {"prompt", "answer"}
    spec = ModelSpec.from_hf_dir(paths["model"])
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers, spec.tie_embeddings) == (16, 128, 4, True)
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["model"])
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    tok = load_tokenizer(paths["model"])
    assert tok.eos_token_id == SPECIAL.index("<eos>") == model.config.eos_token_id
    assert tok.decode(tok.encode(records[0]["prompt"], add_special_tokens=False)) == records[0]["prompt"]
    with pytest.raises(ValueError, match="data.task='nope'"):
        write_task("nope", tmp_path)


def _loss_shares(responses: list[tuple[str, bool]], answer: str, max_new_tokens: int) -> dict[str, float]:
    """A group's responses (text, ended with <eos>) scored by the demo's reward, given group
    advantages, and measured by the policy loss at ratio 1: the shares the study compares."""
    import torch

    from bapo_megatron.algo.advantages import AdvantageConfig, group_advantages, token_advantages
    from bapo_megatron.algo.losses import PolicyBatch, PolicyLossConfig, policy_loss
    from bapo_megatron.algo.metrics import reduce_metrics
    from bapo_megatron.rewards.functions import load_reward

    reward = load_reward("exact")
    rewards = torch.tensor([[reward(text[:max_new_tokens], [], {"answer": answer}) for text, _ in responses]])
    adv, _ = group_advantages(rewards, AdvantageConfig())
    lengths = [min(len(text) + ended, max_new_tokens) for text, ended in responses]
    mask = torch.tensor([[float(t < n) for t in range(max_new_tokens)] for n in lengths], dtype=torch.float64)
    old = torch.full_like(mask, -1.0)
    batch = PolicyBatch(logprobs=old.clone(), old_logprobs=old, advantages=token_advantages(adv[0], mask), mask=mask)
    from bapo_megatron.train import shares

    return shares(reduce_metrics([policy_loss(batch, PolicyLossConfig(loss="ppo"))]))


def test_repeat_wrong_answers_run_longer_and_carry_more_of_the_loss():
    """The mechanism the BAPO study needs: on `repeat` a response is wrong by running past its
    answer (up to max_new_tokens, scoring 0) as well as by stopping short, so wrong responses can
    be longer than right ones and, under the token-mean loss, negative tokens carry more than half
    of it. On `addition` every response is 4 digits and <eos>: the share is 0.5 by construction."""
    task = TASKS["repeat"]
    assert task.max_new_tokens > task.max_answer_chars + 1  # room to run on past the longest answer
    answer = "37" * 3
    runaway = "37" * 12  # never ends: cut at max_new_tokens
    group = [(answer, True), (answer, True), (answer + "37", True), (runaway, False)]
    shares = _loss_shares(group, answer, task.max_new_tokens)
    assert shares["policy/positive_loss_share"] < 0.5 < shares["policy/negative_token_share"]
    right, wrong = 2 * (len(answer) + 1), len(answer) + 3 + task.max_new_tokens
    assert shares["policy/positive_loss_share"] == pytest.approx(right / (right + wrong))  # |A| equal: 2 of 4 right

    addition = [("0168", True), ("0168", True), ("0167", True), ("1168", True)]
    shares = _loss_shares(addition, "0168", TASKS["addition"].max_new_tokens)
    assert shares["policy/positive_loss_share"] == pytest.approx(0.5)


def test_verl_data_reads_through_the_loops_readers(tmp_path):
    """`python -m bapo_megatron.tasks verl-data DIR`: parquet files in verl's gsm8k layout that the
    loop's PromptSource reads through the chat model's template, the ground truth where verl puts
    it, the solution a model writes scoring 1 with the gsm8k reward; the model without a template
    (the other tasks') is an error naming model.hf_path."""
    import pyarrow.parquet as pq

    from bapo_megatron.config import DataConfig
    from bapo_megatron.data.prompts import PromptSource, load_tokenizer
    from bapo_megatron.rewards.functions import load_reward
    from bapo_megatron.tasks import CHAT_TOKENS, main

    out = tmp_path / "verl"
    assert main(["verl-data", str(out), "--train", "30", "--heldout", "10", "--seed", "1"]) == 0
    train, test = (pq.read_table(out / f"{name}.parquet").to_pylist() for name in ("train", "test"))
    assert len(train) == 30 and len(test) == 10
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    row = train[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "openai/gsm8k" and row["reward_model"]["style"] == "rule"
    a, b = row["extra_info"]["question"].rstrip("=").split("+")
    assert row["reward_model"]["ground_truth"] == str(int(a) + int(b)) and row["extra_info"]["split"] == "train"
    assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["question"]}]

    tok = load_tokenizer(out / "model")
    config = DataConfig(
        path=str(out / "train.parquet"), answer_field="reward_model.ground_truth", cache_dir=str(tmp_path / "c")
    )
    source = PromptSource(config, tokenizer=tok)
    ids, meta = source.item(0)
    assert tok.decode(ids) == f"<user>{a}+{b}=<assistant>" and ids[0] == tok.convert_tokens_to_ids(CHAT_TOKENS[1])
    assert meta["answer"] == row["reward_model"]["ground_truth"] and meta["extra_info"] == row["extra_info"]
    mark = tok.encode("#### 12", add_special_tokens=False)
    assert len(mark) == 3 and tok.decode(mark) == "#### 12"  # the answer mark is one token
    gsm8k = load_reward("gsm8k")
    solutions = [(r["extra_info"]["answer"], r["reward_model"]["ground_truth"]) for r in train]
    assert all(gsm8k(solution, [], {"answer": truth}) == 1.0 for solution, truth in solutions)

    plain = write_task("addition", tmp_path / "plain", train=5, heldout=5)["model"]
    with pytest.raises(ValueError, match=r"record 1: chat messages need .* set model.hf_path to a model directory"):
        PromptSource(config, tokenizer=load_tokenizer(plain))


@pytest.fixture
def tasks_main(monkeypatch, capsys):
    """`python -m bapo_megatron.tasks ARGS` in this process: (exit code, its error lines)."""
    from bapo_megatron.tasks import main

    def run(*args: str) -> tuple[int, list[str]]:
        try:
            code = main(list(args))
        except SystemExit as stop:  # argparse's refusal of a flag's value
            code = stop.code
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        return code, [line for line in err.splitlines() if "error: " in line]

    return run


def _tree(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("task", ["verl-data", "addition"])
def test_a_directory_that_is_not_empty_is_refused_and_force_replaces_it_whole(tmp_path, tasks_main, task):
    """The user's own train.parquet is not overwritten; --force replaces the directory whole, so
    that a sharded model's stale index does not stay beside the new single file."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "train.parquet").write_text("the user's own data")
    (out / "model" / "model.safetensors.index.json").write_text("{}")
    code, errors = tasks_main(task, str(out), "--train", "10", "--heldout", "5")
    assert code == 2 and errors == [
        f"error: {out}: not empty (model, train.parquet): name a new or empty directory, or replace it with --force"
    ]
    assert (out / "train.parquet").read_text() == "the user's own data" and _tree(tmp_path) == {
        "out",
        "out/train.parquet",
        "out/model",
        "out/model/model.safetensors.index.json",
    }
    assert tasks_main(task, str(out), "--train", "10", "--heldout", "5", "--force") == (0, [])
    assert not (out / "model" / "model.safetensors.index.json").exists() and (out / "model" / "config.json").is_file()
    assert {p.name for p in tmp_path.iterdir()} == {"out"}  # nothing left beside it


@pytest.mark.parametrize(
    "args, said",
    [
        (["--train", "-5"], "argument --train: -5: must be at least 1"),
        (["--train", "0"], "argument --train: 0: must be at least 1"),
        (["--heldout", "0"], "argument --heldout: 0: must be at least 1"),
        (["--train", "many"], "argument --train: 'many' is not a whole number"),
        (["--heldout", "1000000"], "heldout=1000000: task verl-data has 100 distinct prompts, and at most half"),
        (["--heldout", "51"], "heldout=51: task verl-data has 100 distinct prompts, and at most half of them (50)"),
    ],
)
def test_counts_that_cannot_work_are_one_error_line_and_nothing_is_written(tmp_path, tasks_main, args, said):
    code, errors = tasks_main("verl-data", str(tmp_path / "out"), *args)
    assert code == 2 and len(errors) == 1 and said in errors[0], errors
    assert not any(tmp_path.iterdir())


def test_the_task_prompt_counts_bound_the_heldout_sets(tasks_main, tmp_path):
    from bapo_megatron.tasks import VERL_TASK, check_counts

    rng = random.Random(0)
    assert len({VERL_TASK.make(rng)[0] for _ in range(5000)}) == VERL_TASK.prompts == 100
    assert len({TASKS["repeat"].make(rng)[0] for _ in range(200_000)}) == TASKS["repeat"].prompts == 6660
    for name, task in TASKS.items():
        check_counts(task, 1, task.prompts // 2)
        with pytest.raises(ValueError, match=rf"heldout={task.prompts // 2 + 1}: task {name} has {task.prompts}"):
            check_counts(task, 1, task.prompts // 2 + 1)
    assert len(split(TASKS["repeat"], 10, 3330, seed=0)[1]) == 3330  # half is drawn in bounded time
    code, errors = tasks_main("repeat", str(tmp_path / "out"), "--heldout", "3331")
    assert code == 2 and "heldout=3331: task repeat has 6660 distinct prompts" in errors[0]


def test_paths_that_cannot_be_written_are_one_error_line_naming_them(tmp_path, tasks_main, monkeypatch):
    small = ["--train", "5", "--heldout", "5"]
    monkeypatch.chdir(tmp_path)
    assert tasks_main("verl-data", "", *small) == (
        2,
        ["error: the output directory is empty text: name one (it is made, with its parents)"],
    )
    assert tasks_main("addition", "  ", *small)[0] == 2 and not any(tmp_path.iterdir())  # not the working directory
    (tmp_path / "file").write_text("x")
    assert tasks_main("verl-data", str(tmp_path / "file"), *small)[1] == [
        f"error: {tmp_path / 'file'}: exists and is not a directory"
    ]
    assert tasks_main("verl-data", str(tmp_path / "file" / "out"), *small)[1] == [
        f"error: {tmp_path / 'file' / 'out'}: Not a directory"
    ]
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert tasks_main("verl-data", str(tmp_path / "a"), *small)[1] == [
        f"error: {tmp_path / 'a'}: Too many levels of symbolic links"
    ]
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    assert tasks_main("verl-data", str(tmp_path / "gone"), *small)[1] == [
        f"error: {tmp_path / 'gone'}: a symlink to nothing ({tmp_path / 'nowhere'})"
    ]

    def read_only(*args, **kwargs):  # (the tests may run as root, whom a read-only mode does not stop)
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ro" / ".out.x"))

    monkeypatch.setattr("bapo_megatron.tasks.tempfile.mkdtemp", read_only)
    assert tasks_main("verl-data", str(tmp_path / "ro" / "out"), *small)[1] == [
        f"error: {tmp_path / 'ro' / 'out'}: Permission denied ({tmp_path / 'ro' / '.out.x'})"
    ]
    assert _tree(tmp_path) == {"file", "a", "b", "gone", "ro"}  # the parent made, nothing in it


@pytest.mark.parametrize("task", ["verl-data", "addition"])
def test_a_full_disk_leaves_nothing_half_written(tmp_path, tasks_main, monkeypatch, task):
    """The data is written, then the model fails for want of space: no directory at all (nor the
    one it was written in), and the one error line names the path; an empty directory there
    stays as it was."""
    import bapo_megatron.tasks as tasks

    def full(model_dir, *args, **kwargs):
        model_dir.mkdir()
        (model_dir / "config.json").write_text("{")
        raise OSError(errno.ENOSPC, "No space left on device", str(model_dir / "model.safetensors"))

    monkeypatch.setattr(tasks, "write_model", full)
    out = tmp_path / "out"
    code, errors = tasks_main(task, str(out), "--train", "5", "--heldout", "5")
    assert code == 2 and len(errors) == 1, errors
    written = rf"{tmp_path}/\.out\.\w+/model/model.safetensors"
    assert re.fullmatch(rf"error: {out}: No space left on device \({written}\); nothing was written", errors[0]), errors
    assert not any(tmp_path.iterdir())
    out.mkdir()
    assert tasks_main(task, str(out), "--train", "5", "--heldout", "5")[0] == 2 and _tree(tmp_path) == {"out"}


def _earlier_output(out) -> set[str]:
    """A directory as `tasks addition` leaves it (the model's files stand in for a model)."""
    (out / "model").mkdir(parents=True)
    for name in ("train.jsonl", "heldout.jsonl", "model/config.json"):
        (out / name).write_text("{}")
    return {"train.jsonl", "heldout.jsonl", "model", "model/config.json"}


def test_force_replaces_an_earlier_output_directory_and_refuses_one_with_anything_else(tmp_path, tasks_main):
    """--force once took any directory whole; the user's own files in it are named and kept, and
    an output directory of one task is rewritten as another's."""
    out = tmp_path / "out"
    earlier = _earlier_output(out)
    (out / "notes.txt").write_text("the user's own notes")
    (out / "src").mkdir()
    (out / "test.parquet").mkdir()  # a name a task writes, but a directory where it writes a file
    small = ["--train", "5", "--heldout", "5"]
    assert tasks_main("verl-data", str(out), *small, "--force") == (
        2,
        [
            f"error: {out}: holds notes.txt, src, test.parquet, which no task writes: --force replaces only an "
            "earlier output directory (heldout.jsonl, test.parquet, train.jsonl, train.parquet, model/); "
            "name a new or empty directory"
        ],
    )
    assert tasks_main("verl-data", str(out), *small)[1] == [  # no hint of a --force that would not do
        f"error: {out}: not empty (heldout.jsonl, model, notes.txt, src, test.parquet and 1 more): "
        "name a new or empty directory"
    ]
    assert _tree(out) == earlier | {"notes.txt", "src", "test.parquet"}
    assert (out / "notes.txt").read_text() == "the user's own notes"
    (out / "notes.txt").unlink()
    (out / "src").rmdir()
    (out / "test.parquet").rmdir()
    assert tasks_main("verl-data", str(out), *small, "--force") == (0, [])
    assert {p.name for p in out.iterdir()} == {"train.parquet", "test.parquet", "model"}
    assert {p.name for p in tmp_path.iterdir()} == {"out"}


def test_the_working_directory_those_above_it_home_and_root_are_refused(tmp_path, tasks_main, monkeypatch):
    """`tasks verl-data . --force` in a checkout once set the checkout aside and removed it, taking
    the process's working directory with it; `~ --force` the user's home."""
    out = tmp_path / "out"
    earlier = _earlier_output(out)
    small = ["--train", "5", "--heldout", "5", "--force"]
    monkeypatch.chdir(out)
    assert tasks_main("addition", ".", *small)[1] == [
        f"error: .: the working directory ({out}): name a new directory, inside it or elsewhere"
    ]
    monkeypatch.chdir(out / "model")
    for name in (str(out), "..", str(tmp_path)):
        assert tasks_main("addition", name, *small)[1] == [
            f"error: {name}: holds the working directory ({out / 'model'}): name a new directory"
        ]
    (tmp_path / "link").symlink_to(out)
    assert tasks_main("addition", str(tmp_path / "link"), *small)[0] == 2  # whatever names it
    home = tmp_path / "home"
    _earlier_output(home)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path / "out" / "model")
    assert tasks_main("addition", str(home), *small)[1] == [
        f"error: {home}: the home directory ({home}): name a new directory under it"
    ]
    assert tasks_main("addition", "/", *small)[1] == ["error: /: the file system's root: name a new directory under it"]
    assert _tree(out) == earlier and _tree(home) == earlier and os.getcwd() == str(out / "model")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)  # new or empty, the working directory is still not replaced
    assert tasks_main("addition", ".", *small[:-1])[0] == 2 and not any(empty.iterdir())


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_every_family_gets_a_tiny_model_with_its_tokenizer_that_our_readers_load(tmp_path, tasks_main, architecture):
    """`python -m bapo_megatron.tasks TASK DIR --architecture NAME` for each family of the registry:
    config.json read back by the loop's reader (HFCheckpoint: the spec, and every tensor it implies
    with its shape) as the family's task model, the tokenizer's vocabulary and end token the model's."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.data.prompts import load_tokenizer

    code, errors = tasks_main(
        "sort", str(tmp_path / "out"), "--train", "4", "--heldout", "2", "--architecture", architecture
    )
    assert code == 0 and not errors, errors
    model = tmp_path / "out" / "model"
    checkpoint = HFCheckpoint(model)
    tokenizer = load_tokenizer(model)
    spec = checkpoint.spec
    assert spec == FAMILIES[architecture].task_model(len(tokenizer), spec.max_position_embeddings)
    assert spec.max_position_embeddings >= len("s123456=") + TASKS["sort"].max_new_tokens
    assert tokenizer.eos_token_id == json.loads((model / "config.json").read_text())["eos_token_id"]


def test_the_help_names_every_family_and_the_architectures_it_reads(capsys):
    from bapo_megatron.tasks import main

    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at any space
    for name, family in FAMILIES.items():
        assert f"{name} ({', '.join(family.architectures)})" in shown


def test_the_quick_demos_reward_tells_apart_what_exact_match_scores_alike():
    """examples/rewards/right_characters.py, loaded as the quick demo names it: a model at chance gets
    some characters right, which `exact` scores 0 all alike; only the answer itself scores 1."""
    from bapo_megatron.rewards.functions import load_reward

    reward = load_reward(f"{ROOT / 'examples' / 'rewards' / 'right_characters.py'}:right_characters")
    record = {"prompt": "123+045=", "answer": "0168"}
    scores = [reward(text, [], record) for text in ("0168", "0160", "0999", "9999", "", "01688888")]
    assert scores == [1.0, 0.75, 0.25, 0.0, 0.0, 0.5]
