"""Adapter-only weight updates (model.lora.sync: adapter), without engines: requests name the current
adapter and a request across an update keeps its adapter and its tokens' version (rollout/adapters.py);
each engine loads a version once, one payload per TP rank, which SGLang 0.5.23's own receiving code
takes, and older versions go once no request names them (weights/lora_sync.py); the base goes first and
to an engine that came back, then the adapter alone (weights/engine_updates.py, publish.py); TP 2 and
PP 2 export the adapters whole under PEFT's names beside the base (weights/export.py).
"""

import asyncio
import contextlib
import io
import pickle
import types

import pytest
import torch

from bapo_megatron.common import ipc
from bapo_megatron.common.protocol import Completion, SamplingParams
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.engines.client import CHECKSUM_MISMATCH, EngineError, EngineUnavailable
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.errors import RunStopped
from bapo_megatron.models.lora import peft_config
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.rollout.adapters import ServedAdapter
from bapo_megatron.weights.lora_sync import SGLANG_MISMATCH, AdapterSync, adapter_update_bytes, payloads
from bapo_megatron.weights.sync import WeightsCorrupted
from tests.dist.launch import run_workers

ADAPTER = [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.randn(4, 8)),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.randn(8, 4).to(torch.bfloat16)),
]


@pytest.fixture(scope="module")
def loop():
    engine_loop = EngineLoop()
    yield engine_loop
    engine_loop.close()


class AdapterClient:
    """An engine's LoRA endpoints (engines/client.py's signatures), recording what it was asked."""

    def __init__(self, refuse: str | None = None, gone: bool = False) -> None:
        self.calls: list[tuple] = []
        self.held: set[str] = set()
        self.refuse, self.gone = refuse, gone
        self.base_url = "http://e"

    async def load_lora_adapter_from_tensors(
        self, lora_name, config_dict, serialized_named_tensors, load_format=None, expected_checksums=None
    ) -> None:
        if self.gone:
            raise EngineUnavailable("http://e/load_lora_adapter_from_tensors: no answer")
        if self.refuse:
            raise EngineError("http://e/load_lora_adapter_from_tensors", 400, self.refuse)
        self.calls.append(("load", lora_name, len(serialized_named_tensors), load_format, expected_checksums))
        self.held.add(lora_name)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        self.calls.append(("unload", lora_name))
        if lora_name not in self.held:
            raise EngineError("http://e/unload_lora_adapter", 400, f"{lora_name} is not loaded")
        self.held.discard(lora_name)


# -- what the requests name ---------------------------------------------------------------------


def test_requests_name_the_served_adapter_and_count_while_they_run():
    served = ServedAdapter()
    answer = Completion("r", [5, 6], [-0.1, -0.2], "length", weight_version="9", version_spans=[("9", 0, 2)])
    with served.named() as none:  # before the first sync (and without adapter sync): no adapter
        assert none.request == {} and none.stamp(answer) is answer and served.in_use() == set()
    served.serve(3)
    with served.named() as old:
        assert old.request == {"lora_path": "policy-v3"}
        served.serve(4)  # an update while this request runs: v3 stays in use
        assert served.in_use() == {3, 4}
    assert served.in_use() == {4}
    stamped = old.stamp(answer)
    assert stamped.token_versions() == ["3", "3"] and answer.token_versions() == ["9", "9"]


class RetractingEngine:
    """Keeps each request until `release` (inside the engine across a weight update, as a retract
    pause does), then answers three tokens under the weight version it reports now."""

    def __init__(self) -> None:
        self.release, self.named, self.version = asyncio.Event(), [], "7"

    async def generate(self, input_ids, sampling, rid, routes_from=None, lora_path=None, together=None):
        self.named.append(lora_path)
        await self.release.wait()
        return Completion(rid, [1, 2, 3], [-0.5] * 3, "length", weight_version=self.version)


