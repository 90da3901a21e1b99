"""Weight movement: HF <-> Megatron conversion and the live export, against plain copies; and one
weight update with and without LoRA.

    python benchmarks/bench_weights.py --size-gb 2        # CPU; the TP=2 export runs 2 gloo processes
    python benchmarks/bench_weights.py --lora             # the update with and without LoRA only

--lora: the bytes and seconds of one weight update, the whole bf16 model against the rank-16,
all-linear adapters (alpha 32) in bf16 (weights/lora_sync.adapter_update_bytes, the payload
AdapterSync sends), once, to one engine rank. Qwen2.5-7B and Qwen2.5-32B are modelled from their
shapes (examples/*/shape; bytes exact, seconds at --bandwidth-gbs, default 25 GB/s: one 200 Gb/s
InfiniBand HDR link, NCCL or HTTP to engines on other nodes, the engines' own load time not
counted); the tiny models are built and measured: the full export (the adapters merged, as an
engine without LoRA gets it) against the adapters' (weights/export.py parts "model" and
"adapters"), gathered, renamed, cast to bf16 and bucketed on this CPU, no transfer.

Conversion is timed against a plain safetensors read + write of the same bytes on the same
disk, fsync'd as both conversions are (a checkpoint renamed into place must be on disk);
the unsynced copy is printed too, against both conversions run with os.fsync patched out
of this process (a like-for-like row; the converters themselves always sync). Each is run
--repeat times (median), each run starting after os.sync() so that no run is throttled by
the writeback of an earlier one's pages.
The live export (gather, rename, bucket) is timed against a memcpy of the same bytes.
"peak extra GB" is the growth of resident memory during the operation (memory-mapped
input pages count).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from bapo_megatron.models.spec import ModelSpec


def synthetic_spec(size_gb: float) -> ModelSpec:
    """A Llama-like shape with about size_gb of float32 weights: hidden 2048, or, where its
    embeddings and two layers would not fit in size_gb, every width and the vocabulary halved
    until they do (at most 16 times; a 0.02 GB test model is then 20 MB, not 0.7)."""
    for scale in (1, 2, 4, 8, 16):
        d, ffn, vocab, head_dim = 2048 // scale, 5632 // scale, 32000 // scale, 128 // scale
        embeddings = 2 * vocab * d * 4
        per_layer = 4 * (2 * d * d + 2 * d * 4 * head_dim + 3 * d * ffn)  # bytes: q, o, k, v, gate, up, down
        if embeddings + 2 * per_layer <= size_gb * 1e9:
            break
    layers = max(1, round((size_gb * 1e9 - embeddings) / per_layer))
    return ModelSpec(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=d,
        num_layers=layers,
        num_heads=16,
        num_kv_heads=4,
        ffn_hidden_size=ffn,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        qkv_bias=False,
        tie_embeddings=False,
    )


def write_synthetic_hf(spec: ModelSpec, directory: Path) -> int:
    from safetensors.torch import save_file

    from bapo_megatron.common.hf_io import expected_shapes

    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in expected_shapes(spec).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(spec.to_hf_config()))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_with_memory(fn) -> tuple[float, tuple[float, float]]:
    """Seconds, and the peak growth (GB) of this process's resident memory while fn ran (sampled):
    all of it, and its anonymous part (resident minus file-backed pages such as mmapped inputs)."""
    import threading

    import psutil

    process = psutil.Process()

    def now() -> tuple[int, int]:
        info = process.memory_info()
        return info.rss, info.rss - info.shared

    base = now()
    peak = base
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.wait(0.02):
            peak = tuple(map(max, peak, now()))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    seconds = timed(fn)
    done.set()
    thread.join()
    return seconds, ((peak[0] - base[0]) / 1e9, (peak[1] - base[1]) / 1e9)


def _tp_export_worker(rank: int, world: int, spec_dict: dict, out: str) -> None:
    """Live export at TP=world: gather + rename + bucket, against a memcpy of the same bytes."""
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.weights.export import stream_hf_buckets

    activate_cpu_shim()
    spec = ModelSpec(**spec_dict)
    parallel = ParallelConfig(tensor=world)
    info = init_model_parallel(parallel, seed=0)
    model = mc.build_gpt_model(spec, ModelConfig(), parallel, pre_process=True, post_process=True, initialize=False)
    exported = 0

    def export():
        nonlocal exported
        for bucket in stream_hf_buckets([model], spec, info, bucket_bytes=512 << 20):
            exported += sum(t.numel() * t.element_size() for _, t in bucket)

    export()  # warm-up (allocator, gloo buffers)
    exported = 0
    torch.distributed.barrier()
    live = timed(export)
    whole = [torch.empty(exported // 4, dtype=torch.float32)]
    memcpy = timed(lambda: [t.clone() for t in whole])
    if rank == 0:
        Path(out).write_text(json.dumps({"live": live, "memcpy": memcpy, "bytes": exported}))


LORA_RANK, LORA_ALPHA = 16, 32.0
"""The adapters of the update rows: rank 16 on every linear projection (a common LoRA RL setting)."""
MODELLED = ("qwen2.5-7b", "qwen2.5-32b")
"""Shapes modelled from examples/<name>/shape (no weights here)."""
MEASURED = ("qwen2", "qwen3", "qwen3_moe")
"""Tiny models built and exported (models/spec.tiny_spec; the MoE's adapters on attention only)."""


def full_update_bytes(spec: ModelSpec) -> int:
    """The whole model in bf16, as the engines load it (every HF tensor once)."""
    import math

    from bapo_megatron.common.hf_io import expected_shapes

    return sum(math.prod(shape) for shape in expected_shapes(spec).values()) * 2


def modelled_update_rows(bandwidth: float) -> list[tuple]:
    """(model, update, bytes, seconds, how) of the modelled shapes, bandwidth in bytes/s."""
    from bapo_megatron.config.lora import LoRAConfig
    from bapo_megatron.weights.lora_sync import adapter_update_bytes

    lora, rows = LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA), []
    how = f"modelled@{bandwidth / 1e9:g}GB/s"
    for name in MODELLED:
        spec = ModelSpec.from_hf_dir(Path(__file__).resolve().parents[1] / "examples" / name / "shape")
        for update, nbytes in (
            ("full", full_update_bytes(spec)),
            (f"lora-r{LORA_RANK}", adapter_update_bytes(spec, lora)),
        ):
            rows.append((name, update, nbytes, nbytes / bandwidth, how))
    return rows


