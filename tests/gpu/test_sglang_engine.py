"""Real SGLang 0.5.23 on a GPU: our launcher, client and weight sync against the server itself.

One colocated server (memory saver on) of a small random bf16 Qwen2, started by
engines/sglang_launcher.py, is driven through engines/client.py:

- /generate with logprobs: each sampled token's log-prob equals log_softmax(logits / T) of the
  same weights in transformers (float32 reference; the server computes in bf16, hence the
  stated tolerance), and the weight version is the one the server was started with;
- abort returns the partial output; pause (abort mode) then continue;
- the colocated cycle of a training step: release weights and KV cache, resume them, push new
  weights by CUDA IPC handle (update_weights_from_tensor, flattened buckets, inside a begin/end
  session): the server's log-probs are then the new weights', under the new version;
- update_weights_from_disk and, with a second GPU for the sender (NCCL refuses two ranks of one
  communicator on one GPU), update_weights_from_distributed over NCCL.
"""

import asyncio
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
    reason="needs CUDA and SGLang 0.5.23 (pip install -e '.[sglang]')",
)
BASE, NEW, OTHER = "base", "new", "other"  # same shape, different random weights
PROMPT = [11, 22, 33, 44, 55]
MEAN_TOL, MAX_TOL = 0.02, 0.15
"""bf16 server against a float32 reference of the same bf16 weights: per-token |log-prob| gap."""


def _make_model(root: Path, name: str, seed: int):
    import transformers

    from bapo_megatron.models.spec import tiny_spec

    # head_dim 64: a size every SGLang attention backend serves; the context holds the abort test's request
    spec = dataclasses.replace(
        tiny_spec("qwen2"),
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        ffn_hidden_size=512,
        vocab_size=512,
        num_layers=2,
        max_position_embeddings=8192,
    )
    config = transformers.AutoConfig.for_model(**spec.to_hf_config())
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name_ else 0.0) + 0.08 * torch.randn(p.shape))
    model = model.to(torch.bfloat16)
    model.save_pretrained(root / name)
    return model.float().cuda().eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-models")
    return root, {name: _make_model(root, name, seed) for seed, name in enumerate((BASE, NEW, OTHER))}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    from bapo_megatron.config import load_config
    from bapo_megatron.engines.launcher import free_port
    from bapo_megatron.engines.sglang_launcher import Launch, start_sglang

    root, _ = models
    cfg = load_config(
        None,
        [
            "rollout.engines.kind=sglang",
            "rollout.engines.colocate=true",
            "rollout.engines.mem_fraction_static=0.3",
            f"rollout.engines.port={free_port()}",
            "rollout.engines.sglang_args={disable-decode-cuda-graph: true, disable-prefill-cuda-graph: true}",
        ],
    ).rollout
    servers, key = start_sglang(cfg, Launch(str(root / BASE)), tmp_path_factory.mktemp("sglang-run"), timeout_s=600)
    yield servers[0], key
    servers[0].stop()


def _reference(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0]


def _gap(completion, model, temperature):
    ref = _reference(model, PROMPT, completion.output_ids, temperature).cpu()
    gap = (torch.tensor(completion.logprobs) - ref).abs()
    return gap.mean().item(), gap.max().item()


async def _sample(client, rid, temperature=0.8, n=32):
    from bapo_megatron.common.protocol import SamplingParams

    return await client.generate(
        PROMPT, SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True), rid
    )


def _buckets(model):
    """The model's HF-named tensors as bf16 buckets on the GPU, as the trainer's export sends them."""
    from bapo_megatron.weights.export import buckets

    return buckets(model.state_dict().items(), bucket_bytes=1 << 20, dtype=torch.bfloat16)


def test_generate_abort_pause(server, models):
    from bapo_megatron.engines.client import EngineClient

    proc, key = server
    _, weights = models

    async def run():
        async with EngineClient(proc.url, admin_key=key) as client:
            done = await _sample(client, "plain")
            long = asyncio.create_task(_sample(client, "long", n=4000))
            await asyncio.sleep(0.5)
            await client.abort("long")
            cut = await long
            await client.pause("abort")
            held = asyncio.create_task(_sample(client, "held", n=8))
            await asyncio.sleep(0.5)
            waited = not held.done()
            await client.resume()
            return done, cut, waited, await held

    done, cut, waited, held = asyncio.run(run())
    assert done.finish == "length" and len(done.output_ids) == 32 and done.weight_version == "0"
    mean, worst = _gap(done, weights[BASE], 0.8)
    assert mean <= MEAN_TOL and worst <= MAX_TOL, (mean, worst)
    assert cut.finish == "abort" and 0 < len(cut.output_ids) < 4000
    assert waited and held.finish == "length" and len(held.output_ids) == 8


def test_colocated_cycle_and_disk(server, models):
    from bapo_megatron.engines.client import EngineClient
    from bapo_megatron.weights.sync import TensorWeightSender

    proc, key = server
    root, weights = models

    async def run():
        async with EngineClient(proc.url, admin_key=key) as client:
            await client.pause("abort")
            await client.release_memory()  # the trainer's turn on the GPU
            await client.resume_memory()
            sent = await TensorWeightSender([client]).send(_buckets(weights[NEW]), "1")
            await client.resume()
            after_tensor = await _sample(client, "after-tensor")
            await client.update_weights_from_disk(str(root / OTHER), "2")
            after_disk = await _sample(client, "after-disk")
            return sent, after_tensor, after_disk

    sent, after_tensor, after_disk = asyncio.run(run())
    assert sent == sum(t.numel() * 2 for t in weights[NEW].state_dict().values())
    for completion, version, name in ((after_tensor, "1", NEW), (after_disk, "2", OTHER)):
        assert completion.weight_version == version
        mean, worst = _gap(completion, weights[name], 0.8)
        assert mean <= MEAN_TOL and worst <= MAX_TOL, (version, mean, worst)
        assert _gap(completion, weights[BASE], 0.8)[0] > 10 * MEAN_TOL  # the update took: not the old weights


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs the sender on a second GPU"
)
def test_update_over_nccl(server, models):
    from bapo_megatron.engines.client import EngineClient
    from bapo_megatron.engines.launcher import free_port
    from bapo_megatron.weights.sync import DistributedWeightSender

    proc, key = server
    _, weights = models
    torch.cuda.set_device(1)  # the server runs on GPU 0
    sender_model = weights[NEW].to("cuda:1")

    async def run():
        async with EngineClient(proc.url, admin_key=key) as client:
            sender = DistributedWeightSender(
                [client], [1], "127.0.0.1", free_port(), group_name="bapo-nccl-test", backend="nccl"
            )
            await sender.connect()
            await client.pause("abort")
            await sender.send(_buckets(sender_model), "3")
            await client.resume()
            return await _sample(client, "after-nccl")

    completion = asyncio.run(run())
    sender_model.to("cuda:0")
    torch.cuda.set_device(0)
    assert completion.weight_version == "3"
    mean, worst = _gap(completion, weights[NEW], 0.8)
    assert mean <= MEAN_TOL and worst <= MAX_TOL, (mean, worst)
