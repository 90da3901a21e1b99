"""rollout.sync.verify: the engines check every tensor of a weight update against the checksum the
trainer sent with it, and a mismatch stops the run with one line naming the tensor and the engine.

The checksum and its request field are SGLang 0.5.23's own (expected_checksums, the sha256 of a
tensor's bytes that its tp_worker checks LoRA adapters with), checked against the wheel. The
embedded engine's receive path runs in-process here; the senders against a real engine process
are in tests/e2e/test_sync_verify.py.
"""

import ast
import asyncio
import json
import types

import pytest
import torch

from bapo_megatron.config.rollout import WeightSyncConfig
from bapo_megatron.engines.client import CHECKSUM_MISMATCH, EngineError, checksum_mismatch, tensor_checksum
from bapo_megatron.errors import ConfigError, RunStopped
from bapo_megatron.weights.sync import TensorWeightSender, WeightsCorrupted, checksums
from tests.sglang_wheel import source as _source


@pytest.mark.parametrize(
    ("value", "embedded", "sglang"),
    [("auto", 1, 0), ("off", 0, 0), (False, 0, 0), ("every_step", 1, 1), (True, 1, 1), ("every 3", 3, 3)],
)
def test_verify_reads_off_every_step_and_every_n(value, embedded, sglang):
    sync = WeightSyncConfig(verify=value)
    assert (sync.verify_every(True), sync.verify_every(False)) == (embedded, sglang)


@pytest.mark.parametrize("value", ["every 0", "every", "every x", "sometimes", "every 2 steps"])
def test_a_verify_that_is_no_schedule_is_a_config_error(value):
    with pytest.raises(ConfigError, match="every_step"):
        WeightSyncConfig(verify=value)


def _sglang_hash(wheel) -> ast.expr:
    """SGLang's expression for a received tensor's checksum (tp_worker's expected_checksums check)."""
    tree = ast.parse(_source(wheel, "managers/tp_worker.py"))
    (node,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "hexdigest"
        and "sha256" in ast.unparse(n.func.value)
    ]
    return node


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_our_checksum_is_sglangs(wheel, dtype):
    """tensor_checksum gives what SGLang's own expression gives, evaluated from the wheel's source."""
    import hashlib

    code = compile(ast.Expression(_sglang_hash(wheel)), "tp_worker.py", "eval")
    tensor = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype).t()  # not contiguous
    theirs = eval(code, {"hashlib": hashlib, "torch": torch, "tensors": {"w": tensor}, "name": "w"})
    assert tensor_checksum(tensor) == theirs


def test_the_request_field_is_sglangs(wheel):
    """expected_checksums is the field SGLang's tensor requests name (LoRA adapters, {name: sha256
    hex}). SGLang's full-weight updates take none, which is why a due check asks SGLang for the probe
    instead (if a later SGLang adds it there, this fails: send it to SGLang too)."""
    tree = ast.parse(_source(wheel, "managers/io_struct.py"))
    fields = {
        node.name: {s.target.id: ast.unparse(s.annotation) for s in node.body if isinstance(s, ast.AnnAssign)}
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }
    assert fields["LoadLoRAAdapterFromTensorsReqInput"]["expected_checksums"] == "Optional[Dict[str, str]]"
    for update in ("UpdateWeightsFromTensorReqInput", "UpdateWeightsFromDistributedReqInput"):
        assert "expected_checksums" not in fields[update], update


def test_a_flipped_value_a_missing_tensor_and_an_intact_bucket():
    bucket = [("a", torch.randn(4, 4)), ("b", torch.randn(3, dtype=torch.bfloat16))]
    expected = checksums(bucket)
    assert checksum_mismatch(expected, [(n, t.clone()) for n, t in bucket]) is None
    flipped = bucket[1][1].clone()
    flipped[2] = -flipped[2]
    line = checksum_mismatch(expected, [bucket[0], ("b", flipped)])
    assert line.startswith(CHECKSUM_MISMATCH) and "tensor b " in line
    assert "tensor b was expected but not received" in checksum_mismatch(expected, bucket[:1])


@pytest.fixture(scope="module")
def core(hf_model):
    from bapo_megatron.engines.embedded.core import EngineCore

    return EngineCore(hf_model("qwen2-gqa2"))


def _update(core, bucket, expected, corrupt=None) -> tuple[int, str]:
    """One update_weights_from_tensor of `bucket` with `expected` to an in-process embedded server;
    corrupt(tensors) changes what the server unpacks, as a fault on the way would."""
    from aiohttp.test_utils import TestClient, TestServer

    from bapo_megatron.common import ipc, protocol
    from bapo_megatron.engines.embedded.server import EmbeddedServer

    async def run():
        async with TestClient(TestServer(EmbeddedServer(core).app())) as client:
            await client.post("/begin_weight_update", json={})
            with ipc.serialized(ipc.flattened_bucket(bucket)) as payload:
                body = {**protocol.update_tensor_request(payload, "7", True, True), "expected_checksums": expected}
                resp = await client.post("/update_weights_from_tensor", json=body)
                answer = (resp.status, await resp.text())
            await client.post("/end_weight_update", json={})
            return answer

    if corrupt is None:
        return asyncio.run(run())
    unflatten = ipc.unflatten
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ipc, "unflatten", lambda payload: corrupt(unflatten(payload)))
        return asyncio.run(run())