def measured_update_rows(repeat: int) -> list[tuple]:
    """(model, update, bytes, seconds, how) of the tiny models' live exports on this CPU (median of
    `repeat` after a warm-up), each export's bytes checked against the spec's count."""
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.config.lora import LoRAConfig
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.weights.lora_sync import adapter_update_bytes

    info = init_model_parallel(ParallelConfig(), seed=0)
    lora, rows = LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA), []
    for arch in MEASURED:
        spec, model = tiny_spec(arch), ModelConfig(lora=lora, transformer_impl="local")
        chunk = mc.build_gpt_model(spec, model, ParallelConfig(), pre_process=True, post_process=True)
        for part, want in (("model", full_update_bytes(spec)), ("adapters", adapter_update_bytes(spec, lora))):
            export = partial(_exported_bytes, chunk, spec, info, part)
            sent = export()  # and a warm-up
            seconds = statistics.median(timed(export) for _ in range(repeat))
            assert sent == want, (arch, part, sent, want)
            rows.append(
                (f"tiny-{arch}", "full" if part == "model" else f"lora-r{LORA_RANK}", sent, seconds, "measured")
            )
    return rows


def _exported_bytes(chunk, spec: ModelSpec, info, part: str) -> int:
    """The bytes of one live export of `part` of `chunk` in bf16 (every bucket made, none sent)."""
    from bapo_megatron.weights.export import stream_hf_buckets

    buckets = stream_hf_buckets([chunk], spec, info, dtype=torch.bfloat16, part=part)
    return sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)