def test_a_request_across_an_update_keeps_its_adapter_and_its_tokens_version():
    from bapo_megatron.rewards.workers import RewardWorkers
    from bapo_megatron.rollout.buffer import RolloutBuffer
    from bapo_megatron.rollout.core import RolloutCore

    engine, served = RetractingEngine(), ServedAdapter()
    prompts = iter([("p0", [7, 8], {"answer_ids": [9]})])
    buffer = RolloutBuffer(2, max_new_tokens=6, token_budget=3)
    sampling = SamplingParams(max_new_tokens=6)
    core = RolloutCore(
        EnginePool([engine]),
        buffer,
        lambda: next(prompts),
        RewardWorkers("exact_ids", inline=True),
        sampling,
        adapters=served,
    )

    async def run():
        served.serve(3)
        core.fill(1)
        assert core.launch_idle(3) == 2
        await asyncio.sleep(0.05)
        served.serve(4)  # the adapter of version 4 loaded while both wait inside the engine
        engine.version = "4"  # which the engine now reports as its weight version
        engine.release.set()
        while core.running:
            await core.wait()
        assert served.in_use() == {4}  # nothing names v3 any more: it may be unloaded
        core.launch_idle(4)  # the second round, under the new adapter
        while core.running or core.scoring:
            await core.wait()

    asyncio.run(run())
    assert engine.named == ["policy-v3", "policy-v3", "policy-v4", "policy-v4"]
    assert all(s.versions == [3, 3, 3, 4, 4, 4] for s in buffer.groups["p0"].samples)


# -- the adapters on the engines ----------------------------------------------------------------


def test_each_engine_loads_a_version_once_and_unloads_what_no_request_names(loop):
    clients, served = [AdapterClient(), AdapterClient()], ServedAdapter()
    sync = AdapterSync(clients, {"r": 4}, served, engine_tp=2, by_value=True)
    sent, gone = sync.load([ADAPTER[:1], ADAPTER[1:]], 1, [0, 1], loop, verify=True)
    assert gone == [] and sent == sum(t.numel() * t.element_size() for _, t in ADAPTER)
    (call,) = clients[0].calls
    assert call[:4] == ("load", "policy-v1", 2, None) and set(call[4]) == {n for n, _ in ADAPTER}
    served.serve(1)
    assert sync.load([ADAPTER], 1, [0, 1], loop) == (0, [])  # (a refit of another engine): held already
    sync.load([ADAPTER], 2, [0, 1], loop)
    assert clients[1].calls[-1][4] is None  # no checksums unless the sync verifies
    served.serve(2)
    with served.named():  # a request still names v2 as v3 arrives
        sync.load([ADAPTER], 3, [0, 1], loop)
        served.serve(3)
        sync.unload_unused([0, 1], loop)
    assert clients[0].held == {"policy-v2", "policy-v3"}
    sync.unload_unused([0, 1], loop)
    assert clients[0].held == clients[1].held == {"policy-v3"}
    clients[1].held.clear()  # engine 1 restarted: it holds nothing; forgetting it asks and ignores the refusal
    sync.forget([1], loop)
    assert clients[1].calls[-1] == ("unload", "policy-v3") and 1 not in sync.loaded


def test_an_engine_that_refuses_stops_the_run_and_one_gone_is_reported(loop):
    served = ServedAdapter()
    with pytest.raises(RunStopped, match="model.lora.sync=merged"):
        AdapterSync([AdapterClient(refuse="LoRA is not enabled")], {}, served).load([ADAPTER], 1, [0], loop)
    with pytest.raises(WeightsCorrupted, match="rollout.sync.verify: engine http://e"):
        bad = AdapterClient(refuse=f"{CHECKSUM_MISMATCH}: tensor x arrived with sha256 ab, sent cd")
        AdapterSync([bad], {}, served).load([ADAPTER], 1, [0], loop, verify=True)
    with pytest.raises(WeightsCorrupted):  # SGLang's own refusal of a checksum mismatch
        bad = AdapterClient(refuse="[LORA-CHECK] rank0 adapter sync MISMATCH of 2 expected")
        AdapterSync([bad], {}, served).load([ADAPTER], 1, [0], loop, verify=True)
    sync = AdapterSync([AdapterClient(gone=True), AdapterClient()], {}, served)
    assert sync.load([ADAPTER], 1, [0, 1], loop)[1] == [0] and sync.loaded == {1: {1}}


