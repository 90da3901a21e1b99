"""Our SGLang payloads against SGLang 0.5.23's own request schemas, read from its released wheel.

The wheel (tests/sglang_wheel.py: downloaded once, 39 MB, cached) is read without importing sglang: the
request classes' fields are collected with `ast`. The test fails if the client sends a
field a request class does not define, parses a response field SGLang does not produce, or
calls an endpoint the server does not route (control endpoints: with ADMIN_OPTIONAL auth).
Skipped, with the reason, when the registry cannot be reached.
"""

import ast
import re

from bapo_megatron.common import protocol
from bapo_megatron.common.protocol import SamplingParams
from tests.helpers import SGLANG_LAUNCH as LAUNCH
from tests.sglang_wheel import ROOT, VERSION
from tests.sglang_wheel import source as _source


def _fields(source: str) -> dict[str, set[str]]:
    """Every class's annotated fields, inherited ones (from classes in the same file) included."""
    tree = ast.parse(source)
    own, bases = {}, {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = {
                s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def collect(name: str) -> set[str]:
        out = set(own.get(name, ()))
        for base in bases.get(name, ()):
            out |= collect(base)
        return out

    return {name: collect(name) for name in own}


def test_requests_use_only_fields_sglang_defines(wheel):
    io = _fields(_source(wheel, "managers/io_struct.py"))
    sampling_fields = _fields(_source(wheel, "sampling/sampling_params.py"))["SamplingParams"]
    full = SamplingParams(
        max_new_tokens=5, temperature=0.5, top_p=0.9, top_k=20, stop_token_ids=(1, 2), ignore_eos=True, sampling_seed=3
    )
    generate = protocol.generate_request([1, 2, 3], full, "rid-1", routed_experts_start_len=2)
    assert {"return_routed_experts", "routed_experts_start_len"} <= set(generate)
    cases = {
        "GenerateReqInput": generate,
        "InitWeightsUpdateGroupReqInput": protocol.init_group_request("127.0.0.1", 1234, 1, 2),
        "UpdateWeightsFromDistributedReqInput": protocol.update_distributed_request(
            ["w"], ["bfloat16"], [[2]], "3", flattened=True
        ),
        "UpdateWeightFromDiskReqInput": protocol.update_disk_request("/m", "3"),
        "UpdateWeightsFromTensorReqInput": protocol.update_tensor_request(["cGF5bG9hZA=="], "3"),
        "PauseGenerationReqInput": protocol.pause_request("retract"),
        "ContinueGenerationReqInput": protocol.continue_request(),
        "AbortReq": {"rid": "x", "abort_all": True},
        "UpdateWeightVersionReqInput": {"new_version": "3", "abort_all_requests": False},
        "BeginWeightUpdateReqInput": {},
        "EndWeightUpdateReqInput": {},
        "ReleaseMemoryOccupationReqInput": protocol.memory_request(["weights", "kv_cache"]),
        "ResumeMemoryOccupationReqInput": protocol.memory_request(None),
    }
    for cls, body in cases.items():
        assert cls in io, f"SGLang {VERSION} has no request class {cls}"
        extra = set(body) - io[cls]
        assert not extra, f"{cls}: we send {sorted(extra)}, which SGLang {VERSION} does not define"
    extra = set(generate["sampling_params"]) - sampling_fields
    assert not extra, f"sampling_params: we send {sorted(extra)}, which SGLang {VERSION} does not define"
    for mode in protocol.PAUSE_MODES:
        assert f'"{mode}"' in _source(wheel, "managers/io_struct.py")
    constants = _source(wheel, "constants.py")
    for tag in protocol.MEMORY_TAGS:  # the tags its memory release and resume know
        assert f'GPU_MEMORY_TYPE_{tag.upper()} = "{tag}"' in constants, tag
    updater = _source(wheel, "model_executor/model_runner_components/weight_updater.py")
    assert f'load_format == "{protocol.FLATTENED}"' in updater
    assert "_receive_bucketed_weights_from_distributed" in updater


def test_parsed_response_fields_are_ones_sglang_produces(wheel):
    manager = _source(wheel, "managers/tokenizer_manager.py") + _source(wheel, "utils/weight_versions.py")
    produced = set(re.findall(r'"([a-z_]+)"\s*:', manager)) | set(re.findall(r'meta_info\["([a-z_]+)"\]', manager))
    import torch

    routes = protocol.encode_routed_experts(torch.zeros(4, 2, 2, dtype=torch.int32))
    response = protocol.generate_response(
        "r", [5, 6], [-0.1, -0.2], {"type": "length", "length": 2}, 3, "1", [("1", 0, 2)], routes
    )
    assert "routed_experts" in response["meta_info"]
    ours = set(response["meta_info"])
    assert not ours - produced, f"meta_info fields SGLang {VERSION} does not produce: {sorted(ours - produced)}"
    for key in ("output_ids", "meta_info", "text"):
        assert f'"{key}"' in manager
    for key in ("version", "start", "end"):  # weight_versions spans
        assert f'"{key}"' in _source(wheel, "utils/weight_versions.py")
    finish_types = set(re.findall(r'"type":\s*"([a-z]+)"', _source(wheel, "managers/schedule_batch.py")))
    assert set(protocol.FINISH_TYPES) <= finish_types
    parsed = protocol.parse_generate_response(response, "r")  # the parser reads exactly what we produce
    assert parsed.output_ids == [5, 6] and parsed.finish == "length" and parsed.token_versions() == ["1", "1"]


def test_endpoints_exist_and_control_ones_are_admin_protected(wheel):
    server = _source(wheel, "entrypoints/http_server.py")
    # each route with the whole decorator block of its handler
    routes = {}
    for block in re.split(r"\n(?:async )?def ", server):
        decorators = block[block.rfind("\n\n") :]
        for path in re.findall(r'@app\.(?:post|get|api_route)\(\s*"(/[a-z_]+)"', decorators):
            routes[path] = decorators
    for path in {"/generate", "/health", "/health_generate", "/model_info"} | protocol.ADMIN_ENDPOINTS:
        assert path in routes, f"SGLang {VERSION} does not route {path}"
    for path in protocol.ADMIN_ENDPOINTS:
        assert "AuthLevel.ADMIN_OPTIONAL" in routes[path] or "AuthLevel.ADMIN_FORCE" in routes[path], path
    assert "ADMIN_OPTIONAL" not in routes["/generate"]


def test_launcher_options_are_sglang_server_args(wheel, tmp_path):
    from bapo_megatron.config import SGLANG_LAUNCHER_ARGS, load_config
    from bapo_megatron.engines.sglang_launcher import Launch, server_args, sglang_servers

    fields = set()
    for name in wheel.namelist():
        if name.startswith(ROOT + "arg_groups/fields/") and name.endswith(".py"):
            for cls_fields in _fields(wheel.read(name).decode()).values():
                fields |= cls_fields
    cfg = load_config(None, LAUNCH).rollout  # the config's documented examples of further options included
    launch = Launch("/models/qwen", colocated_fraction=0.5)
    args = server_args(cfg, launch, 1, "k" * 32)
    unknown = {k for k in [*args, *SGLANG_LAUNCHER_ARGS] if k.replace("-", "_") not in fields}
    assert not unknown, f"SGLang {VERSION} has no server options {sorted(unknown)}"
    assert args["attention-backend"] == "fa3" and args["disable-decode-cuda-graph"] is True
    assert args["port"] == 30001 and args["enable-memory-saver"] and args["dp-size"] == 1
    assert args["enable-deterministic-inference"] is True  # rollout.deterministic: batch-invariant kernels
    servers, key = sglang_servers(cfg, launch, tmp_path)  # a key is generated
    assert key and (tmp_path / "admin_api_key").read_text().strip() == key
    assert (tmp_path / "admin_api_key").stat().st_mode & 0o777 == 0o600
    config = tmp_path / "sglang_0.yaml"
    assert config.stat().st_mode & 0o777 == 0o600 and key in config.read_text()
    assert key not in " ".join(servers[0].command)  # never on the command line
    assert [s.url for s in servers] == ["http://10.0.0.5:30000", "http://10.0.0.5:30001"]


def _allowed_globals(wheel) -> set[tuple[str, str]]:
    """SafeUnpickler.ALLOWED_GLOBALS, the only globals SGLang resolves in a tensor payload."""
    for node in ast.walk(ast.parse(_source(wheel, "utils/common.py"))):
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and stmt.targets[0].id == "ALLOWED_GLOBALS":
                    return ast.literal_eval(stmt.value)
    raise AssertionError(f"SGLang {VERSION} has no SafeUnpickler.ALLOWED_GLOBALS")


def test_tensor_payloads_pass_sglangs_safe_unpickler(wheel):
    import base64
    import io
    import pickle

    import torch

    from bapo_megatron.common import ipc

    allowed = _allowed_globals(wheel)
    bucket = [
        ("model.layers.0.mlp.down_proj.weight", torch.randn(3, 4)),
        ("model.norm.weight", torch.randn(4).to(torch.bfloat16)),
    ]
    used = set()

    class Strict(pickle.Unpickler):  # SGLang's rule: every global on its list (then ours resolves it)
        def find_class(self, module, name):
            if (module, name) == (ipc.__name__, "rebuild_shared"):  # CPU tensors: the embedded engine only
                return ipc.rebuild_shared
            assert (module, name) in allowed, f"SGLang {VERSION} refuses {module}.{name} in a tensor payload"
            used.add((module, name))
            return (
                ipc.FlattenedTensorMetadata
                if (module, name) == ipc.SGLANG_METADATA
                else super().find_class(module, name)
            )

    with ipc.serialized(ipc.flattened_bucket(bucket)) as (payload,):
        flat = Strict(io.BytesIO(base64.b64decode(payload))).load()
        received = ipc.unflatten(flat)
    for (name, want), (got_name, got) in zip(bucket, received, strict=True):
        assert name == got_name and torch.equal(want, got)
    with ipc.serialized(bucket) as (payload,):
        named = Strict(io.BytesIO(base64.b64decode(payload))).load()
    assert [n for n, _ in named] == [n for n, _ in bucket]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, bucket, strict=True))
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in allowed  # how GPU tensors travel
    assert ipc.SGLANG_METADATA in used
    # the metadata's fields, in order, are those of SGLang's dataclass; its reader uses these keys
    fields = [
        s.target.id
        for node in ast.parse(_source(wheel, "weight_sync/tensor_bucket.py")).body
        if isinstance(node, ast.ClassDef) and node.name == ipc.SGLANG_METADATA[1]
        for s in node.body
        if isinstance(s, ast.AnnAssign)
    ]
    assert fields == list(ipc.FlattenedTensorMetadata.__dataclass_fields__)
    updater = _source(wheel, "model_executor/model_runner_components/weight_updater.py")
    assert 'flattened_tensor_bucket_dict["flattened_tensor"]' in updater
    assert 'flattened_tensor_bucket_dict["metadata"]' in updater
    patch = _source(wheel, "utils/patch_torch.py")  # GPUs named by UUID at this argument
    assert f"_REDUCE_TENSOR_ARG_DEVICE_INDEX = {ipc._CUDA_DEVICE_ARG}" in patch


