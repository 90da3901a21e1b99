"""Convert between Hugging Face and Megatron dist checkpoints, and check that they agree.

    python tools/convert_checkpoint.py hf-to-mcore --hf HF_DIR --out MCORE_DIR [--tp N --pp M --ep E --dtype float32]
    python tools/convert_checkpoint.py mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--hf-template DIR --dtype DTYPE
        --dequantized]
        (MCORE_DIR: a converted checkpoint, a run's step directory, or a run's checkpoint.dir: its latest
        step; each carries its model's config.json and the run's tokenizer files, so no template is needed;
        a LoRA run's: the adapters merged into the model. A LoRA run's checkpoint holds the adapters alone
        and names its base in lora_base.json: they are merged onto that base, or onto --base PATH (a HF
        directory or dist checkpoint), which must have the recorded base's weights (its fingerprint);
        a quantized release's model, merged or not, is written in the release's layout (fp8 codes and
        fresh block scales, MXFP4 experts; its quantization_config kept), --dequantized: plain weights)
    python tools/convert_checkpoint.py mcore-to-hf --mcore MCORE_DIR --peft-adapter ADAPTER_DIR
        (a LoRA run's adapters alone, as a PEFT adapter directory for the base model; with --out too: both)
    python tools/convert_checkpoint.py verify --hf HF_DIR --mcore MCORE_DIR [--tolerance 1e-4 --base PATH]

Conversions hold about one decoder layer beyond their inputs (hf-to-mcore: beyond the
model it writes) and show a progress bar in bytes/s on stderr (--no-progress: none).

Run each as one process (not under torchrun). Inputs are validated before any work starts,
and outputs appear under their final name only when complete. The Megatron checkpoint loads
at any pipeline size, at any expert-parallel size dividing the experts (Qwen3-MoE) and at every
tensor-parallel size dividing model.vocab_pad_tp (8); mcore-to-hf reads a checkpoint saved at
any of them and writes one tensor per expert, as Hugging Face checkpoints and SGLang name them.
"""

from __future__ import annotations

import argparse
import sys

from bapo_megatron.common.arguments import at_least_one
from bapo_megatron.errors import ConfigError
from bapo_megatron.trainer.checkpoint import STEP_DIR, step_of, weights_dir
from bapo_megatron.weights.convert import DTYPES, TEMPLATE_HELP, hf_to_mcore, mcore_to_hf, verify_conversion
from bapo_megatron.weights.peft_export import write_peft_adapter

BASE_HELP = (
    "a LoRA run's checkpoint of the adapters alone: the base to merge them onto (default: the path its "
    "lora_base.json records), checked to have the weights they were trained on"
)


def exported_from(mcore: str) -> str:
    """Which weights --mcore names, said after the output: a run's step (for a run's checkpoint.dir or
    directory, the one a resume would load) or a converted checkpoint."""
    directory = weights_dir(mcore)
    if STEP_DIR.match(directory.name):
        return f"from step {step_of(directory)} ({directory})"
    return f"from {directory} (a converted checkpoint: no training step)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=at_least_one, default=1, help="tensor-parallel size to check the model's split against")
    p.add_argument("--pp", type=at_least_one, default=1, help="pipeline size to check the layer split against")
    p.add_argument("--ep", type=at_least_one, default=1, help="expert-parallel size to check the expert split against")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    p.add_argument("--mcore", required=True)
    p.add_argument("--out", help="the HF model (a LoRA run's: its adapters merged)")
    p.add_argument("--peft-adapter", help="a LoRA run's adapters as a PEFT adapter directory here")
    p.add_argument("--hf-template", help=TEMPLATE_HELP)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the dtype in the model's config.json")
    p.add_argument("--base", help=BASE_HELP)
    p.add_argument(
        "--dequantized", action="store_true", help="a quantized release's model (fp8, mxfp4) unquantized in --dtype"
    )
    p = sub.add_parser("verify", help="compare logits of the two on random token ids")
    p.add_argument("--hf", required=True)
    p.add_argument("--mcore", required=True)
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest relative logit difference allowed")
    p.add_argument("--base", help=BASE_HELP)
    for p in sub.choices.values():
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    show = not args.no_progress
    try:
        if args.command == "hf-to-mcore":
            out = hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.dtype, progress=show, ep=args.ep)
            print(f"wrote {out}")
        elif args.command == "mcore-to-hf":
            if not (args.out or args.peft_adapter):
                parser.error("mcore-to-hf: give --out, --peft-adapter, or both")
            source = exported_from(args.mcore)
            if args.out:
                kw = {"progress": show, "base": args.base, "dequantized": args.dequantized}
                out = mcore_to_hf(args.mcore, args.out, args.hf_template, args.dtype, **kw)
                print(f"wrote {out} {source}")
            if args.peft_adapter:
                print(f"wrote {write_peft_adapter(args.mcore, args.peft_adapter)} {source}")
        else:
            result = verify_conversion(args.hf, args.mcore, base=args.base)
            ok = result["max_rel"] <= args.tolerance
            print(
                f"max abs diff {result['max_abs']:.3e}  max rel diff {result['max_rel']:.3e}  "
                f"({'ok' if ok else 'ABOVE'} tolerance {args.tolerance:g})"
            )
            return 0 if ok else 1
    except (ConfigError, ValueError, OSError) as err:  # OSError: a missing file, a full disk (nothing left behind)
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