def test_the_update_is_the_adapters_bytes_far_below_the_models():
    spec = tiny_spec("qwen2")
    lora = LoRAConfig(rank=4, target_modules=("q_proj", "down_proj"))
    q = spec.num_heads * spec.head_dim
    per_layer = 4 * (spec.hidden_size + q) + 4 * (spec.ffn_hidden_size + spec.hidden_size)
    assert adapter_update_bytes(spec, lora, torch.float32) == 4 * spec.num_layers * per_layer
    assert adapter_update_bytes(spec, LoRAConfig(), torch.float32) == 0
    config = peft_config(spec, lora, "/models/base")
    assert config["target_modules"] == ["down_proj", "q_proj"] and config["r"] == 4
    assert config["base_model_name_or_path"] == "/models/base" and config["lora_alpha"] == lora.alpha


# -- the payload against SGLang's receiving code ------------------------------------------------


def _sglang_receiver(wheel, rank: int):
    """SGLang's BaseTpWorker.load_lora_adapter_from_tensors as rank `rank` of an engine runs it: its
    MultiprocessingSerializer and SafeUnpickler (torch storages through its weights_only load), its
    checksum check; the model runner's load recorded."""
    import base64
    import hashlib
    import logging

    from tests.sglang_wheel import load_defs

    ns = load_defs(
        wheel,
        {
            "utils/common.py": ["_safe_load_torch_storage", "SafeUnpickler", "MultiprocessingSerializer"],
            "managers/tp_worker.py": ["BaseTpWorker.load_lora_adapter_from_tensors"],
        },
        # pybase64 (not installed here) is base64's API, faster
        {"io": io, "pickle": pickle, "torch": torch, "pybase64": base64, "hashlib": hashlib},
    )
    loaded = {}
    ns.update(get_parallel=lambda: types.SimpleNamespace(tp_rank=rank), logger=logging.getLogger("sglang"))
    worker = types.SimpleNamespace(
        deserialize_own_rank=lambda payloads: ns["MultiprocessingSerializer"].deserialize(payloads[rank]),
        model_runner=types.SimpleNamespace(
            load_lora_adapter_from_tensors=lambda ref, tensors, *a: loaded.update(tensors)
        ),
    )
    return lambda req: ns["load_lora_adapter_from_tensors"](worker, req), loaded


def _request(serialized, load_format, expected):
    """The fields of LoadLoRAAdapterFromTensorsReqInput the worker reads."""
    return types.SimpleNamespace(
        serialized_named_tensors=serialized,
        load_format=load_format,
        expected_checksums=expected,
        to_ref=lambda: None,
        added_tokens_config=None,
        config_dict={},
    )


def test_sglang_takes_the_payload_each_rank_its_copy_and_checks_the_checksums(wheel):
    from bapo_megatron.weights.lora_sync import checksums

    with payloads(ADAPTER, 2, by_value=True) as (serialized, load_format):
        for rank in range(2):
            receive, loaded = _sglang_receiver(wheel, rank)
            receive(_request(serialized, load_format, checksums(ADAPTER)))
            assert loaded.keys() == dict(ADAPTER).keys()
            assert all(torch.equal(loaded[n], t) and loaded[n].dtype == t.dtype for n, t in ADAPTER)
    wrong = {n: c[::-1] for n, c in checksums(ADAPTER).items()}
    receive, _ = _sglang_receiver(wheel, 0)
    with payloads(ADAPTER, 1, by_value=True) as (serialized, fmt), pytest.raises(RuntimeError, match=SGLANG_MISMATCH):
        receive(_request(serialized, fmt, wrong))