def test_asynchronous_pauses_and_updates_are_sglangs(wheel):
    """rollout.pause_mode's values are exactly SGLang's pause modes; an update during an in-place pause
    carries flush_cache false, because SGLang's scheduler refuses a flush (and fails the update) while
    requests keep their cache; the embedded engine refuses it with SGLang's own message."""
    import typing

    from bapo_megatron.config import RolloutConfig
    from bapo_megatron.engines.embedded.server import EmbeddedServer

    io = _source(wheel, "managers/io_struct.py")
    pause = next(
        node for node in ast.parse(io).body if isinstance(node, ast.ClassDef) and node.name == "PauseGenerationReqInput"
    )
    (annotation,) = [s.annotation for s in pause.body if isinstance(s, ast.AnnAssign) and s.target.id == "mode"]
    sglang_modes = set(ast.literal_eval(ast.unparse(annotation.slice)))
    assert (
        sglang_modes
        == set(protocol.PAUSE_MODES)
        == set(typing.get_args(typing.get_type_hints(RolloutConfig)["pause_mode"]))
    )
    for mode in protocol.PAUSE_MODES:
        assert set(protocol.pause_request(mode)) <= _fields(io)["PauseGenerationReqInput"]
    update = protocol.update_distributed_request(["w"], ["bfloat16"], [[2]], "3", flush_cache=False)
    assert update["flush_cache"] is False and set(update) <= _fields(io)["UpdateWeightsFromDistributedReqInput"]
    updater = _source(wheel, "managers/scheduler_components/weight_updater.py")
    flush = next(
        node
        for node in ast.walk(ast.parse(updater))
        if isinstance(node, ast.FunctionDef) and node.name == "flush_cache_after_weight_update"
    )
    refusals = [
        node.value.elts[1].value
        for node in ast.walk(flush)
        if isinstance(node, ast.Return)
        and isinstance(node.value, ast.Tuple)
        and isinstance(node.value.elts[1], ast.Constant)
    ]
    assert refusals, f"SGLang {VERSION} no longer refuses a flush while requests run"
    assert "is_fully_idle(ignore_waiting=self._engine_paused)" in _source(wheel, "managers/scheduler.py")
    server = object.__new__(EmbeddedServer)  # the refusal alone: no model needed
    server.paused, server.core = "in_place", type("Core", (), {"running": [object()], "version": "0"})()
    server._poke = lambda: None
    assert server._after_update({"flush_cache": True}) == refusals[0]


