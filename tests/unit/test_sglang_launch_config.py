"""The launcher's SGLang --config files, read by SGLang 0.5.23's own ConfigArgumentMerger and
server-argument parser (tests/sglang_parser.py, run from the wheel on CPU).

Every option the launcher writes must parse to the value we meant (the documented sglang_args
examples included); a None in sglang_args must not reach SGLang (its merger would pass the
string "None"); every option SGLang registers as deprecated is refused at config time, naming
its replacement, before any server starts (its merger refuses some outright, as shown here).
Skipped only when the wheel or the few packages its import needs cannot be downloaded.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bapo_megatron.config import SGLANG_DEPRECATED_ARGS, load_config
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.engines.launcher import new_admin_key
from bapo_megatron.engines.sglang_launcher import (
    KEY_ENV,
    Launch,
    ServedLoRA,
    admin_key,
    server_args,
    sglang_servers,
)
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.trainer.memory.estimate import rollout_mem_fraction
from tests.helpers import SGLANG_LAUNCH
from tests.sglang_wheel import WheelUnavailable, extracted_wheel, parser_deps

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [*SGLANG_LAUNCH, "rollout.engines.dtype=bfloat16"]


@pytest.fixture(scope="module")
def sglang_parse():
    try:
        src, deps = extracted_wheel(), parser_deps()
    except WheelUnavailable as err:
        pytest.skip(str(err))

    def parse(*configs: Path) -> dict:
        result = subprocess.run(
            [sys.executable, "-m", "tests.sglang_parser", str(src), str(deps), *map(str, configs)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=900,  # a safety net only: importing SGLang on a busy 2-core machine has taken minutes
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    return parse


def test_sglang_parses_every_launcher_option_to_the_value_we_meant(sglang_parse, tmp_path):
    job = load_config(None, LAUNCH)
    cfg = job.rollout
    fraction = rollout_mem_fraction(job, tiny_spec(), 80 << 30, data_parallel=2)
    launch = Launch("/models/qwen", weight_version="7", seed=3, colocated_fraction=fraction, routed_experts=True)
    servers, key = sglang_servers(cfg, launch, tmp_path)
    bad = tmp_path / "none.yaml"  # what the launcher used to write for a None
    bad.write_text(yaml.safe_dump({"model-path": "/m", "max-running-requests": "None"}))
    refused = tmp_path / "deprecated.yaml"
    refused.write_text(yaml.safe_dump({"model-path": "/m", "disable-cuda-graph": True}))
    adapters = ServedLoRA(8, ("q_proj", "v_proj"))  # model.lora.sync=adapter's options
    (tmp_path / "lora").mkdir()
    with_lora = Launch("/models/qwen", "7", 3, fraction, lora=adapters)
    sglang_servers(cfg, with_lora, tmp_path / "lora")
    dashed = tmp_path / "dashed.yaml"  # a url-safe key that starts with "-" (one in 64 did; hex keys never do)
    dashed.write_text(yaml.safe_dump({"model-path": "/m", "admin-api-key": "-" + key[1:]}))
    configs = [tmp_path / "sglang_0.yaml", tmp_path / "sglang_1.yaml", bad, refused, tmp_path / "lora/sglang_0.yaml"]
    out = sglang_parse(*configs, dashed)
    assert "--admin-api-key: expected one argument" in out["configs"][5]["error"]
    for index, result in enumerate(out["configs"][:2]):
        assert "error" not in result, result["error"]
        assert "None" not in result["argv"]
        parsed = result["args"]
        launched = server_args(cfg, launch, index, key)
        assert launched["dtype"] == "bfloat16" and launched["enable-return-routed-experts"] is True
        for name, value in launched.items():
            assert parsed[name.replace("-", "_")] == value, (name, parsed[name.replace("-", "_")], value)
        assert parsed["max_running_requests"] is None  # left at SGLang's default
        assert parsed["port"] == 30000 + index and parsed["tp_size"] == 2 and parsed["dp_size"] == 1
        assert parsed["mem_fraction_static"] == fraction and 0.85 < fraction <= 0.9  # a tiny trainer beside it
    assert "invalid" in out["configs"][2]["error"] and "None" in out["configs"][2]["error"]
    assert "Unsupported config option 'disable_cuda_graph'" in out["configs"][3]["error"]
    assert [s.url for s in servers] == ["http://10.0.0.5:30000", "http://10.0.0.5:30001"]
    assert "error" not in out["configs"][4], out["configs"][4]["error"]
    lora = {k: v for k, v in server_args(cfg, with_lora, 0, None).items() if "lora" in k}
    assert lora["enable-lora"] is True and lora["lora-target-modules"] == ["q_proj", "v_proj"]
    for name, value in lora.items():
        assert out["configs"][4]["args"][name.replace("-", "_")] == value, name


def test_sglangs_deprecated_options_are_refused_at_config_time(sglang_parse):
    deprecated = sglang_parse()["deprecated"]
    assert "disable-cuda-graph" in deprecated
    assert set(deprecated) == set(SGLANG_DEPRECATED_ARGS), "SGLang's deprecated options changed"
    for option, replacement in SGLANG_DEPRECATED_ARGS.items():
        for spelling in (option, option.replace("-", "_")):
            with pytest.raises(ConfigError, match="deprecated") as err:
                load_config(None, [f"rollout.engines.sglang_args={{{spelling}: true}}"])
            assert replacement in str(err.value)


def test_the_memory_fraction_is_the_configs_or_derived_when_colocated():
    from bapo_megatron.engines.sglang_launcher import SEPARATE_MEM_FRACTION, mem_fraction

    separate = load_config(None, ["rollout.engines.kind=sglang"]).rollout
    assert mem_fraction(separate) == SEPARATE_MEM_FRACTION
    colocated = load_config(None, ["rollout.engines.kind=sglang", "rollout.engines.colocate=true"]).rollout
    with pytest.raises(ValueError, match="rollout.engines.mem_fraction_static"):
        mem_fraction(colocated)  # never the separate default beside a trainer
    assert mem_fraction(colocated, 0.42) == 0.42
    chosen = load_config(None, ["rollout.engines.colocate=true", "rollout.engines.mem_fraction_static=0.3"]).rollout
    assert mem_fraction(chosen, 0.42) == 0.3


def test_the_launcher_sets_exactly_the_options_the_config_lists():
    """config.SGLANG_LAUNCHER_ARGS is the one list of the options the launcher derives (the config
    refuses them in sglang_args): a server with every feature on sets all of them but the API key,
    which is never set, and nothing else beyond the user's sglang_args."""
    from bapo_megatron.config import SGLANG_LAUNCHER_ARGS

    cfg = load_config(
        None,
        [
            "rollout.engines.kind=sglang",
            "rollout.engines.colocate=true",
            "rollout.deterministic=true",
            "rollout.engines.mem_fraction_static=0.5",
            "rollout.engines.sglang_args.attention-backend=fa3",
            "rollout.engines.dtype=float32",
        ],
    ).rollout
    args = server_args(
        cfg, Launch("/models/m", routed_experts=True, lora=ServedLoRA.of(tiny_spec(), LoRAConfig(rank=4))), 0, "k" * 32
    )
    assert set(args) - {"attention-backend"} == set(SGLANG_LAUNCHER_ARGS) - {"api-key"}
    plain = server_args(load_config(None, ["rollout.engines.kind=sglang"]).rollout, Launch("/models/m"), 0, None)
    assert "dtype" not in plain and "enable-return-routed-experts" not in plain  # auto: SGLang's own default


