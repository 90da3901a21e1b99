"""`bapo-train` as a user meets it: --help, --help-config (generated from the dataclasses),
--dry-run (layout, engines, memory; builds no model and imports no Megatron), bad arguments."""

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from bapo_megatron import cli
from bapo_megatron.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]
QWEN7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _leaf_fields(cls=JobConfig, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], prefix + f.name + ".")
        else:
            yield prefix + f.name


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        cli.parse_args(["--help"])
    assert done.value.code == 0 and "usage: bapo-train" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        cli.parse_args(["job.yaml", "oops"])
    assert done.value.code == 2 and "'oops' is neither the config file" in capsys.readouterr().err
    args = cli.parse_args(["job.yaml", "steps=3", "--dry-run"])
    assert (args.config, args.overrides, args.dry_run) == ("job.yaml", ["steps=3"], True)


def test_help_config_lists_every_field_once_with_its_doc():
    text = cli.help_config()
    body = text.splitlines()[2:]  # after the heading and a blank line
    listed = [line.split(":")[0] for line in body if line and not line.startswith(" ")]
    assert sorted(listed) == sorted([*_leaf_fields(), "algo.bapo.preset"])  # the preset key too
    assert "algo.bapo.target_rho: float = 0.5\n    rho0: the share P / (P + N)" in text
    assert "rollout.engines.mem_fraction_static: float | None = None" in text
    assert "model.mcore_path: str | None = None" in text


def test_dry_run_prints_layout_engines_and_memory_without_megatron(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN7B))
    code = (
        "import sys\nfrom bapo_megatron.train import main\nmain(sys.argv[1:])\n"
        "print('MEGATRON', 'megatron' in sys.modules)"
    )
    args = [
        f"model.hf_path={tmp_path}",
        "model.precision=bf16",
        "model.transformer_impl=transformer_engine",
        "parallel.tensor=4",
        "parallel.sequence_parallel=true",
        "rollout.engines.kind=sglang",
        "rollout.engines.colocate=true",
        "rollout.engines.servers=2",
        "rollout.engines.tensor_parallel=4",
        "--dry-run",
        "--world-size",
        "8",
    ]
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "trainer: 8 processes, TP 4 x PP 1 x DP 2" in out
    assert "engines: 2 sglang server(s), TP 4 each" in out and "colocated with the trainer" in out
    assert "rollout: mode sync, max_staleness K=4: each step generates, then trains; whole responses" in out
    assert "node 0: server 0 on GPUs 0-3 (weights from trainer ranks 0-3), server 1 on GPUs 4-7 (weights" in out
    assert "trainer, distributed optimizer: parameters 3.55 GiB" in out  # 7.6 B bf16 over TP 4
    assert "each SGLang server GPU: mem_fraction_static" in out and "KV cache" in out
    assert out.strip().endswith("MEGATRON False")  # nothing was built: Megatron never imported


def test_dry_run_says_where_sglang_servers_go_or_why_they_cannot(capsys):
    from bapo_megatron.train import main

    sglang = [
        "rollout.engines.kind=sglang",
        "rollout.engines.servers=2",
        "rollout.engines.tensor_parallel=2",
        "--dry-run",
    ]
    main([*sglang, "--world-size", "4"])
    assert "trainer ranks on GPUs 0-3): GPUs 4-5, 6-7" in capsys.readouterr().out
    main([*sglang, "--world-size", "8"])  # every GPU of the node trains: no room beside them
    assert "cannot place them (2 server(s) x TP 2 on GPUs of their own need 4 GPUs" in capsys.readouterr().out
    main([*sglang, "--world-size", "4", "--gpus-per-node", "4"])
    assert "which has 4" in capsys.readouterr().out


def test_dry_run_prints_the_asynchronous_mode_and_its_bound(capsys):
    from bapo_megatron.train import main

    main(["examples/qwen2.5-7b/config.yaml", "--dry-run", "--world-size", "8"])
    out = capsys.readouterr().out
    assert "rollout: mode async, max_staleness K=4: the engines generate while the trainer trains" in out
    assert "at most 320 groups queued or generating, 128 generating" in out  # (4 + 1) x 64; 2 x 64
    assert "weight updates pause them (retract)" in out and "(older samples generated again)" in out


def test_dry_run_refuses_a_layout_that_cannot_split(tmp_path, capsys):
    from bapo_megatron.train import main

    with pytest.raises(SystemExit) as done:
        main(["parallel.tensor=3", "--dry-run", "--world-size", "3"])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip() == "error: parallel.tensor=3: must divide the 4 attention heads"


