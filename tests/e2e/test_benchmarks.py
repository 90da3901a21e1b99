"""Every benchmark script runs and prints its table (small arguments, CPU): the GPU figures of
bench_train_step and the rollout comparison come from these same scripts, so they must not rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _table(script: str, *args: str) -> list[list[str]]:
    """Run benchmarks/SCRIPT; the rows under its dashed rule, split on runs of spaces."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    rows = [
        line.split()
        for line in lines[rule + 1 :]
        if line.strip()
        and not line.startswith(("vs ", "fp8 ", "---", "mode ", "CPU: ", "MODELLED GPU", "ideal ", "load "))
    ]
    assert rows, done.stdout
    assert "nan" not in done.stdout.lower(), done.stdout
    return rows


def test_bapo_search_benchmark():
    rows = _table("bench_bapo_search.py", "--tokens", "1e4", "3e4", "--repeats", "1")
    assert [r[0] for r in rows] == ["1e+04", "3e+04"] and all(r[4].endswith("x") for r in rows)


def test_train_step_benchmark():
    rows = _table(
        "bench_train_step.py", "--shape", "tiny", "--precision", "fp32", "--seq", "32", "--prompts", "2", "--steps", "1"
    )
    ((spec, precision, recipe, tokens, seconds, spread, per_s, tflops, mfu, memory, estimate),) = rows
    assert float(tflops) >= 0 and float(memory) > 0 and float(estimate) > 0
    assert (spec, precision, recipe) == ("local", "fp32", "-")
    assert int(tokens) == 2 * 4 * 32 and float(seconds) > 0 and float(per_s) > 0
    low, high = map(float, spread.split("-"))
    assert low <= float(seconds) <= high
    assert mfu == "-"  # no peak figure for a CPU


def test_export_benchmark():
    """The live export against plain copies of the same bytes (the GPU figure comes from here)."""
    rows = _table("bench_export.py", "--shape", "tiny", "--repeat", "2")
    assert [" ".join(r[:-4]) for r in rows] == ["copy, one buffer", "copy, per tensor", "live export"]
    assert all(float(r[-2]) > 0 and r[-1].endswith("x") for r in rows)


def test_logprob_benchmark():
    """Op by op against the compiled kernels (compiled for the CPU here)."""
    rows = _table("bench_logprobs.py", "--tokens", "64", "--vocab", "512", "--dtype", "float32", "--repeat", "2")
    assert [" ".join(r[:-3]) for r in rows] == ["op by op", "fused (torch.compile)"]
    assert all(float(r[-3]) > 0 for r in rows)


def test_rollout_benchmark():
    """Both engines, each in a table of its own under its label: full-length first, then partial."""
    rows = _table(
        "bench_rollout.py",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--max-new",
        "24",
        "--budget",
        "8",
        "--oversample",
        "2",
        "3",
        "--engine",
        "both",
    )
    tables = [rows[i : i + 3] for i, r in enumerate(rows) if r[0] == "full-length"]
    assert len(tables) == 2, rows
    for full, *partial in tables:  # one repeat: median (min-max) of one value
        assert full[4] == "1.00x(1.00x-1.00x)" and float(full[2]) > 0
        assert [r[:3] for r in partial] == [["partial,", "oversample", "2"], ["partial,", "oversample", "3"]]
        assert all(float(r[5].split("(")[0]) > 0 and r[6].split("(")[0].endswith("x") for r in partial)


def test_loop_benchmark(tmp_path):
    """The real bapo-train loop against the modelled engine over HTTP, sync and async: per mode the
    trained tokens/s, each phase's seconds and the two waiting shares; the JSON holds the same."""
    import json

    rows = _table(
        "bench_loop.py",
        *("--engine", "modelled", "--modes", "sync", "async", "--steps", "3", "--warmup", "1", "--repeats", "1"),
        *("--prompts", "2", "--samples", "2", "--max-new", "16", "--json", str(tmp_path / "loop.json")),
    )
    assert [r[0] for r in rows] == ["sync", "async"]
    for row in rows:
        assert len(row) == 10 and row[1] == "2", row  # mode, steps, tok/s, vs sync, 4 phases, 2 shares
        step, wait, train, sync, trainer_waits, engines_wait = (float(c.split("(")[0]) for c in row[4:])
        assert step > 0 and wait >= 0 and train > 0 and sync > 0
        assert 0 <= trainer_waits < 1 and 0 <= engines_wait <= 1
    figures = json.loads((tmp_path / "loop.json").read_text())
    assert figures["sync"]["vs_sync"] == 1.0 and figures["async"]["tokens_per_s"] > 0
    assert figures["ideal_speedup"] >= 1 and figures["async_of_ideal"] > 0


