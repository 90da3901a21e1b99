"""The embedded engine serves PEFT LoRA adapters as SGLang 0.5.23's server does (engines/embedded/lora.py,
lora_endpoints.py): under an adapter a request's log-probs are peft's own on the transformers model and
the merged model's; each row of a batch runs under its own request's adapter; the base weights are
never touched; what does not fit is refused before anything is kept; an unload waits for the
requests still running under the adapter. The engine runs in-process, the client over HTTP."""

import asyncio
import json
import shutil

import pytest
import torch

from bapo_megatron.common import ipc
from bapo_megatron.common.protocol import FLATTENED, SamplingParams
from bapo_megatron.engines.client import CHECKSUM_MISMATCH, EngineClient, EngineError, tensor_checksum

NAME = "qwen2-gqa2"
ADAPTERS = {
    "a1": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]},
    "a2": {"r": 2, "lora_alpha": 4, "use_rslora": True, "target_modules": "all-linear"},
    "zero": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj"]},  # B = 0, as PEFT starts
}
PROMPTS = ([5, 9, 17], [3, 1, 4, 1, 5, 9, 2, 6])
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model_dir(hf_model):
    return hf_model(NAME)


@pytest.fixture(scope="module")
def core(model_dir):
    from bapo_megatron.engines.embedded.core import EngineCore

    return EngineCore(model_dir, max_batch=8)


def _base(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    """Adapters that peft made and saved (adapter_config.json, adapter_model.safetensors): name -> dir.
    Their B are random (but `zero`'s), so that they change what the model computes."""
    import peft

    root, out = tmp_path_factory.mktemp("adapters"), {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        model = peft.get_peft_model(_base(model_dir), peft.LoraConfig(**config))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname and name != "zero":
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _peft_logprobs(model_dir, adapter_dir, prompt, output, merged=False):
    """peft's log-probs of `output` after `prompt` under the adapter saved in adapter_dir (None: the
    base), on the transformers model; merged: with the adapter merged into the weights instead."""
    import peft

    model = _base(model_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
        if merged:
            model = model.merge_and_unload()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def _config(adapter_dir) -> dict:
    return json.loads((adapter_dir / "adapter_config.json").read_text())


def _tensors(adapter_dir) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(adapter_dir / "adapter_model.safetensors")).items())


def _serve(core, fn):
    """fn(client, server) against a fresh embedded server over `core`, over HTTP."""
    from aiohttp.test_utils import TestServer

    from bapo_megatron.engines.embedded.server import EmbeddedServer

    async def run():
        server = EmbeddedServer(core)
        async with TestServer(server.app()) as http, EngineClient(str(http.make_url("")), retries=0) as client:
            return await fn(client, server)

    return asyncio.run(run())


async def _load_tensors(client, name, adapter_dir, corrupt=None, expected=True):
    """load_lora_adapter_from_tensors of a saved adapter, as a flattened bucket with its checksums;
    corrupt(tensors) changes what is sent after the checksums were taken."""
    tensors = _tensors(adapter_dir)
    checksums = {n: tensor_checksum(t) for n, t in tensors} if expected else None
    sent = corrupt(tensors) if corrupt else tensors
    with ipc.serialized(ipc.flattened_bucket(sent)) as payloads:
        await client.load_lora_adapter_from_tensors(
            name, _config(adapter_dir), payloads, FLATTENED, expected_checksums=checksums
        )


def _sampling(i: int, n: int = 6) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=TEMPERATURE, ignore_eos=True, sampling_seed=100 + i)