def test_a_dry_run_outside_a_launcher_plans_for_the_presets_own_world(tmp_path, capsys, monkeypatch):
    """No --world-size and no $WORLD_SIZE: the world the repository's Slurm script gives the config,
    else the smallest its parallel sizes need, said on the first line."""
    from bapo_megatron.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("BAPO_HOME", raising=False)
    main(["examples/qwen2.5-32b/config.yaml", "--dry-run"])
    out = capsys.readouterr().out
    assert out.startswith("# no --world-size: planned for 32 trainer processes, as slurm/bapo_32b.sh runs this config")
    assert "trainer: 32 processes, TP 8 x PP 2 x DP 2" in out
    mine = tmp_path / "mine.yaml"
    mine.write_text((ROOT / "examples" / "qwen2.5-32b" / "config.yaml").read_text())
    main([str(mine), "--dry-run"])
    out = capsys.readouterr().out
    assert "smallest world the layout needs, TP 8 x PP 2 x CP 1 = 16 trainer processes" in out
    assert f"# no Slurm script found: no slurm/ folder above {mine} and no $BAPO_HOME" in out
    assert "trainer: 16 processes" in out
    main([str(mine), "--dry-run", "--world-size", "64"])
    assert "# no --world-size" not in capsys.readouterr().out


def test_overrides_may_follow_the_options():
    args = cli.parse_args(["job.yaml", "--dry-run", "steps=3", "--world-size", "8", "algo.loss=ppo"])
    assert (args.config, args.overrides, args.dry_run, args.world_size) == (
        "job.yaml",
        ["steps=3", "algo.loss=ppo"],
        True,
        8,
    )


def _run_env(monkeypatch, world: int) -> None:
    """A launcher's environment for rank 0 of `world` (nothing listens: the run must stop before)."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")


def _gpu_machine(monkeypatch, gib: int) -> None:
    """This process as one on a GPU of `gib` GiB that runs the presets' precision (Transformer Engine, bf16)."""
    from bapo_megatron.trainer import megatron_config
    from bapo_megatron.trainer.memory import fit as fitting

    monkeypatch.setattr(fitting, "local_gpu_bytes", lambda: gib * 2**30)
    monkeypatch.setattr(megatron_config, "check_precision_support", lambda model: None)


def _refusal(capsys, argv: list[str]) -> str:
    from bapo_megatron.train import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    return capsys.readouterr().err


def test_dry_run_says_what_recompute_auto_chose_and_the_run_chooses_the_same(capsys, monkeypatch):
    """The dry run plans the job for --gpu-memory-gib with the run's own function (plan.plan_run, which
    job.plan calls for its GPU's size): the same choice where it fits, the same refusal where nothing
    does, both before anything is built."""
    from bapo_megatron.config import load_config
    from bapo_megatron.job import plan
    from bapo_megatron.train import main

    preset = "examples/qwen2.5-32b/config.yaml"  # 32k responses, recompute: auto
    main([preset, "--dry-run", "--world-size", "32"])
    out = capsys.readouterr().out
    assert "activation recompute: auto chose full: 8 of the 32 layers of each pipeline stage" in out
    assert "  recompute: full\n  recompute_layers: 8\n" in out  # the resolved config, as the run saves it
    assert "longest response this layout fits: 129,024 tokens, the model's context (recompute full: 27 of" in out
    _run_env(monkeypatch, 32)
    _gpu_machine(monkeypatch, 80)
    cfg = load_config(preset)
    chosen = plan(cfg, 0).cfg.parallel
    assert (chosen.recompute, chosen.recompute_layers) == ("full", 8)
    assert "activation recompute: auto chose full: 8 of the 32" in capsys.readouterr().out  # said by rank 0
    # 64k on 40 GiB GPUs: nothing fits; the dry run and the run refuse alike
    long = ["examples/qwen2.5-32b/long.yaml"]
    dry = _refusal(capsys, [*long, "--dry-run", "--world-size", "32", "--gpu-memory-gib", "40"])
    _gpu_machine(monkeypatch, 40)
    assert _refusal(capsys, long) == dry
    assert dry.startswith("error: parallel.recompute='auto': does not fit:") and "40 GiB GPU" in dry
    assert "parallel.pipeline=4" in dry and "parallel.max_tokens_per_microbatch=" in dry