def test_the_embedded_engine_loads_an_intact_update_and_refuses_a_corrupted_one(core):
    """The engine hashes what it unpacked before loading: an intact update loads; one whose value
    flipped on the way is refused (400) with the line naming the tensor, and the model keeps its
    weights (before: it loaded whatever arrived)."""
    norm = core.model.model.norm.weight
    good = [("model.norm.weight", torch.full_like(norm, 0.5)), ("lm_head.weight", core.model.lm_head.weight * 2)]
    status, text = _update(core, good, checksums(good))
    assert status == 200 and json.loads(text)["success"], text
    assert torch.equal(norm, good[0][1])
    before = {k: v.clone() for k, v in core.model.state_dict().items()}

    def flip(tensors):
        name, tensor = tensors[1]
        tensor = tensor.clone()
        tensor.view(-1)[3] = -tensor.view(-1)[3]
        return [tensors[0], (name, tensor)]

    bad = [("model.norm.weight", torch.full_like(norm, 0.25)), ("lm_head.weight", core.model.lm_head.weight * 3)]
    status, text = _update(core, bad, checksums(bad), corrupt=flip)
    message = json.loads(text)["message"]
    assert status == 400 and f"{CHECKSUM_MISMATCH}: tensor lm_head.weight arrived" in message, text
    for key, value in core.model.state_dict().items():
        assert torch.equal(value, before[key]), key


class RefusingClient:
    """An engine whose bucket `bad` arrives changed: it refuses it as the embedded engine does."""

    def __init__(self, bad: int) -> None:
        self.base_url, self.bad, self.buckets = "http://engine-3:30000", bad, []

    async def begin_weight_update(self) -> None:
        pass

    async def end_weight_update(self) -> None:
        pass

    async def update_weights_from_tensor(self, serialized, version, flattened, flush_cache, expected_checksums):
        self.buckets.append(sorted(expected_checksums))
        if len(self.buckets) == self.bad:
            name = sorted(expected_checksums)[0]
            text = json.dumps({"success": False, "message": f"ValueError: {CHECKSUM_MISMATCH}: tensor {name} arrived"})
            raise EngineError(self.base_url + "/update_weights_from_tensor", 400, text)


def test_a_refused_checksum_stops_the_run_naming_the_engine_and_the_tensor(loop):
    """The sender turns the engine's refusal into WeightsCorrupted (a RunStopped: the driver's one
    error line and status.json), after making the remaining buckets (other ranks gather them too)."""
    client = RefusingClient(bad=2)
    sender = TensorWeightSender([client])
    sender.verify = True
    made = []

    def buckets():
        for i in range(4):
            made.append(i)
            yield [(f"layer{i}.weight", torch.ones(4))]

    with pytest.raises(WeightsCorrupted) as caught:
        sender.send(buckets(), "5", loop)
    line = str(caught.value)
    assert isinstance(caught.value, RunStopped) and "\n" not in line
    assert "engine http://engine-3:30000 " in line and "tensor layer1.weight arrived" in line and "version 5" in line
    assert made == [0, 1, 2, 3] and client.buckets == [["layer0.weight"], ["layer1.weight"]]


@pytest.fixture(scope="module")
def loop():
    from bapo_megatron.engines.loop import EngineLoop

    loop = EngineLoop()
    yield loop
    loop.close()


class FakeOutlet:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.verified, self.probed = fail, [], []

    def publish(self, buckets, version, verify=False):
        self.verified.append(verify)
        if self.fail and verify:
            raise WeightsCorrupted("rollout.sync.verify: engine http://e did not receive tensor w")
        return {"sync/bytes": 1.0}

    def probe(self, engine):
        self.probed.append(engine)

    def waiting(self):
        return []

    def revive(self, engines):
        pass


def _publisher(monkeypatch, outlet, *overrides):
    from bapo_megatron.config import load_config
    from bapo_megatron.weights import publish

    broadcasts = []
    monkeypatch.setattr(publish, "broadcast", lambda obj=None: broadcasts.append(obj) or obj)
    cfg = load_config(None, list(overrides))
    publisher = publish.WeightPublisher(cfg, trainer=None, outlet=outlet)
    monkeypatch.setattr(publisher, "_buckets", lambda: iter(()))
    return publisher, broadcasts


def test_the_publisher_verifies_when_due_and_every_rank_stops_together(monkeypatch):
    outlet = FakeOutlet()
    publisher, broadcasts = _publisher(monkeypatch, outlet, "rollout.sync.verify=every 2")
    assert publisher.publish(1) == publisher.publish(2) == {"sync/bytes": 1.0}
    assert outlet.verified == [False, True] and broadcasts == [None]  # the outcome goes to every rank
    publisher, broadcasts = _publisher(monkeypatch, FakeOutlet(fail=True))  # auto: embedded, every step
    with pytest.raises(WeightsCorrupted, match="tensor w"):
        publisher.publish(3)
    assert broadcasts == ["rollout.sync.verify: engine http://e did not receive tensor w"]


def test_sglang_engines_are_verified_by_the_probe(monkeypatch):
    """SGLang checks no checksums of a full update: a due check is the log-prob probe instead, and
    the update itself never carries the field SGLang's request does not define."""
    outlet = FakeOutlet()
    publisher, _ = _publisher(
        monkeypatch, outlet, "rollout.engines.kind=sglang", "rollout.sync.verify=every_step", "model.hf_path=/m"
    )
    publisher._gap = types.MethodType(lambda self, version, engine: 0.0, publisher)
    assert publisher.publish(1)["sync/probe_logprob_gap"] == 0.0
    assert outlet.verified == [False]
