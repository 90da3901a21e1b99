"""Weight movement: HF <-> Megatron conversion and the live export, against plain copies.

    python benchmarks/bench_weights.py --size-gb 2        # CPU, one process

Conversion is timed against a plain safetensors read + write of the same bytes on the same
disk; the live export (gather, rename, bucket) against a memcpy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bapo_megatron.trainer.model_spec import ModelSpec


def synthetic_spec(size_gb: float) -> ModelSpec:
    """A Llama-like shape with about size_gb of float32 weights."""
    d, ffn, vocab = 2048, 5632, 32000
    per_layer = 4 * (2 * d * d + 2 * d * 512 + 3 * d * ffn)  # bytes: q, o, k, v, gate, up, down
    layers = max(1, round((size_gb * 1e9 - 2 * vocab * d * 4) / per_layer))
    return ModelSpec(architecture="llama", vocab_size=vocab, hidden_size=d, num_layers=layers, num_heads=16,
                     num_kv_heads=4, ffn_hidden_size=ffn, head_dim=128, max_position_embeddings=4096,
                     rope_theta=500000.0, rms_norm_eps=1e-5, qkv_bias=False, tie_embeddings=False)


def write_synthetic_hf(spec: ModelSpec, directory: Path) -> int:
    from safetensors.torch import save_file

    from bapo_megatron.weights.hf_io import expected_shapes

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    from safetensors.torch import load_file, save_file

    from bapo_megatron.trainer.parallel import init_model_parallel  # noqa: F401 (imported before timing)
    from bapo_megatron.weights.convert import _megatron_world_of_one, hf_to_mcore, mcore_to_hf

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_weights_"))
    spec = synthetic_spec(args.size_gb)
    nbytes = write_synthetic_hf(spec, root / "hf")
    gb = nbytes / 1e9

    def plain_copy():
        save_file(load_file(str(root / "hf" / "model.safetensors")), str(root / "plain.safetensors"))

    plain = timed(plain_copy)
    _megatron_world_of_one()
    to_mcore = timed(lambda: hf_to_mcore(root / "hf", root / "mcore"))
    to_hf = timed(lambda: mcore_to_hf(root / "mcore", root / "hf-back", dtype="float32"))

    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.checkpoint import load_model
    from bapo_megatron.trainer.parallel import init_model_parallel as init_mp
    from bapo_megatron.weights.export import stream_hf_buckets

    info = init_mp(ParallelConfig(), seed=0)
    model = mc.build_gpt_model(spec, ModelConfig(), ParallelConfig(), pre_process=True, post_process=True,
                               initialize=False)
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
    print(f"synthetic model: {spec.num_layers} layers, {gb:.2f} GB float32; scratch {root}; "
          f"{torch.get_num_threads()} threads")
    header = f"{'operation':<28} {'seconds':>8} {'GB/s':>7} {'vs baseline':>12}"
    print(header)
    print("-" * len(header))
    rows = [("safetensors read+write", plain, None), ("hf-to-mcore", to_mcore, plain), ("mcore-to-hf", to_hf, plain),
            ("memcpy of the weights", memcpy, None), ("live export, TP=1 (views)", live, memcpy),
            ("live export, TP=1, to bf16", live_bf16, memcpy)]
    for label, seconds, base in rows:
        ratio = f"{base / seconds:>11.2f}x" if base else f"{'(baseline)':>12}"
        print(f"{label:<28} {seconds:>8.2f} {gb / seconds:>7.2f} {ratio}")
    assert exported == nbytes, (exported, nbytes)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
