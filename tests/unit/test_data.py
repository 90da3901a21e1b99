"""Prompt data as users bring it: jsonl, JSON and parquet files or shards, verl's layout (chat
messages, nested answers), field maps with dotted paths, a system prompt, overlong prompts dropped
or refused; one clear error naming the record for what cannot work; a cursor that resumes exactly."""

import json
import os
import re

import pytest

from bapo_megatron.config import DataConfig
from bapo_megatron.data.prompts import PromptLimits, PromptSource
from bapo_megatron.data.records import data_files
from tests.helpers import verl_parquet, word_tokenizer


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_text_and_ids_with_field_map(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"q": "a b", "sol": "1"}, {"q": [5, 6], "sol": "2"}])
    source = PromptSource(
        DataConfig(path=str(path), prompt_field="q", answer_field="sol", shuffle=False),
        tokenize=lambda text: [len(w) for w in text.split()],
    )
    assert source.next() == ("e0-0", [1, 1], {"sol": "1", "answer": "1", "index": 0})
    assert source.next()[1:] == ([5, 6], {"sol": "2", "answer": "2", "index": 1})
    assert source.next()[0] == "e1-0"  # the next epoch


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [[1, 2], [3]], "answer": ["x", "y"]}), tmp_path / "d.parquet")
    config = DataConfig(path=str(tmp_path / "d.parquet"), shuffle=False, cache_dir=str(tmp_path / "cache"))
    source = PromptSource(config)  # the format from the suffix
    assert [source.next()[1] for _ in range(2)] == [[1, 2], [3]]


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        PromptSource(DataConfig(path=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1]}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        PromptSource(DataConfig(path=str(bad)))
    with pytest.raises(ValueError, match=r"record 1 \(line 1\): no field 'question'"):
        PromptSource(DataConfig(path=str(_jsonl(tmp_path / "f.jsonl", [{"prompt": [1]}])), prompt_field="question"))
    with pytest.raises(ValueError, match="no tokenizer"):
        PromptSource(DataConfig(path=str(_jsonl(tmp_path / "t.jsonl", [{"prompt": "text"}]))))
    with pytest.raises(ValueError, match="empty prompt"):
        PromptSource(DataConfig(path=str(_jsonl(tmp_path / "e.jsonl", [{"prompt": []}]))))


def test_cursor_resumes_exactly(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": [i + 1]} for i in range(7)])
    config = DataConfig(path=str(path), shuffle=True, seed=3)
    straight = PromptSource(config)
    expected = [straight.next() for _ in range(17)]
    first = PromptSource(config)
    got = [first.next() for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSource(config)
    resumed.load_state_dict(state)
    got += [resumed.next() for _ in range(8)]
    assert got == expected
    assert sorted(x[1][0] for x in expected[:7]) == list(range(1, 8))  # an epoch is a permutation
    shorter = PromptSource(DataConfig(path=str(_jsonl(tmp_path / "s.jsonl", [{"prompt": [1]}]))))
    with pytest.raises(ValueError, match="not the same data"):
        shorter.load_state_dict(state)


def _source(path, tokenizer=None, **fields):
    return PromptSource(DataConfig(path=str(path), shuffle=False, cache_dir=str(path.parent / "cache"), **fields),
                        tokenizer=tokenizer)  # fmt: skip


def test_verl_parquet_trains_as_it_is(tmp_path):
    """verl's layout: chat messages rendered through the chat template, the answer at a dotted
    path, the whole record (nested fields, data_source) handed to the reward."""
    path = verl_parquet(tmp_path / "train.parquet", ["w5 w6", "w7"], ["12", "34"])
    source = _source(path, word_tokenizer(), answer_field="reward_model.ground_truth")
    uid, ids, meta = source.next()
    assert ids == [65, 5, 6, 67, 66]  # <user> w5 w6 </s> <assistant>
    assert meta["answer"] == "12" and meta["data_source"] == "math_dapo"
    assert meta["reward_model"] == {"ground_truth": "12", "style": "rule-lax"} and meta["extra_info"]["index"] == 0
    assert "prompt" not in meta and uid == "e0-0"
    system = _source(path, word_tokenizer(), system_prompt="w9", answer_field="reward_model.ground_truth")
    assert system.next()[1] == [64, 9, 67, 65, 5, 6, 67, 66]  # <system> w9 </s> first
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"q": {"text": "w3"}}) + "\n")
    assert _source(text, word_tokenizer(), prompt_field="q.text").next()[1] == [3]
    assert _source(text, word_tokenizer(), prompt_field="q.text", chat_template=True).next()[1] == [65, 3, 67, 66]