def test_an_adapter_gives_peft_s_and_the_merged_model_s_logprobs(core, model_dir, adapter_dirs):
    """a1 from tensors (flattened, checksums checked) and a2 (all-linear, rslora) from its directory:
    each request's log-probs are peft's on the transformers model and the merged model's; a request
    naming no adapter, in the same batch, is the base model's."""

    async def run(client, server):
        await _load_tensors(client, "a1", adapter_dirs["a1"])
        await client.load_lora_adapter("a2", str(adapter_dirs["a2"]))
        assert server.loras.loaded() == {"a1": "__tensor__", "a2": str(adapter_dirs["a2"])}
        calls = [
            client.generate(prompt, _sampling(i), f"{lora}-{i}", lora_path=lora)
            for lora in ("a1", "a2", None)
            for i, prompt in enumerate(PROMPTS)
        ]
        answers = await asyncio.gather(*calls)
        for name in ("a1", "a2"):
            await client.unload_lora_adapter(name)
        return answers

    answers = iter(_serve(core, run))
    for lora in ("a1", "a2", None):
        adapter = adapter_dirs.get(lora)
        for prompt in PROMPTS:
            got = next(answers)
            got_logprobs = torch.tensor(got.logprobs)
            want = _peft_logprobs(model_dir, adapter, prompt, got.output_ids)
            torch.testing.assert_close(got_logprobs, want, rtol=0, atol=1e-5)
            if adapter is not None:
                merged = _peft_logprobs(model_dir, adapter, prompt, got.output_ids, merged=True)
                torch.testing.assert_close(got_logprobs, merged, rtol=0, atol=1e-4)
                base = _peft_logprobs(model_dir, None, prompt, got.output_ids)
                assert (got_logprobs - base).abs().max() > 1e-2, "the adapter changed nothing"
    assert not core.loop.adapters.resident


def _run(core, requests):
    for r in requests:
        core.add(r)
    while core.busy:
        core.step()
    return requests


def test_each_row_of_a_batch_runs_under_its_own_adapter(core, adapter_dirs):
    """Requests under a1, a2 and none decoded in one batch each give what they give alone; a cache
    cut short under one adapter is never resumed under another (the prefix store keys by adapter)."""
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    ids = {n: core.load_adapter(n, _config(adapter_dirs[n]), _tensors(adapter_dirs[n]), "d").id for n in ("a1", "a2")}
    lora = [ids["a1"], ids["a2"], None, ids["a1"]]
    prompts = [*PROMPTS, [11, 12], [40, 41, 42, 43]]

    def request(i, tag):
        return EngineRequest(f"{tag}{i}", prompts[i], _sampling(i, 7), lora_id=lora[i])

    together = _run(core, [request(i, "b") for i in range(4)])
    for i, batched in enumerate(together):
        (alone,) = _run(core, [request(i, "s")])
        assert alone.output_ids == batched.output_ids, i
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(batched.logprobs), rtol=0, atol=1e-5)
    # cut short under a1 (length): continued under a2 it prefills anew, under a1 it resumes
    (cut,) = _run(core, [EngineRequest("cut", [7, 8, 9], _sampling(9, 3), lora_id=ids["a1"])])
    hits = core.counters["prefix_hits"]
    seq = cut.input_ids + cut.output_ids
    (other,) = _run(core, [EngineRequest("other", seq, _sampling(10, 2), lora_id=ids["a2"])])
    assert core.counters["prefix_hits"] == hits
    (fresh,) = _run(core, [EngineRequest("fresh", seq, _sampling(10, 2), lora_id=ids["a2"])])
    assert other.output_ids == fresh.output_ids and other.logprobs == fresh.logprobs
    _run(core, [EngineRequest("same", seq, _sampling(10, 2), lora_id=ids["a1"])])
    assert core.counters["prefix_hits"] == hits + 1
    for adapter_id in ids.values():
        core.unload_adapter(adapter_id)


def test_an_adapter_whose_b_is_zero_is_the_base_model(core, adapter_dirs):
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    zero = core.load_adapter("zero", _config(adapter_dirs["zero"]), _tensors(adapter_dirs["zero"]), "d")
    under, base = (EngineRequest(f"z{i}", PROMPTS[1], _sampling(3, 8), lora_id=i) for i in (zero.id, None))
    _run(core, [under])
    _run(core, [base])
    assert under.output_ids == base.output_ids and under.logprobs == base.logprobs
    core.unload_adapter(zero.id)


