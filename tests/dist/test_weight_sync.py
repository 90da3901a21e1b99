"""Weight sync: a TP=2 trainer streams its weights to the embedded engine, inside a begin/end
session, four ways: over gloo (update_weights_from_distributed) tensor by tensor and as
flattened buckets, and colocated by shared-memory handle (update_weights_from_tensor) as
flattened buckets and tensor by tensor. After each, the engine's log-probs for the sequence
it samples equal the trainer's own (float32, <= 1e-5), and no shared memory is left behind."""

import json
from pathlib import Path

import pytest
import torch

from bapo_megatron.engines.launcher import embedded_server, free_port
from tests.dist.launch import run_workers
from tests.helpers import make_hf_model

ENGINE, TRAINED = "qwen2-gqa2", "qwen2-gqa2-trained"  # same shape, different random weights
WAYS = [("distributed", False), ("distributed", True), ("tensor", True), ("tensor", False)]


def _convert(rank: int, world: int, root: str) -> None:
    from bapo_megatron.weights.convert import hf_to_mcore

    hf_to_mcore(Path(root) / TRAINED, Path(root) / "mcore", progress=False)


def _sync_and_compare(rank: int, world: int, root: str, url: str) -> None:
    import torch.distributed as dist

    from bapo_megatron.common.batch import RolloutBatch, Sample
    from bapo_megatron.common.protocol import SamplingParams
    from bapo_megatron.config import load_config
    from bapo_megatron.engines.client import EngineClient
    from bapo_megatron.engines.loop import EngineLoop
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.export import stream_hf_buckets
    from bapo_megatron.weights.sync import DistributedWeightSender, TensorWeightSender

    activate_cpu_shim()
    root = Path(root)
    spec = ModelSpec.from_hf_dir(root / TRAINED)
    cfg = load_config(None, ["parallel.tensor=2", "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2"])
    trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    trainer.load_weights(root / "mcore")
    prompt = [11, 22, 33, 44]
    tokens = torch.zeros(len(WAYS), 24, dtype=torch.long)
    engine_logprobs = torch.zeros(len(WAYS), 20, dtype=torch.float64)

    def stream():
        return stream_hf_buckets(trainer.model, spec, trainer.info, bucket_bytes=50_000)

    if rank == 0:
        loop = EngineLoop()
        client = EngineClient(url)
        results = []
        for i, (transport, flatten) in enumerate(WAYS):
            version = str(i + 1)
            if transport == "distributed":
                sender = DistributedWeightSender(
                    [client], [1], "127.0.0.1", free_port(), group_name=f"sync-{version}", flatten=flatten
                )
                loop.run(sender.connect())
            else:
                sender = TensorWeightSender([client], flatten=flatten)
            assert sender.send(stream(), version, loop) > 0  # the stream's gathers on this thread
            sampling = SamplingParams(max_new_tokens=20, temperature=0.9, ignore_eos=True)
            results.append(loop.run(client.generate(prompt, sampling, f"after-{version}")))
        loop.run(client.close())
        loop.close()
        for i, result in enumerate(results):
            assert result.weight_version == str(i + 1) and len(result.output_ids) == 20
            tokens[i] = torch.tensor(prompt + result.output_ids)
            engine_logprobs[i] = torch.tensor(result.logprobs)
    else:
        for _ in WAYS:
            for _ in stream():  # the TP gathers are collectives: every rank walks the stream
                pass
    dist.broadcast(tokens, 0)
    batch = RolloutBatch(
        samples=[
            Sample(
                prompt_ids=ids[:4],
                response_ids=ids[4:],
                behaviour_logprobs=[0.0] * 20,
                versions=[0] * 20,
                reward=float(i % 2),
                group=0,
            )
            for i, ids in enumerate(tokens.tolist())
        ],
        temperature=0.9,
    )
    mbs, _ = trainer.microbatches(batch)

    def collect(mb, logits):
        logp, _ = trainer._logprobs(mb, logits, 0.9)  # the rollout temperature the engine sampled with
        return logits.new_zeros(()), torch.tensor(mb.num_tokens, dtype=torch.int), (mb.sample_index, logp, mb.loss_mask)

    with torch.no_grad():
        outputs = trainer._run(mbs, collect, forward_only=True)
    if rank == 0:
        ours = {}
        for index, logp, mask in outputs:
            for row, i in enumerate(index):
                ours[int(i)] = logp[row][mask[row] != 0].double().tolist()
        (root / "sync.json").write_text(
            json.dumps({"trainer": [ours[i] for i in range(len(WAYS))], "engine": engine_logprobs.tolist()})
        )


@pytest.mark.dist
def test_tp2_trainer_weights_reach_the_engine(tmp_path):
    shm_before = _torch_shm()
    make_hf_model(tmp_path, ENGINE)
    make_hf_model(tmp_path, TRAINED, ("qwen2", 2, False))
    run_workers(_convert, 1, str(tmp_path))
    engine = embedded_server(tmp_path / ENGINE, tmp_path / "engine.log").start().wait_ready(120)
    try:
        run_workers(_sync_and_compare, 2, str(tmp_path), engine.url)
    finally:
        engine.stop()
    result = json.loads((tmp_path / "sync.json").read_text())
    torch.testing.assert_close(torch.tensor(result["engine"]), torch.tensor(result["trainer"]), rtol=0, atol=1e-5)
    assert _torch_shm() <= shm_before, "shared-memory segments of the tensor transport were left behind"


def _torch_shm() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for pattern in ("torch_*", "bapo-*") for p in shm.glob(pattern)} if shm.is_dir() else set()
