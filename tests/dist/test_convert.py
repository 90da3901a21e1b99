"""tools/convert_checkpoint.py end to end, and the converted checkpoint at every TP x PP layout.

Random HF models (every weight randomised, norms included) go HF -> Megatron -> HF: the
result is bitwise the original, loads in transformers, keeps the tokenizer files. The
Megatron checkpoint, loaded by the trainer at TP, PP in {1, 2}, gives transformers'
log-probs through the pipeline schedule. Qwen3 and Qwen3-MoE round-trip bitwise too, the experts
one tensor each.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import CASES, make_hf_model

pytestmark = pytest.mark.slow  # the longest of the tier: `make test-fast` leaves it out

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _convert_all(rank: int, world: int, root: str, jobs: tuple[tuple, ...]) -> None:
    """Every case both ways, then `jobs` (_layouts_logprobs') on the converted checkpoints."""
    import convert_checkpoint as cli

    for name in CASES:
        root_dir = Path(root) / name
        assert cli.main(["hf-to-mcore", "--hf", str(root_dir), "--out", f"{root_dir}-mcore"]) == 0
        assert cli.main(["verify", "--hf", str(root_dir), "--mcore", f"{root_dir}-mcore"]) == 0
        # no --dtype: the model's own (float32), so the round trip is lossless by default
        back = ["mcore-to-hf", "--mcore", f"{root_dir}-mcore", "--out", f"{root_dir}-back", "--hf-template"]
        assert cli.main([*back, str(root_dir)]) == 0
    _layouts_logprobs(rank, world, root, jobs)


def _save_both_ways(rank: int, world: int, root: str, name: str) -> None:
    """HF checkpoint `name` converted by hf-to-mcore, and saved by Megatron's own writer from a
    model built with its weights."""
    import convert_checkpoint as cli

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.weights.convert import _megatron_world_of_one, _model
    from bapo_megatron.weights.layout import hf_to_megatron

    root = Path(root)
    for dtype, suffix in (("float32", ""), ("bfloat16", "-bf16")):
        assert (
            cli.main(
                [
                    "hf-to-mcore",
                    "--hf",
                    str(root / name),
                    "--out",
                    str(root / f"{name}-mcore{suffix}"),
                    "--dtype",
                    dtype,
                    "--no-progress",
                ]
            )
            == 0
        )
    hf = HFCheckpoint(root / name)
    _megatron_world_of_one()
    model = _model(hf.spec)
    padded = mc.padded_vocab(hf.spec, ModelConfig(), ParallelConfig())
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.spec, hf, padded), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    save_model([model], root / f"{name}-megatron-writer")


def _layouts_logprobs(rank: int, world: int, root: str, jobs: tuple[tuple, ...]) -> None:
    """_layout_logprobs of each (name, tp, pp, source, vpp) in `jobs` in turn, Megatron's groups made
    anew for each: the layouts of one world size share a launch."""
    from bapo_megatron.trainer.parallel import destroy_model_parallel

    for name, tp, pp, source, vpp in jobs:
        destroy_model_parallel()
        _layout_logprobs(root, name, tp, pp, source, vpp)


def _layout_logprobs(root: str, name: str, tp: int, pp: int, source: str, vpp: int | None) -> None:
    from bapo_megatron.common.batch import RolloutBatch, Sample
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer

    activate_cpu_shim()
    root = Path(root)
    spec = ModelSpec.from_hf_dir(root / name)
    cfg = load_config(
        None,
        [
            f"parallel.tensor={tp}",
            f"parallel.pipeline={pp}",
            f"parallel.virtual_pipeline={vpp}" if vpp else "parallel.virtual_pipeline=null",
            # interleaved stages need the micro-batches in multiples of PP: one sample each
            "parallel.max_tokens_per_microbatch=14" if vpp else "parallel.max_tokens_per_microbatch=24",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
        ],
    )
    trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    if source == "hf":
        load_hf_into_trainer(trainer, root / name)  # straight from safetensors, each rank its own slices
    else:
        trainer.load_weights(root / f"{name}-mcore")
    tokens = json.loads((root / "tokens.json").read_text())
    batch = RolloutBatch(
        samples=[
            Sample(
                prompt_ids=t[:3],
                response_ids=t[3:],
                behaviour_logprobs=[0.0] * (len(t) - 3),
                versions=[0] * (len(t) - 3),
                reward=float(i),
                group=i // 2,
            )
            for i, t in enumerate(tokens)
        ]
    )
    mbs, _ = trainer.microbatches(batch)

    def collect(mb, logits):
        logp, _ = trainer._logprobs(mb, logits, batch.temperature)
        return logits.new_zeros(()), torch.tensor(mb.num_tokens, dtype=torch.int), (mb.sample_index, logp, mb.loss_mask)

    with torch.no_grad():
        outputs = trainer._run(mbs, collect, forward_only=True)
    if trainer.info.is_last_stage and trainer.info.tp_rank == 0:
        rows = {}
        for index, logp, mask in outputs:
            for row, i in enumerate(index):
                rows[i] = logp[row][mask[row] != 0].tolist()
        (root / f"logp-{name}-tp{tp}pp{pp}vpp{vpp}-{source}.json").write_text(json.dumps(rows))