def test_base_weight_updates_still_load_under_resident_adapters(core, model_dir, adapter_dirs, tmp_path):
    """The adapters act beside the base weights: a base update loads as before, and a request under an
    adapter then computes peft's adapter on the updated base."""
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    a1 = core.load_adapter("a1", _config(adapter_dirs["a1"]), _tensors(adapter_dirs["a1"]), "d")
    norm = core.model.model.norm.weight.detach().clone()
    new_base = tmp_path / "base"
    shutil.copytree(model_dir, new_base)
    model = _base(model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(new_base)
    try:
        core.load_weights([("model.norm.weight", norm * 1.5)])
        (r,) = _run(core, [EngineRequest("u", PROMPTS[0], _sampling(1), lora_id=a1.id)])
        want = _peft_logprobs(new_base, adapter_dirs["a1"], PROMPTS[0], r.output_ids)
        torch.testing.assert_close(torch.tensor(r.logprobs), want, rtol=0, atol=1e-5)
    finally:
        core.load_weights([("model.norm.weight", norm)])
        core.unload_adapter(a1.id)


def test_a_tensor_that_is_not_what_was_sent_is_refused_naming_it(core, adapter_dirs):
    """expected_checksums are checked before loading, as SGLang's tp_worker checks them: a flipped
    value or a tensor besides the expected ones is refused (400) naming the tensor; nothing loads."""

    def flip(tensors):
        name, t = tensors[3]
        return [*tensors[:3], (name, -t), *tensors[4:]]

    def extra(tensors):
        return [*tensors, ("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", tensors[0][1])]

    async def run(client, server):
        errors = []
        for corrupt in (flip, extra):
            with pytest.raises(EngineError) as err:
                await _load_tensors(client, "a1", adapter_dirs["a1"], corrupt)
            errors.append(str(err.value))
        with pytest.raises(EngineError) as err:
            await client.generate(PROMPTS[0], _sampling(0), "x", lora_path="a1")
        return errors, str(err.value), server.loras.loaded()

    (flipped, extra_one), unknown, loaded = _serve(core, run)
    name = _tensors(adapter_dirs["a1"])[3][0]
    assert "HTTP 400" in flipped and CHECKSUM_MISMATCH in flipped and f"tensor {name} " in flipped
    assert CHECKSUM_MISMATCH in extra_one and "k_proj.lora_A.weight was received but not expected" in extra_one
    assert "HTTP 400" in unknown and "'a1'" in unknown and loaded == {}
    assert not core.loop.adapters.resident


A_NAME = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c, t: c.pop("r"), "config_dict.r: missing"),
        (lambda c, t: c.update(r=0), "config_dict.r=0: must be an integer > 0"),
        (lambda c, t: c.update(r=8), "down_proj.lora_A.weight: shape (4, 128), expected (r, in) = (8, 128)"),
        (lambda c, t: c.update(lora_alpha="8"), "config_dict.lora_alpha='8'"),
        (lambda c, t: c.update(use_dora=True), "config_dict.use_dora=True: DoRA"),
        (lambda c, t: c.update(rank_pattern={"q_proj": 2}), "config_dict.rank_pattern"),
        (lambda c, t: c.update(bias="all"), "config_dict.bias='all'"),
        (lambda c, t: c.update(peft_type="IA3"), "config_dict.peft_type='IA3'"),
        (lambda c, t: c.update(new_field=True), "config_dict.new_field: not a PEFT 0.21 LoRA field"),
        (lambda c, t: c.update(target_modules=["nothing"]), "names no linear layer of the served model"),
        (lambda c, t: c.update(target_modules=["q_proj"]), "down_proj is not in target_modules ['q_proj']"),
        (lambda c, t: t.pop(A_NAME), f"{A_NAME}: missing"),
        (lambda c, t: t.update({A_NAME.replace("q_proj", "q_pro"): t[A_NAME]}), "has no linear layer"),
        (lambda c, t: t.update({A_NAME: t[A_NAME].int()}), f"{A_NAME}: dtype torch.int32"),
        (lambda c, t: t.update({A_NAME: t[A_NAME] * float("nan")}), f"{A_NAME}: holds NaN"),
        (lambda c, t: t.update({"lm_head.weight": t[A_NAME]}), "'lm_head.weight': not a PEFT LoRA tensor name"),
    ],
)
def test_what_does_not_fit_is_refused_naming_the_field_or_tensor(core, adapter_dirs, change, message):
    config, tensors = _config(adapter_dirs["a1"]), dict(_tensors(adapter_dirs["a1"]))
    config["target_modules"] = sorted(config["target_modules"])
    change(config, tensors)
    with pytest.raises(ValueError) as err:
        core.load_adapter("bad", config, sorted(tensors.items()), "d")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not core.loop.adapters.resident