def test_the_embedded_engines_payload_is_handles_it_reads_in_place():
    with payloads(ADAPTER, 2, by_value=False) as (serialized, load_format):
        assert load_format == "flattened_bucket" and len(serialized) == 2
        received = ipc.unflatten(ipc.loads(serialized[1]))
    assert [n for n, _ in received] == [n for n, _ in ADAPTER]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(received, ADAPTER, strict=True))


# -- a publish: the base when due, else the adapter alone ----------------------------------------

BASE = [("model.norm.weight", torch.ones(8))]


class Engine(AdapterClient):
    """An engine's weight and LoRA endpoints (colocated: tensors by handle) and the probe, in `events`."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events, self.version = events, None

    async def load_lora_adapter_from_tensors(self, lora_name, *args, **kwargs) -> None:
        self.events.append(f"load {lora_name}")
        await super().load_lora_adapter_from_tensors(lora_name, *args, **kwargs)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        self.events.append(f"unload {lora_name}")
        await super().unload_lora_adapter(lora_name)

    async def begin_weight_update(self) -> None:
        self.events.append("begin")

    async def end_weight_update(self) -> None:
        self.events.append("end")

    async def update_weights_from_tensor(self, serialized, version, *args, flush_cache: bool, **kwargs) -> None:
        self.events.append(f"base {version}")
        self.version = version

    async def update_weight_version(self, version: str, abort_all_requests: bool = False) -> None:
        self.events.append(f"version {version}")
        self.version = version

    async def model_info(self) -> dict:
        return {"weight_version": self.version}

    async def release_memory(self, tags=None) -> None:
        self.events.append(f"release {tags}")

    async def resume_memory(self, tags=None) -> None:
        self.events.append(f"take back {tags}")

    async def generate(self, ids, sampling, rid, lora_path=None):
        self.events.append(f"probe {lora_path}")
        return Completion(rid=rid, output_ids=[4], logprobs=[-0.5], finish="length")


def test_the_base_goes_first_then_the_adapter_alone_and_again_to_an_engine_back(loop):
    from bapo_megatron.config import load_config
    from bapo_megatron.engines.fleet import Engines
    from bapo_megatron.weights.engine_updates import EngineUpdates

    events: list[str] = []
    clients = [Engine(events)]
    pool = EnginePool(clients)
    engines = types.SimpleNamespace(loop=loop, pool=pool, clients=clients, spec=tiny_spec("qwen2"))
    engines.check_version = lambda version, members: Engines.check_version(engines, version, members)
    prompts = types.SimpleNamespace(first=lambda n: [([1, 2, 3], {})])

    @contextlib.asynccontextmanager
    async def paused(version: int):
        events.append(f"pause {version}")
        yield
        events.append("continue")

    cfg = load_config(None, ["rollout.engines.colocate=true", "model.lora.rank=4"])
    served = ServedAdapter()
    updates = EngineUpdates(
        cfg, engines, types.SimpleNamespace(restarts=0), prompts, paused, lambda: None, None, served
    )
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in ADAPTER)
    assert updates.needs_base()
    first = updates.publish_adapter(iter([BASE]), iter([ADAPTER]), 0)
    assert events == ["pause 0", "begin", "base 0", "end", "load policy-v0", "continue"]
    assert first["sync/bytes"] == 32 + adapter_bytes and first["sync/adapter_bytes"] == adapter_bytes
    assert not updates.needs_base() and served.version == 0

    events.clear()
    updates.release_memory()  # the trainer trains: the engine keeps its weights, the base
    second = updates.publish_adapter(None, iter([ADAPTER]), 1)
    assert events == [
        "release ['kv_cache', 'cuda_graph']",
        "pause 1",
        "load policy-v1",
        "version 1",  # the engine's weight version says which adapter it serves
        "unload policy-v0",
        "take back ['kv_cache', 'cuda_graph']",
        "continue",
    ]
    assert second["sync/bytes"] == adapter_bytes and clients[0].held == {"policy-v1"}
    events.clear()
    assert updates.probe(None) is not None and events == ["probe policy-v1"]  # the adapter on

    pool.came_back(0)  # (restarted): the base again, then the current adapter
    assert updates.needs_base()
    events.clear()
    updates.publish_adapter(iter([BASE]), iter([ADAPTER]), 1)
    assert events == ["pause 1", "unload policy-v1", "begin", "base 1", "end", "load policy-v1", "continue"]
    assert updates.waiting() == [0]


class AdapterOutlet:
    """Rank 0's outlet as the publisher sees it: whether the base is due, what it was handed."""

    def __init__(self) -> None:
        self.base, self.calls = True, []

    def needs_base(self) -> bool:
        return self.base

    def publish_adapter(self, base, adapter, version, verify=False) -> dict:
        self.calls.append((base and list(base), list(adapter), version, verify))
        return {"sync/bytes": 1.0}

    def waiting(self) -> list[int]:
        return []

    def revive(self, engines) -> None:
        pass