def test_convert_round_trip_and_every_layout(tmp_path):
    import transformers

    models = {name: make_hf_model(tmp_path, name) for name in CASES}
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(250, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    name = "qwen2-gqa2"
    worlds: dict[int, list[tuple]] = {}
    for tp, pp in LAYOUTS:
        worlds.setdefault(tp * pp, []).append((name, tp, pp, "mcore", None))
    run_workers(_convert_all, 1, str(tmp_path), tuple(worlds.pop(1)))  # TP=PP=1 in the converting process
    for world, jobs in worlds.items():
        run_workers(_layouts_logprobs, world, str(tmp_path), tuple(jobs))
    for name, original in models.items():
        back = tmp_path / f"{name}-back"
        assert (back / "tokenizer.json").is_file()
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
        theirs = original.state_dict()
        for key, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, theirs[key]), (name, key)
        assert not list(tmp_path.glob(f".{name}-back.*.tmp"))  # no temporary left behind

    name = "qwen2-gqa2"
    with torch.no_grad():
        want = {
            i: torch.log_softmax(models[name](torch.tensor([t])).logits[0, 2:-1], -1)
            .gather(1, torch.tensor(t[3:]).unsqueeze(1))
            .squeeze(1)
            for i, t in enumerate(tokens)
        }
    for tp, pp in LAYOUTS:
        got = json.loads((tmp_path / f"logp-{name}-tp{tp}pp{pp}vpp{None}-mcore.json").read_text())
        for i, expected in want.items():
            torch.testing.assert_close(torch.tensor(got[str(i)]), expected, rtol=1e-4, atol=1e-5)


