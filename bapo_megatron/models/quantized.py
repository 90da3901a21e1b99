"""Quantized releases (config.json's quantization_config): which are read, how their tensors are
dequantized on load and quantized again on export.

Two formats are mapped, each as its releases store it on disk:
- fp8 (transformers' FineGrainedFP8Config; DeepSeek-V3/V3.1/R1, Kimi-K2, Qwen3's "-FP8" releases): a
  linear weight in float8_e4m3fn beside `<module>.weight_scale_inv` (float32), one scale per
  [bm, bn] block of weight_block_size, the edge blocks partial: weight = code * scale. Dynamic
  activation scaling only (a static scheme ships input scales the trainer has no use for);
  scale_fmt ue8m0 (DeepSeek-V3.1) keeps every scale a power of two.
- mxfp4 (gpt-oss): a fused expert tensor `X` as `X_blocks` (uint8, two e2m1 codes a byte, low nibble
  first, 32 codes a block along the input dimension) and `X_scales` (uint8 E8M0 exponents, bias
  127), ordered [experts, out, in] where the unquantized tensor is [experts, in, out], as
  transformers' convert_moe_packed_tensors reads them.

Which tensors a release quantizes is a rule (Quantization.quantizes), checked against every release
read (a tensor stored otherwise is refused by name): the export writes that rule's layout back.

The round trip of a release's own tensors (dequantize, then quantize): fp8 codes come back bitwise
(a block's scale is its amax / 448 and its amax a code of 448 times the old scale), the scales
within the trainer's dtype's rounding of that amax and the division's (2**-23 relative through
float32, 2**-8 + 2**-23 through bfloat16), bitwise with ue8m0 scales where a block's largest code
exceeds 224; mxfp4 values come back exactly, bytes bitwise in every block whose largest code is 4
or 6 (a smaller one takes a smaller exponent and larger codes of the same values). A block of
zeros gets the scale 1 (fp8) or the exponent 2**-127 (mxfp4).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch

import torch

from bapo_megatron.errors import BadInputError, ConfigError

QUANTIZATION = "quantization_config"
FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: a block's amax maps onto it."""
FP8_SCALE = "weight_scale_inv"
MX_BLOCKS, MX_SCALES, MX_BLOCK = "_blocks", "_scales", 32
MX_BIAS = 127
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""e2m1's magnitudes by code (bit 3 is the sign)."""
UNQUANTIZED_LINEARS = (".mlp.gate.weight", ".shared_expert_gate.weight", ".conv1d.weight")
"""Weights of the decoder the fp8 releases keep in high precision: routers and gates (SGLang builds
them without a quant_config), the linear attention's convolution."""
MX_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
STATIC_SCALES = ("input_scale", "activation_scale", ".weight_scale")
"""Tensor name endings of other quantization schemes (static activations, per-tensor scales)."""