def test_names_are_refused_and_unloaded_as_sglang_does(core, adapter_dirs):
    """A name loaded already is refused with SGLang's message and the loaded adapters; an unload of a
    name not loaded is refused; after an unload a request naming it is refused; the name loads again."""
    from aiohttp import ClientSession

    async def run(client, server):
        await client.load_lora_adapter("x", str(adapter_dirs["a1"]))
        async with ClientSession() as http:
            again = {"lora_name": "x", "lora_path": str(adapter_dirs["a2"])}
            async with http.post(client.base_url + "/load_lora_adapter", json=again) as resp:
                refused = (resp.status, await resp.json())
        await client.unload_lora_adapter("x")
        with pytest.raises(EngineError, match="'x' is not loaded"):
            await client.unload_lora_adapter("x")
        with pytest.raises(EngineError, match=r"lora_path='x': no adapter of that name is loaded"):
            await client.generate(PROMPTS[0], _sampling(0), "r", lora_path="x")
        with pytest.raises(EngineError, match="lora_path=\\[1\\]"):
            await client.request("/generate", {"input_ids": [1, 2], "lora_path": [1]}, retry=False)
        await _load_tensors(client, "x", adapter_dirs["a1"], expected=False)
        await client.unload_lora_adapter("x")
        return refused

    status, body = _serve(core, run)
    assert status == 400 and body["success"] is False
    assert body["error_message"].endswith("Failed to load LoRA adapter x because it is already loaded")
    assert body["loaded_adapters"] == {"x": str(adapter_dirs["a1"])}
    assert not core.loop.adapters.resident


def test_an_unload_waits_for_the_requests_under_the_adapter(core, model_dir, adapter_dirs):
    """SGLang's order: the unload takes the name away at once (a new request naming it is refused), then
    answers only once the request already running under the adapter has finished, under the adapter."""

    async def run(client, server):
        await client.load_lora_adapter("a1", str(adapter_dirs["a1"]))
        await client.pause("in_place")  # the request below waits, holding the adapter
        running = asyncio.create_task(client.generate(PROMPTS[1], _sampling(1), "held", lora_path="a1"))
        while not core.busy:
            await asyncio.sleep(0.01)
        unload = asyncio.create_task(client.unload_lora_adapter("a1"))
        while "a1" in server.loras.by_name:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineError, match="lora_path='a1'"):
            await client.generate(PROMPTS[0], _sampling(0), "late", lora_path="a1")
        waiting = not unload.done() and len(core.loop.adapters.resident) == 1
        await client.resume()
        answer = await running
        await unload
        return waiting, answer, server.loras.loaded()

    waiting, answer, loaded = _serve(core, run)
    assert waiting and loaded == {} and not core.loop.adapters.resident
    want = _peft_logprobs(model_dir, adapter_dirs["a1"], PROMPTS[1], answer.output_ids)
    torch.testing.assert_close(torch.tensor(answer.logprobs), want, rtol=0, atol=1e-5)


def test_an_adapter_directory_is_read_alone(core, adapter_dirs, tmp_path):
    """/load_lora_adapter reads the directory's two files and nothing else: a linked file, a missing
    config, a pickled adapter_model.bin in place of the safetensors are refused with the reason."""
    linked, missing, pickled = (tmp_path / n for n in ("linked", "missing", "pickled"))
    for d in (linked, missing, pickled):
        shutil.copytree(adapter_dirs["a1"], d)
    (linked / "adapter_model.safetensors").unlink()
    (linked / "adapter_model.safetensors").symlink_to(adapter_dirs["a1"] / "adapter_model.safetensors")
    (missing / "adapter_config.json").unlink()
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")

    async def run(client, server):
        errors = []
        for d in (linked, missing, pickled, tmp_path / "nowhere"):
            with pytest.raises(EngineError) as err:
                await client.load_lora_adapter("d", str(d))
            errors.append(str(err.value))
        return errors

    errors = _serve(core, run)
    assert "adapter_model.safetensors is missing or not a regular file (links are not followed)" in errors[0]
    assert "adapter_config.json is missing" in errors[1] and "adapter_model.safetensors is missing" in errors[2]
    assert "not a directory" in errors[3]
    assert not core.loop.adapters.resident