def lora_update_table(bandwidth: float, repeat: int) -> None:
    """The update rows, each LoRA row beside its model's full update."""
    from bapo_megatron.weights.convert import _megatron_world_of_one

    _megatron_world_of_one()
    rows = modelled_update_rows(bandwidth) + measured_update_rows(repeat)
    print(
        f"one weight update, whole bf16 model vs LoRA rank {LORA_RANK} all-linear adapters (bf16), one copy; "
        f"modelled: {bandwidth / 1e9:g} GB/s link, engine load time not counted; measured: export on this CPU, "
        "no transfer"
    )
    header = f"{'model':<16} {'update':<9} {'bytes':>15} {'MB':>10} {'seconds':>10} {'of full':>9}  how"
    print(header)
    print("-" * len(header))
    full = {}
    for model, update, nbytes, seconds, how in rows:
        full.setdefault(model, nbytes)
        share = f"{nbytes / full[model]:.4f}"
        print(f"{model:<16} {update:<9} {nbytes:>15} {nbytes / 1e6:>10.3f} {seconds:>10.6f} {share:>9}  {how}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each copy and conversion (median reported)")
    parser.add_argument("--lora", action="store_true", help="only the weight update with and without LoRA")
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0, help="--lora's modelled link, GB/s")
    args = parser.parse_args()
    if args.lora:
        lora_update_table(args.bandwidth_gbs * 1e9, args.repeat)
    else:
        conversion_table(args)


def conversion_table(args: argparse.Namespace) -> None:
    """The conversions and live exports of a synthetic model of --size-gb, against plain copies."""
    from bapo_megatron.common.hf_io import hf_entries
    from bapo_megatron.trainer.parallel import init_model_parallel  # noqa: F401 (imported before timing)

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_weights_"))
    spec = synthetic_spec(args.size_gb)
    nbytes = write_synthetic_hf(spec, root / "hf")
    gb = nbytes / 1e9
    rows = _conversion_rows(root, args.repeat)
    layer_gb = sum(e.nbytes for e in hf_entries(spec, torch.float32) if e.name.startswith("model.layers.0.")) / 1e9
    rows += _live_export_rows(spec, root, nbytes)
    import dataclasses

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.dist.launch import run_workers

    run_workers(_tp_export_worker, 2, dataclasses.asdict(spec), str(root / "tp2.json"))
    tp2 = json.loads((root / "tp2.json").read_text())
    print(
        f"synthetic model: {spec.num_layers} layers, {gb:.2f} GB float32 (one layer {layer_gb:.3f} GB); "
        f"scratch {root}; {torch.get_num_threads()} threads"
    )
    _print_conversions(rows, gb, tp2)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


def _conversion_rows(root: Path, repeat: int) -> list[tuple]:
    """(label, seconds, baseline seconds, memory growth) of the plain copies and the conversions."""
    from safetensors.torch import load_file, save_file

    from bapo_megatron.weights.convert import _megatron_world_of_one, hf_to_mcore, mcore_to_hf

    def plain_copy():
        save_file(load_file(str(root / "hf" / "model.safetensors")), str(root / "plain.safetensors"))

    def plain_copy_durable():
        plain_copy()
        with open(root / "plain.safetensors", "rb+") as f:
            os.fsync(f.fileno())

    def repeated(fn, output: Path) -> tuple[float, float]:
        """Median seconds and largest memory growth over `repeat` runs, each starting with no output
        and no dirty pages left by the runs before (os.sync), so none pays for another's writeback."""
        runs = []
        for _ in range(repeat):
            shutil.rmtree(output, ignore_errors=True) if output.is_dir() else output.unlink(missing_ok=True)
            os.sync()
            runs.append(timed_with_memory(fn))
        return statistics.median(s for s, _ in runs), tuple(max(c) for c in zip(*(m for _, m in runs), strict=True))

    plain, plain_mem = repeated(plain_copy, root / "plain.safetensors")
    durable, _ = repeated(plain_copy_durable, root / "plain.safetensors")
    _megatron_world_of_one()
    to_mcore, to_mcore_mem = repeated(lambda: hf_to_mcore(root / "hf", root / "mcore", progress=False), root / "mcore")
    to_hf, to_hf_mem = repeated(
        lambda: mcore_to_hf(root / "mcore", root / "hf-back", dtype="float32", progress=False), root / "hf-back"
    )
    # The same conversions with os.fsync made a no-op in this process (both writers sync through it),
    # for a like-for-like comparison with the unsynced copy; the product itself always syncs.
    fsync, os.fsync = os.fsync, lambda fd: None
    try:
        to_mcore_ns, _ = repeated(
            lambda: hf_to_mcore(root / "hf", root / "mcore-ns", progress=False), root / "mcore-ns"
        )
        to_hf_ns, _ = repeated(
            lambda: mcore_to_hf(root / "mcore", root / "hf-back", dtype="float32", progress=False), root / "hf-back"
        )
    finally:
        os.fsync = fsync
    return [
        ("safetensors read+write", plain, None, plain_mem),
        ("safetensors read+write, fsync'd", durable, None, None),
        ("hf-to-mcore (fsync'd)", to_mcore, durable, to_mcore_mem),
        ("mcore-to-hf (streamed, fsync'd)", to_hf, durable, to_hf_mem),
        ("hf-to-mcore, fsync skipped", to_mcore_ns, plain, None),
        ("mcore-to-hf, fsync skipped", to_hf_ns, plain, None),
    ]