def test_the_publisher_sends_the_base_when_rank_0_says_and_sglang_checks_the_adapter(monkeypatch):
    from bapo_megatron.config import load_config
    from bapo_megatron.weights import gather, publish

    said = []
    monkeypatch.setattr(publish, "broadcast", lambda obj=None: said.append(obj) or obj)
    monkeypatch.setattr(gather, "hf_buckets_to_rank0", lambda trainer, size, part: iter([part]))
    sglang = ["rollout.engines.kind=sglang", "rollout.engines.urls=[http://e]", "model.hf_path=/m"]
    cfg = load_config(None, ["model.lora.rank=4", "rollout.sync.verify=every_step", *sglang])
    outlet = AdapterOutlet()
    publisher = publish.WeightPublisher(cfg, trainer=None, outlet=outlet)
    monkeypatch.setattr(publisher, "_buckets", lambda part="model": iter([part]))
    publisher._gap = lambda version, engine: 0.0
    assert publisher.publish(1) == {"sync/bytes": 1.0, "sync/probe_logprob_gap": 0.0}
    outlet.base = False
    publisher.publish(2)
    assert outlet.calls == [(["base"], ["adapters"], 1, True), (None, ["adapters"], 2, True)]
    assert said == [True, None, False, None]  # rank 0's answer, then the verified outcome, to every rank


def test_sglang_servers_are_launched_to_serve_the_adapters_they_are_sent():
    """model.lora.sync=adapter: every SGLang server the job (or bapo-serve) starts gets LoRA on, the
    rank, the target modules and room for the versions requests may still name (SGLang 0.5.23's own
    parser reads them: tests/unit/test_sglang_launch_config.py); merged sync or no LoRA: none of
    them. A user cannot set them beside the launcher (they are its options)."""
    from bapo_megatron.config import load_config
    from bapo_megatron.engines.sglang_launcher import Launch, ServedLoRA, server_args
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.models.spec import tiny_spec

    spec = tiny_spec()

    base = ["rollout.engines.kind=sglang", "model.hf_path=/m", "rollout.max_staleness=3"]
    cfg = load_config(None, [*base, "model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"])
    args = server_args(cfg.rollout, Launch("/m", lora=ServedLoRA.of(spec, cfg.model.lora)), 0, None)
    assert {k: args[k] for k in args if "lora" in k} == {
        "enable-lora": True,
        "max-lora-rank": 8,
        "lora-target-modules": ["q_proj", "v_proj"],
        "max-loaded-loras": 5,
        "max-loras-per-batch": 5,
    }
    every = load_config(None, [*base, "model.lora.rank=8"])
    launched = server_args(every.rollout, Launch("/m", lora=ServedLoRA.of(spec, every.model.lora)), 0, None)
    assert launched["lora-target-modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    for plain in ([*base, "model.lora.rank=8", "model.lora.sync=merged"], base):
        cfg = load_config(None, plain)
        launch = Launch("/m", lora=ServedLoRA.of(spec, cfg.model.lora))
        assert not any("lora" in k for k in server_args(cfg.rollout, launch, 0, None))
    with pytest.raises(ConfigError, match="max_lora_rank=4: is the launcher.s option .set from model.lora.rank"):
        load_config(None, [*base, "model.lora.rank=8", "rollout.engines.sglang_args={max_lora_rank: 4}"])


# -- the adapters, the base and the merged model out of TP 2 and PP 2 ----------------------------

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj,o_proj,down_proj]")


