"""The presets (Qwen2.5-7B and -32B, Qwen3-8B, Qwen3-30B-A3B, Qwen3.5-27B and -35B-A3B, Moonlight-16B-A3B):
the paper's settings, and `bapo-train PRESET --dry-run` memory figures checked against the same
quantities worked out by hand here (within 5%), on 8 x 80 GiB nodes."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_megatron.config import load_config

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
# name: (world size of its Slurm script's trainer, published parameter count of the model card)
PRESETS = {
    "qwen2.5-7b": (8, 7.61e9),
    "qwen2.5-32b": (32, 32.76e9),
    "qwen3-8b": (8, 8.2e9),
    "qwen3-30b-a3b": (32, 30.5e9),
    "qwen3.5-27b": (32, 27e9),  # the language model's 27B (its card; the vision tower and MTP layer aside)
    "qwen3.5-35b-a3b": (32, 35e9),
    "moonlight-16b-a3b": (8, 16e9),
}
SCRIPTS = {  # name: (its Slurm script, where the script puts the SGLang servers, their TP)
    "qwen2.5-7b": ("slurm/bapo_7b.sh", "1 node(s) x 4 server(s)", 2),
    "qwen2.5-32b": ("slurm/bapo_32b.sh", "2 node(s) x 2 server(s)", 4),
    "qwen3.5-27b": ("slurm/bapo_qwen3_5_27b.sh", "2 node(s) x 2 server(s)", 4),
    "qwen3.5-35b-a3b": ("slurm/bapo_qwen3_5_35b_a3b.sh", "2 node(s) x 2 server(s)", 4),
    "moonlight-16b-a3b": ("slurm/bapo_moonlight_16b_a3b.sh", "1 node(s) x 4 server(s)", 2),
}
RECIPE_RESPONSES = {"moonlight-16b-a3b": 7168}
"""The recipe's 8,192-token responses, but where the model's context holds fewer after a 1k prompt."""


def _shape(name: str) -> dict:
    """The text model's config.json: the released multimodal layout nests it under text_config."""
    import json

    hf = json.loads((ROOT / "examples" / name / "shape" / "config.json").read_text())
    return hf.get("text_config", hf)


def _attention(hf: dict, i: int) -> tuple[int, int]:
    """Layer i's attention: (split over TP, whole on every TP rank)."""
    d, heads, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    head = hf.get("head_dim", d // heads)
    kind = hf["model_type"]
    if kind == "deepseek_v3":  # MLA without q_lora: q, kv_b and o split; the kv down-projection and its norm whole
        nope, rope, v, rank = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], hf["kv_lora_rank"]
        return d * heads * (nope + rope) + heads * (nope + v) * rank + heads * v * d, (rank + rope) * d + rank
    if kind.startswith("qwen3_5") and hf["layer_types"][i] == "linear_attention":
        qk = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
        v, vh = hf["linear_num_value_heads"] * hf["linear_value_head_dim"], hf["linear_num_value_heads"]
        # in_proj_qkv, z, b, a; conv1d over q, k, v; dt_bias and A_log; out_proj; the gated norm whole
        split = d * (2 * qk + 2 * v + 2 * vh) + (2 * qk + v) * hf["linear_conv_kernel_dim"] + 2 * vh + v * d
        return split, hf["linear_value_head_dim"]
    gate = heads * head * d if kind.startswith("qwen3_5") else 0  # the output gate's rows of q_proj
    attention = d * heads * head + 2 * d * kv * head + heads * head * d + gate  # q, k and v, o
    if kind == "qwen2":
        attention += (heads + 2 * kv) * head  # q/k/v biases
    return attention, (2 * head if kind.startswith("qwen3") else 0)  # q/k norms