def test_hf_weights_load_straight_into_every_layout(tmp_path):
    """model.hf_path's weights, loaded by each rank into its own slices at TP x PP (and interleaved
    virtual stages), give transformers' log-probs; a tied embedding's last-stage copy included."""
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(250, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    cases = {"qwen2-gqa2": [(2, 2, None), (1, 2, 2)], "llama-gqa4-tied": [(1, 2, None)]}
    models = {name: make_hf_model(tmp_path, name) for name in cases}
    worlds: dict[int, list[tuple]] = {}
    for name, layouts in cases.items():
        for tp, pp, vpp in layouts:
            worlds.setdefault(tp * pp, []).append((name, tp, pp, "hf", vpp))
    for world, jobs in worlds.items():  # the layouts of one world size in one launch
        run_workers(_layouts_logprobs, world, str(tmp_path), tuple(jobs))
    for name, layouts in cases.items():
        model = models[name]
        with torch.no_grad():
            want = {
                i: torch.log_softmax(model(torch.tensor([t])).logits[0, 2:-1], -1)
                .gather(1, torch.tensor(t[3:]).unsqueeze(1))
                .squeeze(1)
                for i, t in enumerate(tokens)
            }
        for tp, pp, vpp in layouts:
            got = json.loads((tmp_path / f"logp-{name}-tp{tp}pp{pp}vpp{vpp}-hf.json").read_text())
            for i, expected in want.items():
                torch.testing.assert_close(torch.tensor(got[str(i)]), expected, rtol=1e-4, atol=1e-5)


def test_streamed_checkpoint_is_what_megatrons_writer_writes(tmp_path):
    """hf-to-mcore writes without a model, one tensor at a time; its checkpoint must be the one
    Megatron's torch_dist writer makes from a model holding the same weights: same keys, shapes,
    dtypes and chunks in the DCP metadata, same common state and config, same tensors. With
    --dtype bfloat16: the same tensors, rounded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    for name in ("qwen2-gqa2", "llama-gqa4-tied"):
        make_hf_model(tmp_path, name)
        run_workers(_save_both_ways, 1, str(tmp_path), name)
        ours, theirs = tmp_path / f"{name}-mcore", tmp_path / f"{name}-megatron-writer"
        assert (ours / "metadata.json").read_text() == (theirs / "metadata.json").read_text()
        assert torch.load(ours / "common.pt") == torch.load(theirs / "common.pt")
        meta = {d: FileSystemReader(str(d)).read_metadata().state_dict_metadata for d in (ours, theirs)}
        assert set(meta[ours]) == set(meta[theirs])
        for key, m in meta[theirs].items():
            o = meta[ours][key]
            assert type(o) is type(m), key
            if hasattr(m, "size"):
                assert (o.size, o.properties) == (m.size, m.properties), key
                assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in o.chunks) == sorted(
                    (tuple(c.offsets), tuple(c.sizes)) for c in m.chunks
                ), key
        tensors = {
            d: {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta[d].items() if hasattr(m, "size")}
            for d in (ours, theirs)
        }
        for d, state in tensors.items():
            dcp.load(state, storage_reader=FileSystemReader(str(d)), no_dist=True)
        for key, tensor in tensors[theirs].items():
            assert torch.equal(tensors[ours][key], tensor), (name, key)
        bf16 = tmp_path / f"{name}-mcore-bf16"
        meta = FileSystemReader(str(bf16)).read_metadata().state_dict_metadata
        rounded = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if hasattr(m, "size")}
        assert set(rounded) == set(tensors[ours])
        dcp.load(rounded, storage_reader=FileSystemReader(str(bf16)), no_dist=True)
        for key, tensor in tensors[ours].items():
            assert torch.equal(rounded[key], tensor.to(torch.bfloat16)), (name, key)


def _fail_midway(rank: int, world: int, root: str) -> None:
    """hf-to-mcore whose disk fills after two tensors: nothing is left behind, the earlier
    checkpoint beside it is untouched."""
    import contextlib
    import io

    import convert_checkpoint as cli
    import pytest

    import bapo_megatron.weights.convert as convert

    root = Path(root)
    original = convert.streaming_save_strategy

    def failing(make, dtype, on_tensor=None, *, spec):
        written = []

        def count(nbytes):
            written.append(nbytes)
            if len(written) == 2:
                raise OSError(28, "No space left on device")

        return original(make, dtype, count, spec=spec)

    convert.streaming_save_strategy = failing
    try:
        with pytest.raises(OSError, match="no space left writing checkpoint .*ckpt-2; nothing of it was kept"):
            convert.hf_to_mcore(root / "qwen2-gqa2", root / "ckpt-2", progress=False)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):  # the CLI: an error line and exit 2, not a traceback
            assert (
                cli.main(
                    ["hf-to-mcore", "--hf", str(root / "qwen2-gqa2"), "--out", str(root / "ckpt-2"), "--no-progress"]
                )
                == 2
            )
        assert err.getvalue() == f"error: no space left writing checkpoint {root / 'ckpt-2'}; nothing of it was kept\n"
    finally:
        convert.streaming_save_strategy = original
    assert not (root / "ckpt-2").exists() and not list(root.glob(".ckpt-2.*.tmp"))


def _streaming_save_on_two_ranks(rank: int, world: int, root: str) -> None:
    import pytest
    from megatron.core.dist_checkpointing import ShardedTensor

    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.dist_ckpt import save_sharded
    from bapo_megatron.weights.mcore_io import streaming_save_strategy

    sharded = {"w": ShardedTensor.from_rank_offsets("w", torch.full((2, 3), float(rank)), (0, rank, world))}
    with pytest.raises(RuntimeError, match="one process"):
        strategy = streaming_save_strategy(lambda t: t.data, torch.float32, spec=tiny_spec())
        save_sharded(sharded, Path(root) / "two-ranks", strategy)
    torch.distributed.barrier()
    assert not (Path(root) / "two-ranks").exists() and not list(Path(root).glob(".two-ranks.*.tmp"))


def test_a_failed_conversion_leaves_nothing_and_the_streaming_writer_refuses_two_ranks(tmp_path):
    make_hf_model(tmp_path, "qwen2-gqa2")
    before = tmp_path / "ckpt-1"
    before.mkdir()
    (before / "metadata.json").write_text("{}")
    run_workers(_fail_midway, 1, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1", "qwen2-gqa2"]
    assert (before / "metadata.json").read_text() == "{}"
    run_workers(_streaming_save_on_two_ranks, 2, str(tmp_path))


FAMILIES = {"qwen3": ("qwen3", 2, False), "qwen3-moe": ("qwen3_moe", 2, False)}
"""Qwen3 (q/k norms; layers stacked in the checkpoint) and Qwen3-MoE (router and 4 experts in layers
1-3, a dense layer 0; one key per layer)."""


def _convert_families(rank: int, world: int, root: str) -> None:
    import convert_checkpoint as cli

    root = Path(root)
    for name, (arch, *_) in FAMILIES.items():
        hf, mcore = ["--hf", str(root / name)], ["--mcore", str(root / f"{name}-mcore")]
        ep = ["--ep", "2"] if arch == "qwen3_moe" else []  # checked against the 4 experts; the checkpoint has no EP
        assert cli.main(["hf-to-mcore", *hf, "--out", mcore[1], *ep, "--no-progress"]) == 0
        assert cli.main(["verify", *hf, *mcore]) == 0
        back = ["--out", str(root / f"{name}-back"), "--no-progress"]  # the checkpoint carries config and tokenizer
        assert cli.main(["mcore-to-hf", *mcore, *back]) == 0


def test_qwen3_and_moe_round_trip(tmp_path, capsys):
    """HF -> Megatron -> HF is bitwise for both families, the experts written one tensor each under the
    names the source has on disk, with the source's config and tokenizer and no --hf-template;
    transformers loads the result with the source's logits. Qwen3 also
    pre-splits for SGLang (its q/k norms whole on every rank); a MoE model's pre-split is refused."""
    import reshard
    import transformers
    from safetensors.torch import load_file

    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.weights.sglang_shards import merge_ranks

    models = {name: make_hf_model(tmp_path, name, case) for name, case in FAMILIES.items()}
    run_workers(_convert_families, 1, str(tmp_path))
    ids = torch.randint(250, (2, 19), generator=torch.Generator().manual_seed(3))
    for name, original in models.items():
        back = tmp_path / f"{name}-back"
        assert (back / "tokenizer.json").read_bytes() == (tmp_path / name / "tokenizer.json").read_bytes()
        source_config = json.loads((tmp_path / name / "config.json").read_text())
        assert json.loads((back / "config.json").read_text()) == {**source_config, "torch_dtype": "float32"}
        written = set(load_file(str(back / "model.safetensors")))
        assert written == set(json.loads((tmp_path / name / "model.safetensors.index.json").read_text())["weight_map"])
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
        theirs = original.state_dict()
        assert set(reloaded.state_dict()) == set(theirs)
        for key, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, theirs[key]), (name, key)
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, original(ids).logits), name
    assert (
        "model.layers.3.mlp.experts.3.down_proj.weight" in written and "model.layers.0.mlp.gate_proj.weight" in written
    )

    presplit = ["--hf-template", str(tmp_path / "qwen3"), "--sglang-tp", "2", "--no-progress"]
    assert reshard.main(["--mcore", str(tmp_path / "qwen3-mcore"), "--out", str(tmp_path / "sglang"), *presplit]) == 0
    ranks = [load_file(str(tmp_path / "sglang" / f"model-rank-{rank}-part-0.safetensors")) for rank in range(2)]
    merged, theirs = merge_ranks(ModelSpec.from_hf_dir(tmp_path / "qwen3"), ranks), models["qwen3"].state_dict()
    assert set(merged) == set(theirs) and all(torch.equal(merged[k], theirs[k]) for k in theirs)
    moe = ["--mcore", str(tmp_path / "qwen3-moe-mcore"), "--out", str(tmp_path / "sglang-moe"), "--sglang-tp", "2"]
    assert reshard.main([*moe, "--no-progress"]) == 2
    assert "pre-split layout of a mixture-of-experts model (its fused experts) is not mapped" in capsys.readouterr().err
    assert not (tmp_path / "sglang-moe").exists()
    # the converter's checkpoint (its vocabulary of 250 padded to 256 rows) exports as the model it records:
    # a template's other vocabulary (it was cut or padded) or top-k (top-3 routing on a top-2 model) is refused
    source_config = json.loads((tmp_path / "qwen3-moe" / "config.json").read_text())
    for key, value in (("vocab_size", 251), ("vocab_size", 1000), ("num_experts_per_tok", 3)):
        template = tmp_path / f"template-{key}-{value}"
        template.mkdir()
        (template / "config.json").write_text(json.dumps({**source_config, key: value}))
        wrong = ["--mcore", str(tmp_path / "qwen3-moe-mcore"), "--out", str(tmp_path / "wrong")]
        assert reshard.main([*wrong, "--hf-template", str(template), "--no-progress"]) == 2
        assert f"{key}={value}, but the checkpoint's hf_config.json says" in capsys.readouterr().err
        assert not (tmp_path / "wrong").exists()