def _export_worker(rank: int, world: int, hf_dir: str) -> None:
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import destroy_model_parallel, init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.gather import hf_buckets_to_rank0
    from bapo_megatron.weights.hf_load import load_hf_into_trainer

    activate_cpu_shim()
    hf = HFCheckpoint(hf_dir)
    for layout in (("parallel.tensor=2",), ("parallel.pipeline=2",)):
        destroy_model_parallel()
        cfg = load_config(None, [f"model.hf_path={hf_dir}", *LORA, *layout])
        trainer = PolicyTrainer(hf.spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
        load_hf_into_trainer(trainer, hf_dir)
        whole = _set_random_adapters(trainer, hf, cfg.model.lora)
        parts = {
            part: {n: t.clone() for bucket in hf_buckets_to_rank0(trainer, 1 << 14, part) for n, t in bucket}
            for part in ("adapters", "base", "model")
        }
        if rank == 0:
            _check_parts(parts, whole, hf, cfg.model.lora, layout)


def _set_random_adapters(trainer, hf, lora) -> dict[str, torch.Tensor]:
    """Nonzero whole adapters (PEFT name -> [r, in] / [out, r]), each rank given its slices."""
    from megatron.core import parallel_state as ps

    from bapo_megatron.models.lora import adapter_names, is_adapter

    names, g, whole = adapter_names(hf.spec, lora), torch.Generator().manual_seed(5), {}
    for name, peft in names.items():
        out, inp = hf[peft.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] + ".weight"].shape
        whole[peft] = 0.1 * torch.randn((lora.rank, inp) if ".lora_A." in name else (out, lora.rank), generator=g)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in trainer.model:
        layers = chunk.module.decoder.layers
        for local, param in chunk.module.named_parameters():
            if not is_adapter(local):
                continue
            _, _, i, rest = local.split(".", 3)
            value = whole[names[f"decoder.layers.{layers[int(i)].layer_number - 1}.{rest}"]]
            if getattr(param, "tensor_model_parallel", False):
                value = value.chunk(tp, dim=param.partition_dim)[tp_rank]
            with torch.no_grad():
                param.copy_(value)
    return whole


def _check_parts(parts, whole, hf, lora, layout) -> None:
    adapters, base, merged = parts["adapters"], parts["base"], parts["model"]
    assert adapters.keys() == whole.keys(), layout
    assert all(torch.equal(adapters[n], whole[n]) for n in whole), layout
    assert base.keys() == merged.keys() == set(hf.files), layout
    assert all(torch.equal(base[n], hf[n]) for n in base), layout  # the base as loaded, adapters left out
    expected = dict(base)
    for name in whole:
        if ".lora_A." in name:
            weight = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            b = whole[name.replace(".lora_A.", ".lora_B.")]
            expected[weight] = expected[weight] + lora.alpha / lora.rank * b @ whole[name]
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6, msg=f"{layout} {name}")
    dtype = next(iter(adapters.values())).dtype
    assert sum(t.numel() * t.element_size() for t in adapters.values()) == adapter_update_bytes(hf.spec, lora, dtype)


def test_tp_2_and_pp_2_export_the_adapters_whole_under_pefts_names_beside_the_base(hf_model):
    run_workers(_export_worker, 2, str(hf_model("lora-sync", ("qwen2", 2, False))))