def test_format_from_suffix_shards_and_globs(tmp_path):
    shards = tmp_path / "shards"
    for k in range(3):
        verl_parquet(shards / f"part-{k}.parquet", [f"w{k + 1}"], [str(k)])
    (shards / "README.md").write_text("not data")
    whole = _source(shards, word_tokenizer(), answer_field="reward_model.ground_truth")
    assert len(whole) == 3 and [whole.next()[2]["answer"] for _ in range(3)] == ["0", "1", "2"]
    two = _source(tmp_path / "shards" / "part-[12].parquet", word_tokenizer())
    assert len(two) == 2 and two.records.where(1).endswith("part-2.parquet record 1")
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"prompt": [1]}, {"prompt": [2, 3]}]))
    assert _source(array).next()[1] == [1] and _source(array).first(2)[1][0] == [2, 3]
    lines = tmp_path / "l.json"
    lines.write_text('{"prompt": [4]}\n')
    assert _source(lines).next()[1] == [4]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("absent-path", r"record 2 \(line 2\): no field 'reward.truth' \(data.prompt_field; reward has no 'truth'\)"),
        ("not-messages", r"record 1: message 1 must be \{'role': str, 'content': str\}; got keys \['text'\]"),
        ("no-content", r"record 1 \(line 1\): message 1 \(user\) has no text content; got a list of str"),
        ("no-template", "chat messages need the model directory's chat template"),
        ("bad-shard", r"bad.parquet: not a parquet file"),
        ("no-suffix", r"data.txt has no known suffix \(.jsonl, .json, .parquet\): set data.format"),
        ("mixed", r"shards of different formats \(jsonl, parquet\)"),
        ("system-ids", "data.system_prompt cannot be added to a prompt of token ids"),
        ("not-json", r"x.json: not JSON"),
        ("empty-glob", "the pattern matches no file"),
    ],
)
def test_what_cannot_work_is_one_error_naming_the_record(tmp_path, case, message):
    tok = word_tokenizer()
    path, fields = tmp_path / "d.jsonl", {}
    if case == "absent-path":
        path.write_text(
            json.dumps({"prompt": [1], "reward": {"truth": [1]}}) + "\n" + json.dumps({"prompt": [1], "reward": {}})
        )
        with pytest.raises(ValueError, match=message):  # a nested answer absent is as absent a prompt
            _source(path, tok, prompt_field="reward.truth")
        return
    if case == "not-messages":
        path = verl_parquet(tmp_path / "d.parquet", [[{"text": "w1"}]], ["1"])
    elif case == "no-content":
        path.write_text(json.dumps({"prompt": [{"role": "user", "content": ["w1"]}]}) + "\n")
    elif case == "no-template":
        path = verl_parquet(tmp_path / "d.parquet", ["w1"], ["1"])
        tok = word_tokenizer(chat_template=None)
    elif case == "bad-shard":
        verl_parquet(tmp_path / "shards" / "good.parquet", ["w1"], ["1"])
        (tmp_path / "shards" / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
        path = tmp_path / "shards"
    elif case == "no-suffix":
        path = tmp_path / "data.txt"
        path.write_text("{}")
    elif case == "mixed":
        verl_parquet(tmp_path / "m" / "a.parquet", ["w1"], ["1"])
        (tmp_path / "m" / "b.jsonl").write_text('{"prompt": [1]}\n')
        path = tmp_path / "m"
    elif case == "system-ids":
        path.write_text('{"prompt": [1]}\n')
        fields = {"system_prompt": "w1"}
    elif case == "not-json":
        path = tmp_path / "x.json"
        path.write_text("[{oops")
    elif case == "empty-glob":
        path = tmp_path / "nothing-*.parquet"
    with pytest.raises(ValueError, match=message):
        _source(path, tok, **fields)
    assert not list((tmp_path / "cache").glob("*.tmp")) if (tmp_path / "cache").exists() else True


def test_overlong_prompts_are_dropped_and_counted_or_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": list(range(1, n + 1))}) + "\n" for n in (2, 9, 3, 8, 1)))
    config = DataConfig(path=str(path), shuffle=True, seed=1, max_prompt_tokens=4, check_records=2)
    source = PromptSource(config)
    assert source.dropped == 1  # of the two checked ahead
    drawn = [source.next() for _ in range(6)]  # two epochs of the three that fit
    assert sorted(len(ids) for _, ids, _ in drawn[:3]) == [1, 2, 3] and source.dropped == 2
    resumed = PromptSource(config)
    for _ in range(4):
        resumed.next()
    state = json.loads(json.dumps(resumed.state_dict()))
    again = PromptSource(config)
    again.load_state_dict(state)
    assert [again.next() for _ in range(2)] == drawn[4:] and again.dropped == 2
    refuse = DataConfig(path=str(path), shuffle=False, max_prompt_tokens=4, overlong_prompts="error")
    with pytest.raises(ValueError, match=r"record 2 \(line 2\): its prompt has 9 tokens, more than data.max_prompt"):
        PromptSource(refuse)
    hard = PromptLimits(vocab_size=100, max_tokens=5, reason="+ 3 new tokens exceed the context")
    with pytest.raises(ValueError, match=r"record 2 \(line 2\): its prompt \(9 tokens\) \+ 3 new tokens exceed"):
        PromptSource(DataConfig(path=str(path), shuffle=False), limits=hard)
    with pytest.raises(ValueError, match=r"record 2 \(line 2\): a token id outside the model's vocabulary \[0, 5\)"):
        PromptSource(DataConfig(path=str(path), shuffle=False), limits=PromptLimits(vocab_size=5))


def test_records_past_the_checked_ones_are_read_when_drawn(tmp_path):
    """A large file is not read up front: a bad record past data.check_records is found when it is
    drawn, as one error naming it."""
    from bapo_megatron.errors import BadInputError

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": [1]}\n{"prompt": [2]}\n{"prompt": "oops"}\n')
    source = PromptSource(DataConfig(path=str(path), shuffle=False, check_records=2))
    assert [source.next()[1] for _ in range(2)] == [[1], [2]]
    with pytest.raises(BadInputError, match=r"record 3 \(line 3\): the prompt is text and no tokenizer"):
        source.next()


def test_parquet_is_decoded_once_into_a_cache_it_reuses(tmp_path):
    path = verl_parquet(tmp_path / "d.parquet", ["w1", "w2"], ["1", "2"])
    _source(path, word_tokenizer())
    (cache,) = (tmp_path / "cache").glob("d-*.arrow")
    made = cache.stat().st_mtime_ns
    _source(path, word_tokenizer())
    assert [p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("d-*.arrow")] == [made]  # reused
    verl_parquet(path, ["w3"], ["3"])  # the file changes: a cache of its own
    os.utime(path, ns=(made + 10**9, made + 10**9))
    changed = _source(path, word_tokenizer(), answer_field="reward_model.ground_truth")
    assert len(changed) == 1 and changed.next()[2]["answer"] == "3"
    assert len(list((tmp_path / "cache").glob("d-*.arrow"))) == 2


def test_the_jsonl_line_index_agrees_with_a_plain_read(tmp_path, monkeypatch):
    """The chunked scan (line ends across chunk borders, blank and white-space lines, no final
    newline) finds the records a plain splitlines() does, at chunk sizes from 1 byte up."""
    import random

    from bapo_megatron.data import records

    rng = random.Random(0)
    for trial in range(150):
        lines = [
            rng.choice(["", " ", "\t", "  \r"])
            if rng.random() < 0.3
            else " " * rng.randint(0, 2) + json.dumps({"a": i, "s": "x" * rng.randint(0, 9)})
            for i in range(rng.randint(1, 12))
        ]
        text = "\n".join(lines) + rng.choice(["", "\n"])
        path = tmp_path / f"{trial}.jsonl"
        path.write_text(text)
        want = [json.loads(line) for line in text.splitlines() if line.strip()]
        monkeypatch.setattr(records, "SCAN_BYTES", rng.randint(1, 30))
        if not want:
            with pytest.raises(ValueError, match="no records"):
                records.open_records(str(path))
            continue
        got = records.open_records(str(path))
        assert [got.record(i) for i in range(len(got))] == want, text


def test_the_arrow_cache_holds_every_row_where_a_plain_read_has_it(tmp_path, monkeypatch):
    """Row groups of any size become batches of CACHE_BATCH rows (the rest carried into the next
    group): record i of the cache is row i of the parquet file, read with pyarrow as it is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bapo_megatron.data import arrow_cache, records

    rows = [{"prompt": [i + 1, i + 2], "meta": {"k": i}} for i in range(23)]
    for group, batch in [(5, 7), (23, 4), (3, 32), (7, 7)]:
        path = tmp_path / f"g{group}-b{batch}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=group)
        monkeypatch.setattr(arrow_cache, "CACHE_BATCH", batch)
        shard = records.ParquetShard(path, tmp_path / "cache")
        assert len(shard) == 23
        want = pq.read_table(path).to_pylist()
        order = [*range(23), 22, 0, 13, 13, 5]
        assert [shard.record(i) for i in order] == [want[i] for i in order], (group, batch)


def test_one_field_of_every_record_read_alone_agrees_with_a_plain_read(tmp_path, monkeypatch):
    """Records.first_of_each (the field alone: pyarrow's JSON parser over the jsonl lines a few at a
    time, a parquet column) finds every value a record-by-record read does, each at its first record:
    text, numbers, objects, null and absent (both None), nested paths, a key holding the whole
    dotted name, and lines pyarrow's parser refuses (read record by record instead)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from bapo_megatron.common.fields import MissingField, get_field
    from bapo_megatron.data import records

    def plain(rows, field):
        first = {}
        for i, row in enumerate(rows):
            try:
                value = get_field(row, field)
            except MissingField:
                value = None
            first.setdefault(None if value is None else str(value), i)
        return first

    rng = random.Random(0)
    texts = ["a", "b", "c", None]
    for trial in range(60):
        kinds = rng.choice([texts, texts, [*texts, 7], [*texts, {"x": 1}]])
        rows = []
        for i in range(rng.randint(1, 40)):
            row = {"prompt": [i + 1], "m": {"s": rng.choice(texts)}}
            if rng.random() < 0.9:
                row["d"] = rng.choice(kinds)
            if rng.random() < 0.2:
                del row["m"]["s"]
            rows.append(row)
        if trial % 10 == 0:
            rows[-1]["m.s"] = "whole"
        path = tmp_path / f"{trial}.jsonl"
        path.write_text("".join(json.dumps(r) + rng.choice(["\n", "\n\n", "\n  \n"]) for r in rows))
        monkeypatch.setattr(records, "FIELD_SCAN_BYTES", rng.randint(1, 300))
        got = records.open_records(str(path))
        for field in ("d", "m.s", "absent"):
            assert got.first_of_each(field) == plain(rows, field), (trial, field)
        if kinds is texts and trial % 10:
            parquet = tmp_path / f"{trial}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=7)
            got, stored = records.open_records(str(parquet), cache_dir=tmp_path / "cache"), pq.read_table(parquet)
            for field in ("d", "m.s", "m", "absent", "m.s.t"):
                assert got.first_of_each(field) == plain(stored.to_pylist(), field), (trial, field)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"d": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        records.open_records(str(bad)).first_of_each("d")


BAD_TEMPLATES = {
    "syntax": (
        "{% for m in messages %}{{ m['content'] }{% endfor %}",
        r"TemplateSyntaxError \(line 1\): unexpected '}'",
    ),
    "raise_exception": (  # as real templates refuse a role they do not take
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ raise_exception('Only system and assistant roles "
        "are supported!') }}{% endif %}{% endfor %}",
        r"TemplateError: Only system and assistant roles are supported!",
    ),
    "sandbox": ("{{ messages.append(messages[0]) }}", r"SecurityError: access to attribute 'append' of 'list' object"),
}
"""Chat templates that cannot render a user turn, and what their one error line says."""


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The tiny chat model of `tasks verl-data` (weights, tokenizer, template): copied per test."""
    from bapo_megatron.tasks import write_model

    return write_model(tmp_path_factory.mktemp("chat") / "model", chat=True)


def _with_template(model_dir, tmp_path, template: str, in_jinja: bool):
    """A copy of model_dir whose chat template is `template`, in tokenizer_config.json or in
    chat_template.jinja (then none in tokenizer_config.json)."""
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "model")
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    settings.pop("chat_template")
    if in_jinja:
        (copy / "chat_template.jinja").write_text(template)
    else:
        settings["chat_template"] = template
    (copy / "tokenizer_config.json").write_text(json.dumps(settings))
    return copy, copy / ("chat_template.jinja" if in_jinja else "tokenizer_config.json")


@pytest.mark.parametrize("in_jinja", [False, True], ids=["tokenizer_config", "jinja_file"])
@pytest.mark.parametrize("kind", sorted(BAD_TEMPLATES))
def test_a_template_that_does_not_render_is_one_error_naming_its_file(chat_model_dir, tmp_path, kind, in_jinja):
    """Where the prompts are first rendered (the records checked before anything starts): a
    ValueError naming the record, the template's file and jinja's error, in one line."""
    from bapo_megatron.data.prompts import load_tokenizer

    template, said = BAD_TEMPLATES[kind]
    model, source = _with_template(chat_model_dir, tmp_path, template, in_jinja)
    data = verl_parquet(tmp_path / "train.parquet", ["1+2="], ["3"])
    config = DataConfig(path=str(data), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError) as err:
        PromptSource(config, tokenizer=load_tokenizer(model))
    assert "\n" not in str(err.value)
    assert re.fullmatch(
        rf"data.path: \S+train.parquet record 1: the chat template \({re.escape(str(source))}\) does not render "
        rf"its messages: {said}.*",
        str(err.value),
    ), str(err.value)


@pytest.mark.parametrize("kind", sorted(BAD_TEMPLATES))
def test_bapo_trains_dry_run_and_evaluate_end_in_that_line(chat_model_dir, tmp_path, capsys, kind):
    """`bapo-train --dry-run` and `evaluate` (bapo-train itself reads the prompts through the same
    RolloutInputs as its dry run): exit 2 and one `error:` line, no traceback, before any engine or model."""
    from bapo_megatron.evaluate import main as evaluate
    from bapo_megatron.train import main as train

    template, said = BAD_TEMPLATES[kind]
    model, source = _with_template(chat_model_dir, tmp_path, template, in_jinja=False)
    data = verl_parquet(tmp_path / "train.parquet", ["1+2="], ["3"])
    overrides = [f"model.hf_path={model}", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}"]
    overrides += ["data.answer_field=reward_model.ground_truth", "reward.function=exact"]
    overrides += ["rollout.sampling.max_new_tokens=16"]  # room for a prompt in the model's 64 positions
    with pytest.raises(SystemExit) as exit_:
        train([*overrides, "--dry-run"])
    assert exit_.value.code == 2
    assert evaluate([str(model), str(data), *overrides[1:]]) == 2
    for stderr in capsys.readouterr().err.split("evaluate ", 1):
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert "Traceback" not in stderr and len(errors) == 1, stderr
        assert re.search(
            rf"the chat template \({re.escape(str(source))}\) does not render its messages: {said}", errors[0]
        )


@pytest.mark.parametrize(("fmt", "said"), [("auto", "no data files"), ("parquet", "no parquet data files")])
def test_an_empty_data_directory_is_named_once(tmp_path, fmt, said):
    """A directory with nothing to read says so in one well-formed line, with or without a format."""
    (tmp_path / "notes.txt").write_text("not data")
    with pytest.raises(ValueError) as refused:
        data_files(str(tmp_path), fmt)
    assert str(refused.value) == f"data.path={tmp_path}: a directory with {said}"