def _layer(hf: dict, i: int) -> tuple[int, int, int]:
    """Layer i's parameters: (split over TP, whole on every TP rank, experts split over EP)."""
    d = hf["hidden_size"]
    split, whole = _attention(hf, i)
    whole += 2 * d  # the input and pre-MLP norms
    experts = hf.get("num_experts", hf.get("n_routed_experts"))
    if experts is None or i < hf.get("first_k_dense_replace", 0):
        return split + 3 * d * hf["intermediate_size"], whole, 0
    shared = hf.get("shared_expert_intermediate_size", hf.get("n_shared_experts", 0) * hf["moe_intermediate_size"])
    split += 3 * d * shared  # the shared expert, a dense MLP split over TP
    whole += experts * d  # the router
    whole += d if "shared_expert_intermediate_size" in hf else 0  # Qwen's sigmoid gate of the shared expert
    whole += experts if hf["model_type"] == "deepseek_v3" else 0  # DeepSeek's expert-score correction bias
    return split, whole, experts * 3 * d * hf["moe_intermediate_size"]


def _by_hand(name: str) -> dict[str, float]:
    """Parameters of the most loaded GPU and the bytes of each kind of state, in GiB."""
    cfg = load_config(ROOT / "examples" / name / "config.yaml")
    hf, world = _shape(name), PRESETS[name][0]
    tp, pp, ep = cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert
    dp = world // (tp * pp)
    d, layers = hf["hidden_size"], hf["num_hidden_layers"]
    each = [_layer(hf, i) for i in range(layers)]
    # first stage: its layers and the embedding; the last: its layers, the final norm and the output
    # layer (the presets' stages hold the same kinds of layers)
    vocab = -(-hf["vocab_size"] // 1024) * 1024  # padded to a multiple of 128 x lcm(TP, vocab_pad_tp 8)
    dense = sum(split / tp + whole for split, whole, _ in each[: layers // pp]) + vocab * d / tp
    if pp == 1:
        dense += vocab * d / tp + d
    expert = sum(experts for *_, experts in each[: layers // pp]) / ep  # whole experts over EP; their state over EDP
    stage = dense + expert
    return {
        "total": sum(map(sum, each)) + 2 * hf["vocab_size"] * d + d,
        "parameters": stage * 2 / GIB,  # bf16
        "gradients": stage * 4 / GIB,  # Megatron's fp32 gradient buffer
        # fp32 main copy + Adam's two moments, sharded
        "optimizer": (dense * 12 / dp + expert * 12 / (tp * dp // ep)) / GIB,
    }


def _dry_run(name: str) -> str:
    world = PRESETS[name][0]
    command = [sys.executable, "-m", "bapo_megatron.train", f"examples/{name}/config.yaml", "--dry-run"]
    done = subprocess.run(
        [*command, f"--world-size={world}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_hold_the_papers_settings(name):
    cfg = load_config(ROOT / "examples" / name / "config.yaml")
    bapo = cfg.algo.bapo
    assert cfg.algo.loss == "bapo" and bapo.target_rho == 0.5
    assert (bapo.low_start, bapo.low_max, bapo.high_start, bapo.high_max) == (0.6, 0.9, 1.2, 3.0)
    assert cfg.rollout.samples_per_prompt == 16 and cfg.optimizer.lr == 1e-6
    assert cfg.rollout.partial and cfg.rollout.engines.kind == "sglang" and cfg.model.precision == "bf16"
    world = PRESETS[name][0]
    assert world % 8 == 0 and world % (cfg.parallel.tensor * cfg.parallel.pipeline) == 0  # whole 8-GPU nodes


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_shape_is_the_published_model(name):
    total = _by_hand(name)["total"]
    assert total == pytest.approx(PRESETS[name][1], rel=0.01)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dry_run_memory_matches_the_hand_count(name):
    out = _dry_run(name)
    want = _by_hand(name)
    distributed = next(line for line in out.splitlines() if line.startswith("trainer, distributed optimizer:"))
    got = {k: float(v) for k, v in re.findall(r"(parameters|gradients|optimizer|peak) ([\d.]+) GiB", distributed)}
    for kind in ("parameters", "gradients", "optimizer"):
        assert got[kind] == pytest.approx(want[kind], rel=0.05), distributed
    assert "replicated" not in out  # GPU runs use the distributed optimizer: no field selects another
    assert float(re.search(r"peak ([\d.]+) GiB", distributed).group(1)) < 80  # the layout fits an H100
    assert "sglang server(s)" in out and "KV cache" in out


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_recipe_is_the_authors_shape_for_the_users_files(name, capsys, monkeypatch):
    """recipe.yaml: the authors' verl recipe (verl layout, DAPO reward, 8 updates a batch, AIME
    every 10 steps with avg@16) on the preset's layout; the user's files go in by overrides, and a
    run without them says which field to set."""
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.preflight import model_spec, validate
    from bapo_megatron.trainer.memory.fit import fit_to_gpu

    base = ROOT / "examples" / name / "recipe.yaml"
    files = ["data.path=/data/dapo-math-17k.parquet", "eval.sets.aime24.path=/data/aime-2024.parquet"]
    cfg = load_config(base, [*files, "eval.sets.aime25.path=/data/aime-2025.parquet"])
    assert (cfg.algo.updates_per_batch, cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt) == (8, 256, 16)
    assert cfg.algo.bapo.low_start == 0.8 and cfg.algo.bapo.high_max == 2.0  # the authors' bounds
    assert cfg.reward.function == "dapo" and cfg.data.answer_field == "reward_model.ground_truth"
    responses = RECIPE_RESPONSES.get(name, 8192)
    assert cfg.data.max_prompt_tokens == 1024 and cfg.rollout.sampling.max_new_tokens == responses
    assert cfg.eval.interval == 10 and cfg.eval.samples == 16 and sorted(cfg.eval.sets) == ["aime24", "aime25"]
    assert cfg.eval.sets["aime24"].path == "/data/aime-2024.parquet"
    preset = load_config(ROOT / "examples" / name / "config.yaml")
    assert cfg.parallel == dataclasses.replace(preset.parallel, max_tokens_per_microbatch=responses + 1024)
    assert cfg.model.moe == preset.model.moe
    from bapo_megatron.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    command = [str(base), *files, "--dry-run"]  # in this process: the CLI's own entry, as bapo-train calls it
    main([*command, "eval.sets.aime25.path=/data/aime-2025.parquet", f"--world-size={PRESETS[name][0]}"])
    capsys.readouterr()
    unset, world = load_config(base, files), PRESETS[name][0]
    fitted = fit_to_gpu(unset, model_spec(unset), world, 80 * GIB).cfg  # as the job starts: fitted, then checked
    with pytest.raises(ConfigError, match=r"eval.sets.aime25.path=None: is not set") as refused:
        validate(fitted, model_spec(unset), world)  # before any model
    with pytest.raises(SystemExit) as exited:
        main([*command, f"--world-size={world}"])
    assert exited.value.code == 2 and capsys.readouterr().err == f"error: {refused.value}\n"  # the dry run too


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.parametrize("file", ["config.yaml", "recipe.yaml"])
def test_the_dry_run_plans_the_world_and_engines_of_the_presets_slurm_script(name, file, capsys, monkeypatch):
    """No --world-size: the preset and its recipe are planned as their Slurm script runs them
    (slurm/bapo_7b.sh: 8 trainer processes, bapo_32b.sh: 32, ...), their SGLang servers on the
    script's rollout nodes."""
    from bapo_megatron.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    files = ["data.path=/d.parquet", "eval.sets.aime24.path=/a.parquet", "eval.sets.aime25.path=/b.parquet"]
    main([f"examples/{name}/{file}", *(files if file == "recipe.yaml" else []), "--dry-run"])
    out = capsys.readouterr().out
    world, (script, nodes, tp) = PRESETS[name][0], SCRIPTS[name]
    assert out.startswith(f"# no --world-size: planned for {world} trainer processes, as {script} runs")
    assert f"trainer: {world} processes" in out
    assert f"engines: 4 sglang server(s), TP {tp} each, on rollout nodes as {script}" in out
    assert f"places them: {nodes}, 8 of each node's 8 GPUs; the script passes their URLs" in out
    assert "cannot place" not in out


def test_an_installed_package_plans_the_recipe_as_the_checkouts_slurm_script_runs_it(tmp_path):
    """Installed as the Dockerfile installs it (`pip install .`, not editable: no slurm/ beside the
    package), run from outside the checkout: the dry run finds slurm/bapo_7b.sh beside the config
    and plans its 8 trainer processes, not the 4 the layout needs at least."""
    source, site = tmp_path / "source", tmp_path / "site"
    shutil.copytree(ROOT / "bapo_megatron", source / "bapo_megatron", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "--target", str(site), str(source)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "BAPO_HOME")} | {"PYTHONPATH": str(site)}
    where = [sys.executable, "-c", "import bapo_megatron; print(bapo_megatron.__file__)"]
    assert subprocess.run(where, cwd=tmp_path, env=env, capture_output=True, text=True).stdout.strip() == str(
        site / "bapo_megatron" / "__init__.py"
    )  # the installed copy, not the checkout's
    preset = ROOT / "examples" / "qwen2.5-7b"
    files = ["data.path=/d.parquet", "eval.sets.aime24.path=/a.parquet", "eval.sets.aime25.path=/b.parquet"]
    command = [str(site / "bin" / "bapo-train"), str(preset / "recipe.yaml"), f"model.hf_path={preset / 'shape'}"]
    done = subprocess.run(
        [*command, *files, "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    script = ROOT / "slurm" / "bapo_7b.sh"
    assert done.stdout.startswith(f"# no --world-size: planned for 8 trainer processes, as {script} runs it"), (
        done.stdout[:300]
    )
    assert "trainer: 8 processes, TP 4 x PP 1 x DP 2" in done.stdout


@pytest.mark.parametrize(("file", "new_tokens", "layers"), [("config.yaml", 32768, 8), ("long.yaml", 65536, 21)])
def test_the_32b_presets_fit_long_responses_on_80_gib(file, new_tokens, layers):
    """config.yaml: 32k-token responses, long.yaml: 64k, on slurm/bapo_32b.sh's layout; recompute
    auto comes to the least full recompute whose estimated peak fits an 80 GiB GPU."""
    cfg = load_config(ROOT / "examples" / "qwen2.5-32b" / file)
    assert cfg.rollout.sampling.max_new_tokens == new_tokens and cfg.parallel.recompute == "auto"
    assert cfg.parallel.max_tokens_per_microbatch == new_tokens + 2048  # and a prompt of up to 2k tokens
    command = [sys.executable, "-m", "bapo_megatron.train", f"examples/qwen2.5-32b/{file}", "--dry-run"]
    done = subprocess.run([*command, "--world-size=32"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "trainer: 32 processes, TP 8 x PP 2 x DP 2" in out
    assert f"activation recompute: auto chose full: {layers} of the 32 layers of each pipeline stage" in out
    line = next(line for line in out.splitlines() if line.startswith("trainer, distributed optimizer:"))
    assert float(re.search(r"peak ([\d.]+) GiB", line).group(1)) <= 73  # 80 GiB less the reserve


def test_long_yaml_is_the_preset_with_the_length_changed():
    from bapo_megatron.config import to_dict

    folder = ROOT / "examples" / "qwen2.5-32b"
    preset, long = to_dict(load_config(folder / "config.yaml")), to_dict(load_config(folder / "long.yaml"))
    long["name"] = preset["name"]
    assert long["rollout"]["sampling"].pop("max_new_tokens") == 65536
    assert long["parallel"].pop("max_tokens_per_microbatch") == 65536 + 2048
    del preset["rollout"]["sampling"]["max_new_tokens"], preset["parallel"]["max_tokens_per_microbatch"]
    assert long == preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_readme_says_the_longest_response_its_preset_fits(name):
    """The figures the dry run prints (`longest response this layout fits`), with and without
    recompute, are the ones the preset's README and the top-level README give."""
    from bapo_megatron.preflight import model_spec
    from bapo_megatron.trainer.memory.fit import longest_response

    cfg = load_config(ROOT / "examples" / name / "config.yaml")
    dp = PRESETS[name][0] // (cfg.parallel.tensor * cfg.parallel.pipeline)
    spec = model_spec(cfg)
    most, plain = (longest_response(cfg, spec, dp, 80 * GIB, recompute=r) for r in (True, False))
    readme = (ROOT / "examples" / name / "README.md").read_text()
    if name == "qwen2.5-7b":  # shared by the 7B and 32B presets: the 32B's figures are in its own
        readme = readme.split("## The longest response it fits")[1]
    top = (ROOT / "README.md").read_text()
    for figure in {f"{most.tokens:,}", f"{plain.tokens:,}"}:
        assert figure in readme and figure in top, (name, figure)
    if most.parallel.recompute == "full":
        layers = f"{most.parallel.recompute_layers} of"
        assert layers in readme, (name, layers)


@pytest.mark.parametrize(
    ("name", "layers"), [("qwen3.5-27b", 26), ("qwen3.5-35b-a3b", 15), ("moonlight-16b-a3b", None)]
)
def test_the_2026_presets_fit_their_responses_on_80_gib(name, layers):
    """Qwen3.5's hybrids are built from Megatron's local modules (unfused but for the attention
    kernel, models/local_attention.py): their 16k responses fit an 80 GiB GPU with the least full
    recompute `auto` finds; Moonlight's whole 8k context fits without recompute. The fitted peak
    stays within 80 GiB less the reserve."""
    from bapo_megatron.preflight import model_spec
    from bapo_megatron.trainer.memory.fit import fit_to_gpu, peak_bytes, usable_bytes

    cfg = load_config(ROOT / "examples" / name / "config.yaml")
    assert cfg.parallel.recompute == "auto"
    spec, world = model_spec(cfg), PRESETS[name][0]
    assert cfg.parallel.max_tokens_per_microbatch == cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    assert cfg.parallel.max_tokens_per_microbatch <= spec.max_position_embeddings
    assert (cfg.model.transformer_impl == "local") == (spec.linear_attention is not None)  # TE builds no hybrid
    fitted = fit_to_gpu(cfg, spec, world, 80 * GIB).cfg.parallel
    assert (fitted.recompute, fitted.recompute_layers) == (("full", layers) if layers else ("none", None))
    dp = world // (cfg.parallel.tensor * cfg.parallel.pipeline)
    assert peak_bytes(cfg, spec, fitted, dp) <= usable_bytes(80 * GIB)


LORA_PRESETS = {"qwen2.5-32b": 8, "qwen3-30b-a3b": 8}
"""name: the world of its lora.yaml (one trainer node; the Slurm script's TRAIN_NODES=1 --nodes=2)."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _adapters_by_hand(name: str, tp: int) -> tuple[int, int]:
    """(the adapters' parameters, those one TP rank holds): r x (in + out) a projection; beside a
    column-parallel layer B is split over TP, beside a row-parallel one A."""
    cfg = load_config(ROOT / "examples" / name / "lora.yaml")
    hf, r, targets = _shape(name), cfg.model.lora.rank, cfg.model.lora.target_modules
    d, heads, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    head, inter = hf.get("head_dim", d // heads), hf["intermediate_size"]
    attention = [(d, heads * head), (d, kv * head), (d, kv * head), (heads * head, d)]
    shapes = dict(zip(PROJECTIONS, attention, strict=False))
    if "num_experts" not in hf:  # a MoE model's MLPs are routed experts: not adapted (refused today)
        shapes |= {"gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}
    chosen = shapes if targets == ("all-linear",) else {t: shapes[t] for t in targets}
    whole = sum(r * (i + o) for i, o in chosen.values())
    local = sum(r * i // tp + o * r if t in ROW_PARALLEL else r * i + o * r // tp for t, (i, o) in chosen.items())
    return hf["num_hidden_layers"] * whole, hf["num_hidden_layers"] * local


@pytest.mark.parametrize("name", sorted(LORA_PRESETS))
def test_the_lora_presets_fit_fewer_nodes_and_their_adapters_are_the_hand_count(name, capsys, monkeypatch):
    """lora.yaml: the dry run on one 8-GPU trainer node (config.yaml needs four) prints the adapters'
    size and counts gradients and Adam state for them alone, as worked out by hand; the peak fits.
    Without --world-size it plans the nodes the preset's own sbatch command states (its script's
    default is config.yaml's four trainer nodes): one trainer node, the engines on one rollout node."""
    from bapo_megatron.train import main

    cfg, world = load_config(ROOT / "examples" / name / "lora.yaml"), LORA_PRESETS[name]
    assert world < PRESETS[name][0] and cfg.model.lora.enabled and cfg.rollout.engines.servers * 4 == world
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    main([f"examples/{name}/lora.yaml", "--dry-run"])
    out = capsys.readouterr().out
    assert f"trainer: {world} processes" in out
    assert f"planned for {world} trainer processes" in out and "--nodes=2" in out
    assert "1 trainer node(s) x 8 GPUs, 1 rollout node(s)" in out and "1 node(s) x 2 server(s)" in out
    whole, local = _adapters_by_hand(name, cfg.parallel.tensor)
    said = re.search(r"LoRA adapters \(model.lora, rank (\d+)\): ([\d,]+) parameters, ([\d.]+) MiB in bf16", out)
    assert int(said.group(1)) == cfg.model.lora.rank and int(said.group(2).replace(",", "")) == whole
    assert float(said.group(3)) == pytest.approx(whole * 2 / 2**20, abs=0.05)
    saved = re.search(r"each checkpoint holds the adapters and their optimizer state, ([\d,.]+) MiB", out)
    bf16, main, moments = 2, 4, 8  # a bf16 adapter, its fp32 main copy, Adam's two fp32 moments: no base
    assert float(saved.group(1).replace(",", "")) == pytest.approx(whole * (bf16 + main + moments) / 2**20, abs=0.05)
    line = next(line for line in out.splitlines() if line.startswith("trainer, distributed optimizer:"))
    got = {k: float(v) for k, v in re.findall(r"(gradients|optimizer|peak) ([\d.]+) GiB", line)}
    dp = world // (cfg.parallel.tensor * cfg.parallel.pipeline)
    assert got["gradients"] == pytest.approx(local * 4 / GIB, abs=0.01), line  # fp32, the adapters' only
    assert got["optimizer"] == pytest.approx(local * 12 / dp / GIB, abs=0.01), line  # main copy + 2 moments
    assert got["peak"] <= 73  # 80 GiB less the reserve


@pytest.mark.parametrize("name", sorted(LORA_PRESETS))
def test_a_lora_preset_is_its_preset_with_lora_and_its_layout(name):
    """The paper's settings stay config.yaml's: only LoRA, its learning rate, the local layers it is
    built on, the layout and the engines of two nodes change."""
    from bapo_megatron.config import to_dict

    folder = ROOT / "examples" / name
    preset, lora = to_dict(load_config(folder / "config.yaml")), to_dict(load_config(folder / "lora.yaml"))
    assert lora["optimizer"].pop("lr") == pytest.approx(10 * preset["optimizer"].pop("lr"))
    for config in (preset, lora):
        del config["name"], config["parallel"], config["model"]["lora"], config["rollout"]["engines"]["servers"]
        del config["model"]["transformer_impl"], config["model"]["moe"]["grouped_gemm"]
    assert lora == preset
