"""The embedded engine started from a quantized release (common/hf_model.py): its weights are
the trainer's reading of the release (partial fp8 edge blocks included, which transformers 5.24's
own loader refuses), its log-probs transformers' on those dequantized weights; a release that does
not fill the model its config builds is refused in one line."""

import shutil

import pytest
import torch
import transformers

from bapo_megatron.common import hf_model as release_loader
from bapo_megatron.common.hf_io import HFCheckpoint
from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.embedded.core import EngineCore
from bapo_megatron.engines.embedded.request_queue import EngineRequest
from bapo_megatron.errors import BadInputError
from bapo_megatron.models.spec import tiny_spec
from tests.families import multimodal_qwen3_5_config, random_hf_model
from tests.quantized_releases import FP8, all_tensors, make_releases, reference_fp8, rewrite

pytestmark = pytest.mark.unit

KV_A = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
"""40 rows in 16-row blocks: a partial edge block, as DeepSeek-V3's 576 rows in 128."""


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    return make_releases(tmp_path_factory.mktemp("releases"))


def _dequantized_copy(release, directory):
    """The release's text model as the trainer reads it (dequantized, float32), unquantized on disk."""
    shutil.copytree(release, directory)
    read = HFCheckpoint(release)
    return rewrite(directory, {read.layout.disk_name(n): read[n].float().contiguous() for n in read.files}, None)


def _logprobs(model, request: EngineRequest) -> torch.Tensor:
    """Each output token's log-prob at temperature 1 from one teacher-forced transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([request.input_ids + request.output_ids])).logits[0]
    logprobs = torch.log_softmax(logits[len(request.input_ids) - 1 : -1], -1)
    return logprobs.gather(1, torch.tensor(request.output_ids)[:, None])[:, 0]


def test_the_engine_serves_an_fp8_release_with_partial_blocks(releases, tmp_path):
    release = releases / "deepseek-fp8"
    with pytest.raises(RuntimeError, match="CONVERSION"):  # why the engine reads it itself
        transformers.AutoModelForCausalLM.from_pretrained(str(release), dtype=torch.float32)
    core = EngineCore(release, max_batch=4)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(_dequantized_copy(release, tmp_path / "plain")), dtype=torch.float32
    ).eval()
    ours, theirs = core.model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs) and KV_A in ours
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    requests = [
        EngineRequest(
            f"r{i}", [(3 * i + j) % 11 + 2 for j in range(3 + i)], SamplingParams(max_new_tokens=5, ignore_eos=True)
        )
        for i in range(3)
    ]
    for request in requests:
        core.add(request)
    while core.busy:
        core.step()
    for request in requests:
        assert len(request.output_ids) == 5
        torch.testing.assert_close(torch.tensor(request.logprobs), _logprobs(reference, request), rtol=0, atol=1e-5)


def test_the_engine_reads_mxfp4_experts_as_transformers_does(releases):
    """gpt-oss's MXFP4 experts: transformers dequantizes this release itself; the engine's weights are its."""
    release = releases / "gpt_oss-mxfp4"
    ours = release_loader.load_release(release, torch.float32).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(release), dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def _multimodal_fp8(directory):
    """A tiny Qwen3_5ForConditionalGeneration as its "-FP8" release stores it (the layout Qwen3.5 is
    released in: the text model under model.language_model., a vision tower beside it): the text
    decoder's linear weights in fp8 blocks, the rest bf16."""
    spec = tiny_spec("qwen3_5_text")
    config = multimodal_qwen3_5_config(spec)
    model, state = transformers.Qwen3_5ForConditionalGeneration(config), random_hf_model(spec).state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            model.state_dict()[name if name == "lm_head.weight" else "model.language_model." + name[6:]].copy_(tensor)
    model.save_pretrained(directory)
    stored = {}
    for name, tensor in all_tensors(directory).items():
        if name.startswith("model.language_model.layers.") and tensor.dim() == 2 and name.endswith(".weight"):
            stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = reference_fp8(tensor, (16, 16))
        else:
            stored[name] = tensor.bfloat16()
    return rewrite(directory, stored, {**FP8, "weight_block_size": [16, 16]})


def test_the_engine_serves_a_released_multimodal_fp8_layout(tmp_path):
    """Qwen3.5's "-FP8" releases keep the multimodal layout: the engine builds the text model its config
    names and fills it from the text tensors as the trainer reads them; the vision tower is left out."""
    release = _multimodal_fp8(tmp_path / "qwen3.5-fp8")
    read, core = HFCheckpoint(release), EngineCore(release)
    ours = core.model.state_dict()
    assert type(core.model).__name__ == "Qwen3_5ForCausalLM" and len(read.kept)
    assert all(torch.equal(ours[name], read[name]) for name in read.files)


def test_a_release_that_does_not_fill_its_model_is_refused_in_one_line(releases, monkeypatch):
    """A tensor the model has and the release lacks, and one the model has no place for, named together
    (what a config that transformers reads otherwise than the trainer would leave)."""
    read = release_loader._release_tensors

    def changed(checkpoint):
        for names, tensor, required in read(checkpoint):
            yield (
                tuple(n.replace("kv_a_proj", "kv_x_proj") for n in names) if KV_A in names else names,
                tensor,
                required,
            )

    monkeypatch.setattr(release_loader, "_release_tensors", changed)
    with pytest.raises(BadInputError) as err:
        release_loader.load_release(releases / "deepseek-fp8", torch.float32)
    said = str(err.value)
    assert said.startswith(str(releases / "deepseek-fp8")) and "\n" not in said
    assert f"1 tensors of the DeepseekV3ForCausalLM are not in it, e.g. {KV_A}" in said
    assert "1 of its tensors fit no tensor of the model, e.g. model.layers.1.self_attn.kv_x_proj_with_mqa" in said