@dataclass(frozen=True)
class Quantization:
    """A release's quantization_config, checked: `method` fp8 (with `block`, `power_of_two`) or mxfp4;
    `skipped`: its modules_to_not_convert."""

    method: str
    block: tuple[int, int] = (0, 0)
    power_of_two: bool = False
    skipped: tuple[str, ...] = ()

    def quantizes(self, name: str, ndim: int) -> bool:
        """Whether a release stores tensor `name` (as on disk, of `ndim` dimensions) quantized."""
        if not name.startswith(("model.layers.", "model.language_model.layers.")) or self._skips(name):
            return False
        if self.method == "mxfp4":
            return name.endswith(MX_EXPERTS) and ndim == 3
        return name.endswith(".weight") and ndim == 2 and not name.endswith(UNQUANTIZED_LINEARS)

    def _skips(self, name: str) -> bool:
        """Whether modules_to_not_convert names tensor `name`'s module or one around it, as transformers
        matches them (a whole dotted part, `*` for a layer index)."""
        module = name.rsplit(".", 1)[0]
        return any(fnmatch(module, form.format(p)) for p in self.skipped for form in ("{}", "*.{}", "{}.*", "*.{}.*"))

    def stored(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The on-disk (name, shape, dtype) of quantized tensor `name` of (unquantized) `shape`."""
        if self.method == "mxfp4":
            *lead, cols, rows = shape  # [experts, in, out] unquantized
            groups = _mx_groups(name, cols)
            return [
                (name + MX_BLOCKS, (*lead, rows, groups, MX_BLOCK // 2), torch.uint8),
                (name + MX_SCALES, (*lead, rows, groups), torch.uint8),
            ]
        return [(name, shape, torch.float8_e4m3fn), (fp8_scale_name(name), self.scale_shape(shape), torch.float32)]

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """An fp8 weight's scale grid: one per block, edge blocks partial."""
        *lead, rows, cols = shape
        return (*lead, math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

    def quantize(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensor `name` as a release stores it (several tensors); others unchanged."""
        if not self.quantizes(name, tensor.dim()):
            return {name: tensor}
        if self.method == "mxfp4":
            blocks, scales = mxfp4_quantize(tensor)
            return {name + MX_BLOCKS: blocks, name + MX_SCALES: scales}
        codes, scale = fp8_quantize(tensor, self.block, self.power_of_two)
        return {name: codes, fp8_scale_name(name): scale}

    def entries(self, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list:
        """(name, shape, dtype) of an unquantized checkpoint's tensors -> those this release stores."""
        out = []
        for name, shape, dtype in entries:
            out += self.stored(name, shape) if self.quantizes(name, len(shape)) else [(name, shape, dtype)]
        return out


def fp8_scale_name(weight: str) -> str:
    return weight.removesuffix("weight") + FP8_SCALE


def _mx_groups(name: str, cols: int) -> int:
    if cols % MX_BLOCK:
        raise ValueError(f"{name}: an input dimension of {cols} is not a whole number of {MX_BLOCK}-code blocks")
    return cols // MX_BLOCK


def read_quantization(config: dict, advice: str = "") -> Quantization | None:
    """The quantization of a config.json mapping (None: none); ConfigError naming the first setting
    whose weights are not mapped, with `advice` (how to make a bf16 copy)."""
    stated = config.get(QUANTIZATION)
    if not stated:
        return None
    field = QUANTIZATION
    if not isinstance(stated, dict):
        raise ConfigError(field, stated, "not an object")
    method = stated.get("quant_method")
    skipped = stated.get("modules_to_not_convert") or ()
    if not isinstance(skipped, list | tuple) or not all(isinstance(s, str) for s in skipped):
        raise ConfigError(f"{field}.modules_to_not_convert", skipped, "must be a list of module names")
    if method == "mxfp4":
        return Quantization("mxfp4", skipped=tuple(skipped))
    if method != "fp8":
        raise ConfigError(f"{field}.quant_method", method, f"only fp8 (block scales) and mxfp4 are read; {advice}")
    for key, default, mapped in (("fmt", "e4m3", ("e4m3",)), ("activation_scheme", "dynamic", ("dynamic",))):
        if stated.get(key, default) not in mapped:
            raise ConfigError(f"{field}.{key}", stated[key], f"only {mapped[0]} fp8 is read; {advice}")
    if stated.get("scale_fmt") not in (None, "ue8m0"):
        raise ConfigError(f"{field}.scale_fmt", stated["scale_fmt"], f"only float32 or ue8m0 scales; {advice}")
    block = stated.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{field}.weight_block_size", block, f"fp8 with block scales [rows, columns] only; {advice}")
    return Quantization("fp8", tuple(block), stated.get("scale_fmt") == "ue8m0", tuple(skipped))


# -- fp8 blocks


def _expand(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """A block grid over every element of a [.., rows, cols] tensor (edge blocks cut)."""
    return scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weights of fp8 `codes` [.., rows, cols] and their block `scale` grid."""
    rows, cols = codes.shape[-2:]
    return codes.float() * _expand(scale.float(), block, rows, cols)


def fp8_quantize(
    weight: torch.Tensor, block: tuple[int, int], power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes, float32 scale grid) of `weight` [.., rows, cols]: each block's scale its
    amax / 448 (rounded up to a power of two with `power_of_two`), 1 for a block of zeros."""
    weight = weight.float()
    rows, cols = weight.shape[-2:]
    bm, bn = block
    padded = torch.nn.functional.pad(weight.abs(), (0, -cols % bn, 0, -rows % bm))
    grid = padded.unflatten(-1, (-1, bn)).unflatten(-3, (-1, bm)).amax(dim=(-3, -1))
    scale = torch.where(grid > 0, grid / FP8_MAX, torch.ones_like(grid))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (weight / _expand(scale, block, rows, cols)).clamp(-FP8_MAX, FP8_MAX)
    return codes.to(torch.float8_e4m3fn), scale


# -- mxfp4 blocks (gpt-oss's experts)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bfloat16 (exact) [.., in, out] of `blocks` [.., out, groups, 16] and `scales` [.., out, groups],
    one expert at a time (the codes' indices take eight bytes each)."""
    if blocks.dim() > 3:
        *lead, rows, groups, _ = blocks.shape
        out = torch.empty((*lead, groups * MX_BLOCK, rows), dtype=torch.bfloat16)
        for index in itertools.product(*map(range, lead)):
            out[index] = mxfp4_dequantize(blocks[index], scales[index])
        return out
    signed = torch.tensor([*FP4_VALUES, *(-v for v in FP4_VALUES)], dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    values = torch.ldexp(signed[codes], (scales.long() - MX_BIAS).unsqueeze(-1).float())
    return values.flatten(-2).transpose(-1, -2).to(torch.bfloat16)


def mxfp4_quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `tensor` [.., in, out]: each block's exponent the least that fits its amax
    under 6 (no code saturates), each code the nearest e2m1 value (ties to the even code); one expert
    at a time."""
    if tensor.dim() > 2:
        parts = [mxfp4_quantize(tensor[index]) for index in itertools.product(*map(range, tensor.shape[:-2]))]
        return tuple(torch.stack([p[i] for p in parts]).unflatten(0, tensor.shape[:-2]) for i in (0, 1))
    values = tensor.float().transpose(-1, -2).contiguous()
    values = values.unflatten(-1, (_mx_groups("tensor", values.shape[-1]), MX_BLOCK))
    amax = values.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / FP4_VALUES[-1])), torch.full_like(amax, -MX_BIAS))
    exponent = exponent.clamp(-MX_BIAS, MX_BIAS)
    scaled = torch.ldexp(values.abs(), -exponent.unsqueeze(-1)).clamp(max=FP4_VALUES[-1])
    grid = torch.tensor(FP4_VALUES)
    midpoints = (grid[1:] + grid[:-1]) / 2
    code = torch.bucketize(scaled, midpoints)  # a tie rounds down, to the odd code when the lower is odd
    tie = (code < len(midpoints)) & (scaled == midpoints[code.clamp(max=len(midpoints) - 1)]) & (code % 2 == 1)
    code = (code + tie.long()) | (torch.signbit(values).long() << 3)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + MX_BIAS).to(torch.uint8)


# -- a release's stored tensors, read as the unquantized model's


@dataclass(frozen=True)
class Stored:
    """One logical tensor of a quantized release: its stored parts (data, then scale)."""

    parts: tuple[str, ...]
    shape: tuple[int, ...]


class QuantizedRelease:
    """The tensors of a release quantized as `quant`, by their unquantized names on disk: each one's
    stored parts checked (every quantized weight has its scale, of the grid's shape; no scale without
    its weight; what is quantized is what the rule says), read dequantized in float32 or bfloat16.

    `headers`: each stored tensor's (safetensors dtype, shape); `file_of`: its file, for errors."""

    def __init__(self, quant: Quantization, headers: Mapping[str, tuple[str, tuple[int, ...]]], file_of) -> None:
        self.quant, self.file_of = quant, file_of
        pair = _mx_pairs if quant.method == "mxfp4" else _fp8_pairs
        self.tensors: dict[str, Stored] = dict(pair(quant, headers, self._refuse))
        parts = {part for stored in self.tensors.values() for part in stored.parts}
        self.dtypes = dict.fromkeys(self.tensors, "F32" if quant.method == "fp8" else "BF16")
        """Each tensor's safetensors dtype as read: a quantized one's after dequantization."""
        for name, (dtype, shape) in headers.items():
            if name in parts:
                continue
            self.tensors[name], self.dtypes[name] = Stored((name,), shape), dtype
            if quant.quantizes(name, len(shape)):
                self._refuse(
                    name,
                    f"is stored as {dtype}, where a {quant.method} release quantizes its kind (name "
                    "its module in quantization_config.modules_to_not_convert, or read a bf16 copy)",
                )
        self._last: tuple[str, torch.Tensor] | None = None

    def _refuse(self, name: str, what: str) -> None:
        raise BadInputError(f"{self.file_of(name)}: {name} {what}")

    def read(self, name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Tensor `name` dequantized (the last one is kept: a fused tensor is asked for per expert)."""
        stored = self.tensors[name]
        if len(stored.parts) == 1:
            return get(name)
        if self._last is None or self._last[0] != name:
            data, scale = (get(part) for part in stored.parts)
            if self.quant.method == "mxfp4":
                tensor = mxfp4_dequantize(data, scale)
            else:
                tensor = fp8_dequantize(data, scale, self.quant.block)
            self._last = (name, tensor)
        return self._last[1]


def _fp8_pairs(quant: Quantization, headers: Mapping, refuse) -> Iterator[tuple[str, Stored]]:
    """Each fp8 weight with its scale, checked."""
    for name, (dtype, shape) in headers.items():
        if name.endswith(STATIC_SCALES):
            refuse(name, "is a scale of a scheme other than dynamic fp8 block scales (not read)")
        if name.endswith(FP8_SCALE) and headers.get(name.removesuffix(FP8_SCALE) + "weight", ("",))[0] != "F8_E4M3":
            refuse(name, "is a scale without an F8_E4M3 weight beside it")
        if dtype != "F8_E4M3":
            continue
        scale = fp8_scale_name(name)
        if scale not in headers:
            refuse(name, f"is quantized (F8_E4M3) but has no {scale}")
        grid = quant.scale_shape(shape) if len(shape) >= 2 else None
        if headers[scale][0] not in ("F32", "BF16") or headers[scale][1] != grid:
            refuse(scale, f"is {headers[scale][0]} {headers[scale][1]}; its weight {shape} needs float32 {grid}")
        if not quant.quantizes(name, len(shape)):
            refuse(name, "is quantized where the fp8 releases keep its kind unquantized (not read)")
        yield name, Stored((name, scale), shape)


def _mx_pairs(quant: Quantization, headers: Mapping, refuse) -> Iterator[tuple[str, Stored]]:
    """Each mxfp4 tensor's blocks with their scales, checked."""
    for name, (dtype, shape) in headers.items():
        if name.endswith(MX_SCALES) and name.removesuffix(MX_SCALES) + MX_BLOCKS not in headers:
            refuse(name, f"has no {MX_BLOCKS} tensor beside it")
        if not name.endswith(MX_BLOCKS):
            continue
        base = name.removesuffix(MX_BLOCKS)
        scales = base + MX_SCALES
        if dtype != "U8" or len(shape) < 3 or shape[-1] != MX_BLOCK // 2:
            refuse(name, f"is {dtype} {shape}; mxfp4 blocks are U8 [.., rows, groups, {MX_BLOCK // 2}]")
        if scales not in headers:
            refuse(name, f"has no {scales}")
        if headers[scales] != ("U8", shape[:-1]):
            refuse(scales, f"is {headers[scales][0]} {headers[scales][1]}; its blocks {shape} need U8 {shape[:-1]}")
        logical = (*shape[:-3], shape[-2] * MX_BLOCK, shape[-3])
        if not quant.quantizes(base, len(logical)):
            refuse(name, "is mxfp4 where gpt-oss's releases keep its kind unquantized (not read)")
        yield base, Stored((name, scales), logical)
