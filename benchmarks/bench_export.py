"""The live export on one GPU: a Megatron model's weights to HF-named, flattened buckets ready to
send (what the weight sync does every step, before the wire), against device-to-device copies
of the same bytes.

    python benchmarks/bench_export.py --shape qwen2.5-7b             # one H100/H200 (bf16, about 15 GB)
    python benchmarks/bench_export.py --shape tiny                    # CPU smoke run

Rows, each the median of --repeat runs (min-max beside it), GB/s counting the bytes exported once:
  copy, one buffer      one copy of a flat buffer as large as the weights (the bandwidth ceiling)
  copy, per tensor      a clone of every parameter
  live export           stream_hf_buckets (TP gather, rename, q/k/v and gate/up split) + flattened_bucket
The layer spec (local or Transformer Engine's) is --impl; the weights are uninitialised (the
export's cost does not depend on their values).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from benchutil import SHAPES, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--impl", choices=["local", "transformer_engine"], default=None, help="default: by device")
    parser.add_argument("--bucket-mb", type=int, default=512, help="bucket size (rollout.sync.bucket_mb)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    if not gpu:
        from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

        activate_cpu_shim()
    from bapo_megatron.common import ipc
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.parallel import init_distributed, init_model_parallel, single_process_env
    from bapo_megatron.weights.export import stream_hf_buckets

    single_process_env()
    init_distributed()
    info = init_model_parallel(ParallelConfig(), seed=0)
    impl = args.impl or ("transformer_engine" if gpu and _has_te() else "local")
    spec = SHAPES[args.shape]
    model_cfg = ModelConfig(precision="bf16" if gpu else "fp32", transformer_impl=impl)
    model = mc.build_gpt_model(spec, model_cfg, ParallelConfig(), pre_process=True, post_process=True, initialize=False)
    params = [p.detach() for p in model.parameters()]
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    exported = 0

    def export():
        nonlocal exported
        exported = 0
        for bucket in stream_hf_buckets([model], spec, info, bucket_bytes=args.bucket_mb << 20, impl=impl):
            flat = ipc.flattened_bucket(bucket)["flattened_tensor"]
            exported += flat.numel()

    live = timed(export, args.repeat, sync)
    buffers = [torch.empty(exported, dtype=torch.uint8, device=params[0].device) for _ in range(2)]
    one_buffer = timed(lambda: buffers[1].copy_(buffers[0]), args.repeat, sync)
    buffers.clear()
    per_tensor = timed(lambda: [p.clone() for p in params], args.repeat, sync)
    device = torch.cuda.get_device_name() if gpu else "CPU"
    gb = exported / 1e9
    rows = [("copy, one buffer", one_buffer), ("copy, per tensor", per_tensor), ("live export", live)]
    print(
        f"shape={args.shape}, {gb:.2f} GB exported ({params[0].dtype}), spec={impl}, bucket {args.bucket_mb} MiB, "
        f"device={device}, torch {torch.__version__}, median of {args.repeat}"
    )
    header = f"{'operation':<18} {'seconds':>8} {'min-max s':>15} {'GB/s':>8} {'vs one-buffer copy':>19}"
    print(header)
    print("-" * len(header))
    base = statistics.median(one_buffer)
    out = []
    for label, times in rows:
        median = statistics.median(times)
        print(
            f"{label:<18} {median:>8.4f} {f'{min(times):.4f}-{max(times):.4f}':>15} {gb / median:>8.3g} "
            f"{base / median:>18.2f}x"
        )
        out.append({"operation": label, "seconds": median, "spread": [min(times), max(times)], "gb_s": gb / median})
    if args.json:
        Path(args.json).write_text(
            json.dumps({"shape": args.shape, "bytes": exported, "impl": impl, "device": device, "rows": out}, indent=1)
        )


def _has_te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