def test_context_parallel_is_refused_naming_the_longest_response_without_it(capsys, monkeypatch):
    """parallel.context > 1 (Transformer Engine and two GPUs at least in megatron-core 0.16.1, and no
    sequence split yet): the dry run and the run refuse it before anything starts, with the longest
    response the layout fits without it."""
    from bapo_megatron.config import load_config
    from bapo_megatron.preflight import model_spec
    from bapo_megatron.trainer.memory.fit import longest_response

    argv = ["examples/qwen2.5-32b/config.yaml", "parallel.context=2"]
    dry = _refusal(capsys, [*argv, "--dry-run", "--world-size", "32"])
    plain = load_config(argv[0])
    longest = longest_response(plain, model_spec(plain), 2, 80 * 2**30)  # TP 8 x PP 2 x DP 2, CP ranks as DP
    assert dry.startswith("error: parallel.context=2: context parallel is not supported")
    assert "Transformer Engine" in dry and "at least two GPUs" in dry
    assert f"TP 8 x PP 2 x DP 2 fits responses of up to {longest.tokens:,} tokens (the model's context)" in dry
    assert "on 80 GiB GPUs" in dry and "recompute full: 27 of the 32 layers" in dry
    _run_env(monkeypatch, 32)  # the run, on a machine without a GPU: figured for an 80 GiB one
    assert _refusal(capsys, argv) == dry.replace("80 GiB GPUs", "80 GiB GPUs (no GPU here)")


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--world-size", "3"], "error: rollout.prompts_per_step=8: 32 samples per optimizer step do not split over 3"),
        (["rollout.sampling.max_new_tokens=5000"], "error: parallel.max_tokens_per_microbatch=4096: leaves no room"),
    ],
)
def test_the_dry_run_refuses_what_the_run_refuses(argv, start, capsys, monkeypatch):
    """A batch that does not split over the data-parallel ranks, responses no micro-batch holds:
    preflight.validate refuses them in the run (job.py) and in the dry run alike, before anything."""
    world = argv[1] if argv[0] == "--world-size" else "1"
    overrides = [a for a in argv if "=" in a]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dry = _refusal(capsys, [*overrides, "--dry-run", "--world-size", world])
    assert dry.startswith(start), dry
    _run_env(monkeypatch, int(world))
    assert _refusal(capsys, overrides) == dry
    if overrides:  # what to set: the micro-batch's budget, not the prompt cap
        assert "set parallel.max_tokens_per_microbatch to 5000 plus the longest prompt" in dry


def test_a_peak_over_the_gpu_is_refused_unless_asked_to_go_on(capsys, monkeypatch):
    """A recompute set by hand whose estimated peak does not fit: "does not fit", the peak, the GPU and
    what would fit, from fit_to_gpu in the dry run and in the run; parallel.over_memory=true goes on
    (the run warns)."""
    from bapo_megatron.config import load_config
    from bapo_megatron.job import plan
    from bapo_megatron.train import main

    argv = ["examples/qwen2.5-32b/config.yaml", "parallel.recompute=none"]  # 32k responses: 85.6 GiB
    dry = _refusal(capsys, [*argv, "--dry-run", "--world-size", "32"])
    assert dry.startswith("error: parallel.recompute='none': does not fit: with parallel.recompute=none the ")
    assert "estimated peak is 85.6 GiB a GPU, more than the 73.0 GiB usable of each 80 GiB GPU" in dry
    assert "it would fit with parallel.recompute=auto (full: 8 of the 32 layers" in dry
    assert "parallel.pipeline=4 (32 GPUs" in dry and "parallel.over_memory=true runs it anyway" in dry
    _run_env(monkeypatch, 32)
    _gpu_machine(monkeypatch, 80)
    assert _refusal(capsys, argv) == dry
    main([*argv, "parallel.over_memory=true", "--dry-run", "--world-size", "32"])
    assert "estimated peak 85.6 GiB does NOT fit the 73.0 GiB usable" in capsys.readouterr().out
    cfg = load_config(argv[0], [*argv[1:], "parallel.over_memory=true"])
    with pytest.warns(UserWarning, match="does NOT fit"):
        assert plan(cfg, 0).cfg.parallel.recompute == "none"