def _placement(trainer_gpus: int, node_gpus: int, *overrides: str) -> list[int]:
    from bapo_megatron.engines.sglang_launcher import gpu_placement

    return gpu_placement(
        load_config(None, ["rollout.engines.kind=sglang", *overrides]).rollout, trainer_gpus, node_gpus
    )


def test_servers_started_by_the_driver_never_share_a_gpu_with_a_trainer_that_keeps_its_memory():
    # colocated: each engine rank on the GPU of one trainer rank, which releases its memory
    assert _placement(
        8, 8, "rollout.engines.colocate=true", "rollout.engines.servers=2", "rollout.engines.tensor_parallel=4"
    ) == [0, 4]
    assert _placement(8, 8, "rollout.engines.colocate=true", "rollout.engines.servers=8") == list(range(8))
    with pytest.raises(ValueError, match=r"need the GPUs of 12 trainer ranks on the driver's node, which runs 8"):
        _placement(
            8, 8, "rollout.engines.colocate=true", "rollout.engines.servers=3", "rollout.engines.tensor_parallel=4"
        )
    # on GPUs of their own: after the trainer's ranks on the node
    assert _placement(4, 8, "rollout.engines.servers=2", "rollout.engines.tensor_parallel=2") == [4, 6]
    assert _placement(6, 8, "rollout.engines.servers=1", "rollout.engines.tensor_parallel=2") == [6]
    with pytest.raises(ValueError, match=r"need 2 GPUs beside the trainer's 8 on the driver's node, which has 8"):
        _placement(
            8, 8, "rollout.engines.servers=1", "rollout.engines.tensor_parallel=2"
        )  # `torchrun --nproc-per-node 8`


def test_each_server_config_names_its_placed_gpu(tmp_path):
    cfg = load_config(
        None, ["rollout.engines.kind=sglang", "rollout.engines.servers=2", "rollout.engines.tensor_parallel=2"]
    ).rollout
    servers, _ = sglang_servers(cfg, Launch("/models/m"), tmp_path, base_gpus=[4, 6])
    assert [yaml.safe_load((tmp_path / f"sglang_{i}.yaml").read_text())["base-gpu-id"] for i in range(2)] == [4, 6]
    assert len(servers) == 2


def test_admin_keys_are_keys_sglang_can_parse(tmp_path, monkeypatch):
    """Generated keys are hex; a given key that starts with "-" (SGLang's parser reads it as an option,
    above) or is short is refused, naming where it came from, before any server starts."""
    assert all(re.fullmatch("[0-9a-f]{64}", new_admin_key()) for _ in range(256))
    cfg = load_config(None, LAUNCH).rollout
    assert re.fullmatch("[0-9a-f]{64}", admin_key(cfg, tmp_path))  # beyond loopback: generated
    key_file = tmp_path / "given_key"
    key_file.write_text("-" + "k" * 40 + "\n")
    with_file = load_config(None, [*LAUNCH, f"rollout.engines.admin_key_file={key_file}"]).rollout
    with pytest.raises(ValueError, match=f"admin_key_file={key_file}: the key starts with '-'"):
        admin_key(with_file, tmp_path)
    monkeypatch.setenv(KEY_ENV, "-" + "k" * 40)
    with pytest.raises(ValueError, match=r"\$BAPO_ADMIN_API_KEY: the key starts with '-'"):
        admin_key(cfg, tmp_path)
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(ValueError, match=r"\$BAPO_ADMIN_API_KEY: the key is shorter than 16"):
        admin_key(cfg, tmp_path)
