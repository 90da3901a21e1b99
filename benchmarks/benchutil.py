"""What the GPU benchmarks share: the model shapes they run, and timing with a warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bapo_megatron.models.spec import ModelSpec, tiny_spec


def _qwen2(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, tied: bool) -> ModelSpec:
    return ModelSpec(
        architecture="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=ffn,
        head_dim=128,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=tied,
    )


SHAPES = {
    "tiny": tiny_spec(),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-7b": ModelSpec.from_hf_dir(Path(__file__).resolve().parents[1] / "examples" / "qwen2.5-7b" / "shape"),
}
"""The shapes of Qwen2.5's published configs (no weights: the benchmarks need only the shape); the
7B one is the preset's (examples/qwen2.5-7b/shape). The benchmarks' sequences are far shorter than
any of these position limits, which change no timing."""


def timed(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> list[float]:
    """Seconds of each of `repeat` calls of fn after one untimed warm-up (allocations, compilation,
    fp8 scales), `sync` (the device's synchronize, or nothing on the CPU) around each."""
    fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times