def test_weights_benchmark(tmp_path):
    rows = _table("bench_weights.py", "--size-gb", "0.02", "--repeat", "1", "--dir", str(tmp_path))
    names = [" ".join(r) for r in rows]
    assert any(n.startswith("hf-to-mcore") for n in names) and any(n.startswith("live export, TP=2") for n in names)


def test_weights_benchmark_with_and_without_lora():
    """One weight update: the whole bf16 model against the rank-16 all-linear adapters, the 7B and 32B
    shapes modelled (bytes by hand here, seconds at the stated 25 GB/s), the tiny models measured (the
    script checks each export's bytes against the spec)."""
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.memory.estimate import stage_params

    rows = _table("bench_weights.py", "--lora", "--repeat", "1")
    models = ["qwen2.5-7b", "qwen2.5-32b", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3_moe"]
    assert [(r[0], r[1]) for r in rows] == [(m, u) for m in models for u in ("full", "lora-r16")]
    for name, (full, lora) in zip(models, zip(rows[::2], rows[1::2], strict=True), strict=True):
        assert 0 < int(lora[2]) < int(full[2]) and float(lora[4]) < float(full[4]), (full, lora)
        if name.startswith("tiny-"):
            assert full[6] == lora[6] == "measured" and float(lora[4]) > 0
            continue
        spec = ModelSpec.from_hf_dir(ROOT / "examples" / name / "shape")
        d, kv, ffn = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.ffn_hidden_size
        q_o, k_v, mlp = 2 * (d + spec.num_heads * spec.head_dim), 2 * (d + kv), 3 * (d + ffn)
        assert int(full[2]) == 2 * stage_params(spec, spec.vocab_size, 1, 1, 0)  # every parameter in bf16
        assert int(lora[2]) == 2 * 16 * (q_o + k_v + mlp) * spec.num_layers  # r x (in + out), 7 projections
        assert full[6] == "modelled@25GB/s" and float(full[4]) == pytest.approx(int(full[2]) / 25e9, rel=1e-5)


def test_data_benchmark(tmp_path):
    """Start-up to the first batch for verl-layout data, parquet and jsonl (the 1M-record figure
    comes from here)."""
    rows = _table("bench_data.py", "--records", "2000", "--repeat", "1", "--batch", "64", "--dir", str(tmp_path))
    assert [(r[0], r[1]) for r in rows] == [("2000", "parquet"), ("2000", "jsonl")]
    for _, fmt, start, _, cold, rss, start_mb, file_mb, _, anon, _ in rows:
        assert float(anon) < float(rss)  # private memory is part of the resident size
        assert float(start) > 0 and float(rss) >= float(start_mb) > 0 and float(file_mb) > 0
        assert (cold == "-") == (fmt == "jsonl")


def test_memory_benchmark():
    """The memory estimate against a measured CPU step, the dense model with and without full
    recompute (the table of benchmarks/RESULTS.md comes from this script)."""
    rows = _table("bench_memory.py", "--quick", "--seq", "128")
    assert [r[:5] for r in rows] == [["dense", "TP1", "none", "128", "0"], ["dense", "TP1", "full", "128", "0"]]
    for row in rows:  # model, layout, recompute, seq, stage; est, meas of params, grads, optimizer; ...
        assert row[5] == row[6] and row[7] == row[8] and row[9] == row[10] and float(row[5]) > 0, row
        assert 0.8 <= float(row[13]) <= 1.2 and 0.8 <= float(row[16]) <= 1.2, row  # activations, peak
    assert float(rows[1][12]) < float(rows[0][12])  # full recompute: fewer measured activations


def test_packing_benchmark():
    """Packed rows keep at least 95% of the computed tokens real on every distribution and layout,
    the virtual pipeline's too (where padding to one shape keeps under 20%)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_packing.py"), "--seeds", "1"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines()[2:]]
    assert len(rows) == 15, done.stdout
    for _, layout, _, padded, packed, _ in rows:
        assert float(packed.split()[0]) >= 0.95, (layout, packed)
        if "VPP" in layout:
            assert float(padded.split()[0]) < 0.2, (layout, padded)
