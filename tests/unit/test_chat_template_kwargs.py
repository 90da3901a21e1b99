"""data.chat_template_kwargs (verl's data.apply_chat_template_kwargs): the chat template's variables,
Qwen3's enable_thinking among them, reach the template wherever prompts are rendered (the loop's
source, the dry run, evaluate) and the start banner says them; what cannot work is refused by name."""

import json
import re

import pytest

from bapo_megatron.config import DataConfig, dump_config, load_config
from bapo_megatron.config.data import RENDERER_ARGUMENTS
from bapo_megatron.data.prompts import PromptSource
from bapo_megatron.errors import ConfigError
from tests.helpers import word_tokenizer

THINK_OFF = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
"""Qwen3's chat template after its generation prompt: an empty thinking block when thinking is off."""
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n" + THINK_OFF + "{% endif %}"
)
"""Qwen3's chat template in little: its turns, its generation prompt, its enable_thinking branch."""
MESSAGES = [{"role": "user", "content": "1+2="}]


def _chat_jsonl(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": MESSAGES, "answer": "3"}) + "\n")
    return path


def _rendered(tmp_path, **data) -> str:
    """The text the loop's prompt source tokenizes for the one record (code points, read back)."""
    config = DataConfig(path=str(_chat_jsonl(tmp_path)), **data)
    source = PromptSource(config, lambda text: [ord(c) for c in text], tokenizer=word_tokenizer(QWEN3_LIKE))
    return "".join(chr(i) for i in source.item(0)[0])


def test_enable_thinking_false_renders_qwen3s_empty_thinking_block(tmp_path):
    tok = word_tokenizer(QWEN3_LIKE)
    on = "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert _rendered(tmp_path) == on  # the template's default: the model opens its own thinking
    off = _rendered(tmp_path, chat_template_kwargs={"enable_thinking": False})
    assert off == on + "<think>\n\n</think>\n\n"
    assert off == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert _rendered(tmp_path, chat_template_kwargs={"enable_thinking": True}) == on


def test_verls_name_is_read_as_chat_template_kwargs(tmp_path):
    verl = tmp_path / "verl.yaml"
    verl.write_text("data:\n  apply_chat_template_kwargs:\n    enable_thinking: false\n")
    cfg = load_config(verl)
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert "chat_template_kwargs:" in dump_config(cfg) and "apply_chat_template" not in dump_config(cfg)
    override = load_config(None, ["data.apply_chat_template_kwargs.enable_thinking=false"])
    assert override.data == cfg.data
    assert load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"]).data == cfg.data
    both = tmp_path / "both.yaml"
    both.write_text("data:\n  apply_chat_template_kwargs: {a: 1}\n  chat_template_kwargs: {b: 2}\n")
    with pytest.raises(ConfigError, match=r"verl's name for chat_template_kwargs, and chat_template_kwargs is set"):
        load_config(both)


@pytest.mark.parametrize("key", RENDERER_ARGUMENTS)
def test_the_renderers_own_arguments_are_refused_by_name(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.apply_chat_template_kwargs.{key}=false"])
    assert str(err.value).startswith(f"data.chat_template_kwargs.{key}=False: set by the prompt renderer itself")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ("data.chat_template_kwargs.when=2024-01-01", "data.chat_template_kwargs.when"),  # YAML reads a date
        ("data.chat_template_kwargs.x={y: .nan}", "data.chat_template_kwargs.x"),
        ("data.chat_template_kwargs=[enable_thinking]", "data.chat_template_kwargs"),
    ],
)
def test_values_are_json_like_in_a_mapping(given, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        load_config(None, [given])
    with pytest.raises(ConfigError, match=r"^chat_template_kwargs=1: keys must be variable names"):
        DataConfig(chat_template_kwargs={1: True})


def test_an_option_the_template_never_reads_is_said_once(tmp_path):
    """Jinja ignores a variable a template does not name: enable_thinking on a template without it
    (Qwen2.5's, a Qwen3 *-2507 one) changes nothing, and the run says so."""
    config = DataConfig(path=str(_chat_jsonl(tmp_path)), chat_template_kwargs={"enable_thinking": False})
    with pytest.warns(UserWarning, match=r"data.chat_template_kwargs: .* never reads enable_thinking: no effect"):
        PromptSource(config, tokenizer=word_tokenizer())


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """The tiny chat model of `tasks verl-data`, its template with Qwen3's enable_thinking branch."""
    from bapo_megatron.tasks import CHAT_TEMPLATE, write_model

    model = write_model(tmp_path_factory.mktemp("thinking") / "model", chat=True)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    head, tail = CHAT_TEMPLATE.split("<assistant>")
    settings["chat_template"] = head + "<assistant>" + THINK_OFF + tail
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    return model


def test_the_dry_run_and_evaluate_render_with_the_options(thinking_model, tmp_path, capsys):
    """`bapo-train --dry-run` and `evaluate` read prompts as the loop does: with thinking off the
    prompt gains the empty thinking block, and here that puts it over data.max_prompt_tokens."""
    from bapo_megatron.data.prompts import load_tokenizer
    from bapo_megatron.evaluate import main as evaluate
    from bapo_megatron.train import main as train

    tok = load_tokenizer(thinking_model)
    on, off = (
        len(tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **options)))
        for options in ({}, {"enable_thinking": False})
    )
    assert off > on
    data = _chat_jsonl(tmp_path)
    overrides = [f"model.hf_path={thinking_model}", f"data.path={data}", "reward.function=exact"]
    overrides += ["rollout.sampling.max_new_tokens=16", f"data.max_prompt_tokens={on}", "data.overlong_prompts=error"]
    thinking_off = "data.apply_chat_template_kwargs.enable_thinking=false"
    with pytest.raises(SystemExit) as exit_:
        train([*overrides, thinking_off, "--dry-run"])
    assert exit_.value.code == 2
    assert evaluate([str(thinking_model), str(data), *overrides[1:], thinking_off]) == 2
    said = rf"record 1\b.*: its prompt has {off} tokens, more than data.max_prompt_tokens={on} \("
    for stderr in capsys.readouterr().err.split("evaluate ", 1):
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and re.search(said, errors[0]), stderr
    train([*overrides, "--dry-run"])  # thinking on (the template's default): the prompt fits
    assert f"data: data.path={data}: 1 records" in capsys.readouterr().out


def test_the_banner_says_the_templates_options(tmp_path):
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.runinfo import banner

    given = [f"data.path={tmp_path / 'd.parquet'}", f"model.hf_path={tmp_path}", f"run_dir={tmp_path / 'run'}"]
    off = load_config(None, [*given, "data.apply_chat_template_kwargs.enable_thinking=false"])
    assert "chat template  the model's, enable_thinking=False; for chat-message prompts" in banner(
        off, tiny_spec(), 1, None
    )
    plain = load_config(None, [*given, "data.chat_template=true"])
    text = banner(plain, tiny_spec(), 1, None)
    assert "chat template  the model's, its defaults; for chat-message and text prompts (data.chat_template)" in text
    assert "chat template" not in banner(load_config(None, [f"run_dir={tmp_path / 'run'}"]), tiny_spec(), 1, None)