def _live_export_rows(spec: ModelSpec, root: Path, nbytes: int) -> list[tuple]:
    """The live export at TP=1 (as it is, and cast to bf16) against a memcpy of the weights, the
    model loaded from root/mcore; its bytes checked against the HF file's `nbytes`."""
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.dist_ckpt import load_model
    from bapo_megatron.trainer.parallel import init_model_parallel as init_mp
    from bapo_megatron.weights.export import stream_hf_buckets

    info = init_mp(ParallelConfig(), seed=0)
    model = mc.build_gpt_model(
        spec, ModelConfig(), ParallelConfig(), pre_process=True, post_process=True, initialize=False
    )
    load_model([model], root / "mcore")
    params = [p.detach() for p in model.parameters()]
    memcpy = timed(lambda: [p.clone() for p in params])
    exported = 0

    def export():
        nonlocal exported
        for bucket in stream_hf_buckets([model], spec, info, bucket_bytes=512 << 20):
            exported += sum(t.numel() * t.element_size() for _, t in bucket)

    live = timed(export)

    def export_bf16():
        for _bucket in stream_hf_buckets([model], spec, info, bucket_bytes=512 << 20, dtype=torch.bfloat16):
            pass

    live_bf16 = timed(export_bf16)
    assert exported == nbytes, (exported, nbytes)
    return [
        ("memcpy of the weights", memcpy, None, None),
        ("live export, TP=1 (views)", live, memcpy, None),
        ("live export, TP=1, to bf16", live_bf16, memcpy, None),
    ]


def _print_conversions(rows: list[tuple], gb: float, tp2: dict) -> None:
    header = (
        f"{'operation':<34} {'seconds':>8} {'GB/s':>7} {'vs baseline':>12} {'peak extra GB':>14} {'of it anon':>11}"
    )
    print(header)
    print("-" * len(header))
    for label, seconds, base, mem in rows:
        ratio = f"{base / seconds:>11.2f}x" if base else f"{'(baseline)':>12}"
        extra = f"{mem[0]:>14.2f} {mem[1]:>11.2f}" if mem is not None else ""
        print(f"{label:<34} {seconds:>8.2f} {gb / seconds:>7.2f} {ratio} {extra}")
    tp_gb = tp2["bytes"] / 1e9
    print(
        f"{'memcpy, per TP rank (whole model)':<34} {tp2['memcpy']:>8.2f} {tp_gb / tp2['memcpy']:>7.2f} "
        f"{'(baseline)':>12}"
    )
    print(
        f"{'live export, TP=2 (gloo gather)':<34} {tp2['live']:>8.2f} {tp_gb / tp2['live']:>7.2f} "
        f"{tp2['memcpy'] / tp2['live']:>11.2f}x"
    )


if __name__ == "__main__":
    main()