def test_the_dry_run_names_the_micro_batch_layout_and_prints_only_what_a_field_selects(capsys):
    from bapo_megatron.train import main

    main(["examples/qwen2.5-7b/config.yaml", "--dry-run", "--world-size", "8"])
    out = capsys.readouterr().out
    assert "micro-batches: packed rows of whole samples end to end, attention inside each sample (THD" in out
    assert "at worst (every sample 18432 tokens) 256 a data-parallel rank and optimizer step" in out
    assert "replicated" not in out  # GPU runs use the distributed optimizer: no field selects another
    main(["parallel.packing=padded", "--dry-run"])
    assert "micro-batches: padded rows of one sample each, at most 4096 tokens" in capsys.readouterr().out


def test_bapo_train_with_nothing_shows_its_usage(capsys, monkeypatch):
    from bapo_megatron.train import main

    monkeypatch.setattr("sys.argv", ["bapo-train"])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("usage: bapo-train") and "give a config" in err


def test_the_dry_run_says_dynamic_sampling_may_generate_more(capsys):
    from bapo_megatron.train import main

    main([str(ROOT / "examples" / "tiny_online.yaml"), "rollout.filter_groups.enabled=true", "--dry-run"])
    assert "up to 4 more steps' worth of groups a step (generation up to 5x a step's)" in capsys.readouterr().out


def test_the_longest_response_says_when_the_models_context_not_memory_is_the_limit(tmp_path, capsys):
    """A model of 64 positions with micro-batches of 2048 tokens (examples/tiny_verl.yaml's tiny
    Qwen2): its prompt room alone passes the context, so the figure is the context, held without
    recompute, not "0 tokens (recompute full ...)"; where memory holds not one token, "none"."""
    from bapo_megatron.train import main

    tiny = {**QWEN7B, "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
    tiny.update(num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    argv = [f"model.hf_path={tmp_path}", "parallel.max_tokens_per_microbatch=2048", "rollout.sampling.max_new_tokens=4"]
    main([*argv, "--dry-run"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("longest response"))
    assert line.startswith(
        "longest response this layout fits: the model's context, 64 tokens with its prompt (recompute none), on 80 "
        "GiB GPUs: the context, not memory, is the limit (a micro-batch leaves prompts 2,044 tokens, "
    ), line
    (tmp_path / "config.json").write_text(json.dumps(QWEN7B))
    main([f"model.hf_path={tmp_path}", "parallel.over_memory=true", "--gpu-memory-gib", "8", "--dry-run"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("longest response"))
    assert line.startswith("longest response this layout fits: none, even with the most recompute (full: 28 of"), line


def _slurm_script(folder: Path, config: str, train_nodes: int, nodes: int) -> None:
    """A script of slurm/'s shape: its #SBATCH header, its default CONFIG and its bapo_gpu_job line."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "big.sh").write_text(
        f"#SBATCH --nodes={nodes}\n#SBATCH --gpus-per-node=8\nCONFIG=${{CONFIG:-{config}}}\n"
        f'source "$BAPO_HOME/slurm/common.sh"\nbapo_gpu_job {train_nodes} 4 2 "$@"\n'
    )


def test_the_slurm_script_is_looked_for_beside_the_config_then_under_bapo_home(tmp_path, monkeypatch):
    """Wherever the package is installed: the nearest slurm/ above the config, else $BAPO_HOME's;
    what was searched is said when no script runs the config."""
    from bapo_megatron.cli.slurm import find_slurm_plan

    monkeypatch.delenv("BAPO_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "checkout"
    config = home / "examples" / "big" / "config.yaml"
    _slurm_script(home / "slurm", "examples/big/config.yaml", train_nodes=2, nodes=3)
    plan = find_slurm_plan(config).plan
    assert (plan.name, plan.default, plan.world_size, plan.rollout_nodes) == ("checkout/slurm/big.sh", True, 16, 1)
    assert find_slurm_plan(Path("checkout/examples/big/recipe.yaml")).plan.default is False  # beside: CONFIG=...

    (config.parent / "slurm").mkdir(parents=True)  # a nearer slurm/ that does not run it
    search = find_slurm_plan(config)
    assert search.plan is None
    assert search.none_found() == (
        "no Slurm script in checkout/examples/big/slurm/ runs checkout/examples/big/config.yaml "
        "(as its CONFIG, or one beside it)"
    )
    monkeypatch.setenv("BAPO_HOME", str(home))
    assert find_slurm_plan(config).plan.script == home / "slurm" / "big.sh"

    monkeypatch.delenv("BAPO_HOME")
    elsewhere = find_slurm_plan(tmp_path / "mine.yaml")
    assert elsewhere.plan is None and elsewhere.none_found().startswith(
        "no Slurm script found: no slurm/ folder above mine.yaml and no $BAPO_HOME"
    )