def test_routed_experts_are_returned_as_sglang_returns_them(wheel):
    """What protocol.py's routes format rests on, in SGLang's source: base64 of the int32 host buffer
    [tokens, num_hidden_layers, top_k], positions [routed_experts_start_len, seqlen - 1) with seqlen
    = prompt + output, a start past the prompt refused, capture buffers zeroed (a dense layer's rows
    are never written: DENSE_LAYER_EXPERT) and written per MoE layer by its router's top-k."""
    capturer = _source(wheel, "state_capturer/base.py")
    zeroed = r"self\.buffer = torch\.zeros\(\s*\(max_batch_size, num_layers, topk_size\),\s*dtype=torch\.int32"
    assert re.search(zeroed, capturer)
    assert "self.buffer.zero_()" in capturer and "dtype=torch.int32," in capturer
    assert "self.buffer[:batch, layer_id, :] = topk_indices" in capturer
    assert "[start_len : seqlen - 1]" in capturer and "start_len = min(start_len, seqlen - 1)" in capturer
    assert protocol.DENSE_LAYER_EXPERT == 0
    routed = _source(wheel, "state_capturer/routed_experts.py")
    assert "num_layers = model_config.hf_text_config.num_hidden_layers" in routed
    assert "topk_size = model_config.hf_text_config.num_experts_per_tok" in routed
    collect = _source(wheel, "managers/scheduler_components/batch_result_processor.py")
    assert "seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)" in collect
    assert "routed_experts_start_len > len(req.origin_input_ids)" in _source(wheel, "managers/scheduler.py")
    manager = _source(wheel, "managers/tokenizer_manager.py")
    assert 'pybase64.b64encode(val.numpy().tobytes()).decode("utf-8")' in manager
    assert 'meta_info["routed_experts"] = val' in manager
    io = _fields(_source(wheel, "managers/io_struct.py"))["GenerateReqInput"]
    assert {"return_routed_experts", "routed_experts_start_len"} <= io


