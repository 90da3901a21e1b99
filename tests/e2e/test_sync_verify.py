"""rollout.sync.verify against a real embedded engine process: both senders' updates arrive verified,
and a value changed on the way (after the trainer's checksums, before the engine) stops the send
with one line naming the tensor and the engine, the engine keeping its weights."""

import pytest
import torch

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.weights import sync
from bapo_megatron.weights.sync import DistributedWeightSender, TensorWeightSender, WeightsCorrupted

pytestmark = pytest.mark.e2e


def _flip_last_byte(tensor: torch.Tensor) -> torch.Tensor:
    raw = tensor.detach().clone().contiguous().view(-1).view(torch.uint8)
    raw[-1] ^= 0xFF
    return raw.view(tensor.dtype).view(tensor.shape)


def test_updates_arrive_verified_and_a_corrupted_one_stops_the_run(hf_model, tmp_path, monkeypatch):
    from bapo_megatron.engines.client import EngineClient
    from bapo_megatron.engines.launcher import embedded_server, free_port
    from bapo_megatron.engines.loop import EngineLoop

    engine = embedded_server(hf_model("qwen2-gqa2"), tmp_path / "engine.log").start().wait_ready(120)
    loop = EngineLoop()
    bucket = [("model.norm.weight", torch.full((64,), 0.5)), ("model.layers.0.input_layernorm.weight", torch.ones(64))]
    try:
        with loop.context(EngineClient(engine.url)) as client:
            distributed = DistributedWeightSender([client], [1], "127.0.0.1", free_port(), backend="gloo")
            loop.run(distributed.connect())
            tensor = TensorWeightSender([client])
            for sender in (distributed, tensor):
                sender.verify = True
                sender.send([bucket], "good", loop)

            broadcast = distributed._broadcast  # the flattened bucket's last byte: the second tensor's
            monkeypatch.setattr(distributed, "_broadcast", lambda ts: broadcast([_flip_last_byte(ts[-1])]))
            with pytest.raises(WeightsCorrupted) as by_group:
                distributed.send([bucket], "bad", loop)
            payload = sync._payload
            monkeypatch.setattr(
                sync, "_payload", lambda b, flat: payload([b[0], (b[1][0], _flip_last_byte(b[1][1]))], flat)
            )
            with pytest.raises(WeightsCorrupted) as by_handle:
                tensor.send([bucket], "bad", loop)
            info = loop.run(client.model_info())
            result = loop.run(client.generate([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), "after"))
            loop.run(distributed.close())
    finally:
        loop.close()
        engine.stop()
    for caught in (by_group, by_handle):
        line = str(caught.value)
        assert f"engine {engine.url} " in line and "tensor model.layers.0.input_layernorm.weight arrived" in line, line
        assert "\n" not in line
    assert info["weight_version"] == "good" and len(result.output_ids) == 4


CORRUPT_FROM_VERSION_2 = """
import runpy, sys
import torch
from bapo_megatron.weights.sync import DistributedWeightSender

send_bucket, broadcast = DistributedWeightSender._send_bucket, DistributedWeightSender._broadcast

def _send_bucket(self, bucket, last, version, loop, flush_cache):
    self.corrupt = version == "2"
    return send_bucket(self, bucket, last, version, loop, flush_cache)

def _broadcast(self, tensors):
    if getattr(self, "corrupt", False):  # after the checksums were taken: a fault on the way
        flat = tensors[-1].clone()
        flat[-1] ^= 0xFF
        tensors = [*tensors[:-1], flat]
    return broadcast(self, tensors)

DistributedWeightSender._send_bucket, DistributedWeightSender._broadcast = _send_bucket, _broadcast
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_a_run_whose_update_is_corrupted_on_the_way_stops_naming_the_tensor_and_the_engine(tmp_path, hf_model):
    """The run's first update arrives verified (sync/verified); the second, changed on the way, stops
    the run: exit 1, one error line naming the tensor and the engine, status.json "failed"."""
    import json
    import sys

    from tests.online import MODEL, args, metrics, no_engine_left, start, write_task

    task = write_task(tmp_path / "task", 16, hf_model(*MODEL))
    run = tmp_path / "run"
    proc = start(args(task, run, 3, "rollout.sync.verify=every_step"), [sys.executable, "-c", CORRUPT_FROM_VERSION_2])
    out, _ = proc.communicate(timeout=600)
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert last.startswith("error: rollout.sync.verify: engine http://") and "version 2" in last, last
    assert "weight checksum mismatch: tensor " in last and " arrived with sha256 " in last, last
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "rollout.sync.verify" in status["error"], status
    assert [m.get("sync/verified") for m in metrics(run)] == [1.0]
    no_engine_left(run)
