"""Offline resharding: a Megatron checkpoint of any TP/PP/EP to the inference layout.

    python tools/reshard.py --mcore CKPT_DIR --out HF_DIR [--hf-template DIR] [--dtype DTYPE]
    python tools/reshard.py --mcore CKPT_DIR --out SGLANG_DIR --sglang-tp 4 [--hf-template DIR]

CKPT_DIR is what tools/convert_checkpoint.py mcore-to-hf takes (one resolver, weights_dir): a
converted checkpoint, a trainer step directory (checkpoint.dir/step_N) or a run's checkpoint.dir
(the step a resume would load), saved at any tensor, pipeline and expert-parallel size:
a Qwen3-MoE run's checkpoint saved at parallel.expert=8 gives what one saved by a single process
gives (optimizer state is passed over). Without --sglang-tp the output is a Hugging Face
directory (safetensors shards, index, config.json, tokenizer files; one tensor per expert) that
transformers and SGLang load, SGLang at any TP/EP. With --sglang-tp N (dense models) each
tensor-parallel rank gets its own files, model-rank-R-part-P.safetensors, which SGLang loads
with `--load-format sharded_state --tp N` without resharding at start-up.

The checkpoint is read one decoder layer at a time (a MoE layer's experts one by one), so
memory stays at about one layer whatever the model size. The live, in-training counterpart is
bapo_megatron.weights.export.stream_hf_buckets (same layout maps).
"""

from __future__ import annotations

import argparse
import sys

from bapo_megatron.weights.convert import DTYPES, TEMPLATE_HELP, mcore_to_hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--mcore", required=True, help="a converted checkpoint, a run's step directory or its checkpoint.dir"
    )
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--hf-template", help=TEMPLATE_HELP)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the dtype in the model's config.json")
    parser.add_argument("--sglang-tp", type=int, default=None, help="pre-split for this SGLang TP size")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest output file, in GB")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.max_shard_gb <= 0:
        parser.error(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    try:
        out = mcore_to_hf(
            args.mcore,
            args.out,
            args.hf_template,
            args.dtype,
            sglang_tp=args.sglang_tp,
            max_shard_bytes=int(args.max_shard_gb * 1e9),
            progress=not args.no_progress,
        )
    except (ValueError, OSError) as err:  # OSError: a missing file, a full disk (nothing left behind)
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