def test_exported_expert_names_are_what_sglangs_qwen3_moe_loader_maps(wheel):
    """Our per-expert HF names (the trainer's export, layout.megatron_to_hf) against SGLang 0.5.23's
    Qwen3-MoE loader. Its expert mapping is executed from the wheel's own code:
    FusedMoE.make_expert_params_mapping (layers/moe/fused_moe_triton/layer.py) compiled alone with
    load_defs, since importing its module needs SGLang's CUDA kernels. The loader's routing
    (models/qwen3_moe.py load_weights) is checked in its source and replayed: stacked names skip
    anything under mlp.experts, then the first mapping whose weight name the name contains turns it
    into the fused parameter, which the unquantized method registers as w13_weight / w2_weight."""
    import transformers

    from bapo_megatron.common.hf_experts import per_expert
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.weights.layout import hf_to_megatron, megatron_to_hf
    from tests.sglang_wheel import load_defs

    spec = tiny_spec("qwen3_moe")
    config = transformers.AutoConfig.for_model(**spec.to_hf_config())
    hf = dict(per_expert(transformers.AutoModelForCausalLM.from_config(config).state_dict()))
    exported = megatron_to_hf(spec, hf_to_megatron(spec, hf, spec.vocab_size))
    assert set(exported) == set(hf)  # the names the embedded engine and checkpoints use too
    path = "layers/moe/fused_moe_triton/layer.py"
    make = load_defs(wheel, {path: ["FusedMoE.make_expert_params_mapping"]}, {})["make_expert_params_mapping"]
    mapping = make.__func__(
        None,
        ckpt_gate_proj_name="gate_proj",
        ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj",
        num_experts=spec.moe.num_experts,
    )
    loader = _source(wheel, "models/qwen3_moe.py")
    for rule in (
        'ckpt_gate_proj_name="gate_proj"',
        'ckpt_down_proj_name="down_proj"',
        'ckpt_up_proj_name="up_proj"',
        "num_experts=self.config.num_experts",
        'if "mlp.experts" in name:',
        "name = name.replace(weight_name, param_name)",
        "self.gate = ReplicatedLinear(",
        "self.q_norm = RMSNorm(",
    ):
        assert rule in loader, rule
    unquantized = _source(wheel, "layers/quantization/unquant.py")
    assert 'register_parameter("w13_weight"' in unquantized and 'register_parameter("w2_weight"' in unquantized
    shards = {"gate": "w1", "up": "w3", "down": "w2"}
    experts = [n for n in exported if ".mlp.experts." in n]
    assert len(experts) == 3 * spec.moe.num_experts * len(spec.moe.sparse_layers)
    for name in experts:
        layer, expert, part = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$", name).groups()
        param, weight, expert_id, shard = next(m for m in mapping if m[1] in name)
        fused = "w2_weight" if part == "down" else "w13_weight"
        assert name.replace(weight, param) == f"model.layers.{layer}.mlp.experts.{fused}", name
        assert (expert_id, shard) == (int(expert), shards[part]), name
    routers = [n for n in exported if n.endswith(".mlp.gate.weight")]
    assert [int(n.split(".")[2]) for n in routers] == list(spec.moe.sparse_layers)


# -- LoRA adapters -----------------------------------------------------------------------------
def _field_annotations(source: str) -> dict[str, dict[str, tuple[ast.expr, bool]]]:
    """Every class's fields as (annotation, has a default), its bases' (in the same file) included."""
    tree = ast.parse(source)
    own, bases = {}, {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = {
                s.target.id: (s.annotation, s.value is not None)
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def collect(name: str) -> dict:
        out = {}
        for base in bases.get(name, ()):
            out |= collect(base)
        return out | own.get(name, {})

    return {name: collect(name) for name in own}


def _conforms(value, annotation: ast.expr) -> bool:
    """Whether a JSON value is what SGLang's HTTP schema takes for `annotation` (bytes: base64 text)."""
    import base64
    import binascii

    if isinstance(annotation, ast.Name):
        if annotation.id == "bytes":
            try:
                return isinstance(value, str) and base64.b64decode(value, validate=True) is not None
            except binascii.Error:
                return False
        if annotation.id == "Any":
            return True
        kinds = {"str": str, "bool": bool, "int": int, "float": (int, float)}
        return isinstance(value, kinds[annotation.id]) and (annotation.id == "bool" or not isinstance(value, bool))
    head, args = annotation.value.id, annotation.slice
    args = list(args.elts) if isinstance(args, ast.Tuple) else [args]
    if head == "Optional":
        return value is None or _conforms(value, args[0])
    if head == "Union":
        return any(_conforms(value, a) for a in args)
    if head == "Annotated":
        return _conforms(value, args[0])
    if head == "List":
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if head == "Dict":
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()
        )
    raise AssertionError(f"no rule for {ast.unparse(annotation)}")


def test_lora_requests_and_answers_are_sglangs(wheel):
    """What the client sends to load and unload adapters and to generate under one, checked against
    SGLang's request classes field by field (only fields they define, every required one, each value
    of its field's type); the embedded engine answers with LoRAUpdateOutput's fields, refusing with
    SGLang's messages, and checks expected_checksums as SGLang's tp_worker does (extras refused too)."""
    import asyncio
    import json

    import torch

    from bapo_megatron.common import ipc
    from bapo_megatron.engines.client import EngineClient
    from bapo_megatron.engines.embedded.lora_endpoints import AdapterNames, answer

    sent = []

    class Recording(EngineClient):
        async def request(self, path, body=None, method="POST", retry=True, raw=False):
            sent.append((path, body))
            if path == "/generate":
                return protocol.generate_response("r", [5], [-0.1], {"type": "length", "length": 1}, 3, "1", [])
            return {"success": True, "error_message": None, "loaded_adapters": {}}

    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": False}
    tensors = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(4, 8))]

    async def run():
        client = Recording("http://engine")
        with ipc.serialized(ipc.flattened_bucket(tensors)) as flat, ipc.serialized(tensors) as named:
            await client.load_lora_adapter_from_tensors("v3", config, flat, protocol.FLATTENED, {tensors[0][0]: "ab"})
            await client.load_lora_adapter_from_tensors("v4", config, named)
        await client.load_lora_adapter("v5", "/adapters/v5")
        await client.unload_lora_adapter("v3")
        await client.generate([1, 2, 3], SamplingParams(max_new_tokens=1), "r", lora_path="v4")

    asyncio.run(run())
    io_source = _source(wheel, "managers/io_struct.py")
    classes = _field_annotations(io_source)
    wanted = {
        "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
        "/load_lora_adapter": "LoadLoRAAdapterReqInput",
        "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
        "/generate": "GenerateReqInput",
    }
    assert {path for path, _ in sent} == set(wanted)
    for path, body in sent:
        fields = classes[wanted[path]]
        assert set(body) <= set(fields), f"{path}: {sorted(set(body) - set(fields))} not SGLang's"
        required = {name for name, (_, default) in fields.items() if not default}
        assert required <= set(body), f"{path}: lacks {sorted(required - set(body))}"
        for name, value in body.items():
            if path != "/generate" or name == "lora_path":
                assert _conforms(value, fields[name][0]), (
                    f"{path}: {name}={value!r:.80} is no {ast.unparse(fields[name][0])}"
                )
    assert sent[-1][1]["lora_path"] == "v4"
    reply = json.loads(answer(AdapterNames(), "refused").text)
    assert set(reply) == set(classes["LoRAUpdateOutput"]) and reply["success"] is False
    server = _source(wheel, "entrypoints/http_server.py")
    assert server.count("status_code = HTTPStatus.OK if result.success else HTTPStatus.BAD_REQUEST") >= 3
    manager = _source(wheel, "lora/lora_manager.py")
    assert 'f"Failed to load LoRA adapter {lora_ref.lora_name} because it is already loaded"' in manager
    tokenizer = _source(wheel, "managers/tokenizer_control_mixin.py")
    assert "has an incomplete unload. " in tokenizer and "Retry the unload before loading it again." in tokenizer
    unregister, wait = (tokenizer.index(s) for s in ("lora_registry.unregister(", "lora_registry.wait_for_unload("))
    assert unregister < wait  # the name goes first, then the unload waits for the requests under it
    worker = _source(wheel, "managers/tp_worker.py")
    assert "extra = [n for n in tensors if n not in exp]" in worker and "if mismatch or missing or extra:" in worker
