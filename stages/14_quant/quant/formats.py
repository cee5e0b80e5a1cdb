"""Weight formats: how a float matrix becomes fewer bytes, and back.

A linear layer's weight W is [out_features N, in_features K]; y = x @ W.T. Every format here
stores integer (or 8-bit float) codes plus float scales, and dequantizes as code * scale:

- INT8, per output channel, symmetric: scale[n] = amax(|W[n, :]|) / 127, codes in [-127, 127].
  One scale per row, so it factors out of the dot product: y[:, n] = (x @ q[n]) * scale[n].
  Rounding error per element <= scale[n] / 2.
- INT4, group-wise along K (group size 32, 64 or 128), two codes per byte (even column in the
  low nibble). Symmetric: scale = amax(group) / 7, w = (q - 8) * scale, q in [1, 15].
  Asymmetric: scale = (max - min) / 15, w = q * scale + min, q in [0, 15]. The offset is the
  group's float minimum (torch's and gpt-fast's convention, which `_weight_int4pack_mm_for_cpu`
  takes as zero = min + 8 * scale), not an integer zero point (GPTQ's), so min and max are
  exact and the error per element is <= scale / 2 in both cases.
- FP8 e4m3 (4 exponent bits, 3 mantissa bits, largest finite 448, no infinity), scale per
  output channel = amax / 448, so the largest element maps to 448. Relative error of a normal
  value <= 2**-4 (half a unit in the last of 3 mantissa bits); below the smallest normal
  (2**-6 * scale) the absolute error is <= 2**-10 * scale.

Without a scale, values above 448 do not fit e4m3. The OCP standard's non-saturating cast (what
ml_dtypes and most GPU conversions do) rounds first, then turns anything beyond 448 (|x| > 464,
the midpoint to the next binade) into NaN: one NaN in a weight poisons every output it touches.
PyTorch 2.13's `.to(torch.float8_e4m3fn)` on the CPU saturates to 448 instead (measured here),
which hides the overflow as a silent clip. `e4m3_bits_nonsaturating` reproduces the standard's
cast so the test can show the NaN on any build; scaling first avoids both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_GROUP_SIZES = (32, 64, 128)
E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
_EPS = 1e-12  # an all-zero row or group gets a tiny scale, never a division by zero


@dataclass(frozen=True)
class Int8Weight:
    """codes int8 [N, K], scale float32 [N]."""

    codes: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Int4Weight:
    """packed uint8 [N, K // 2]; scale and offset float32 [N, K // group_size]. Symmetric
    weights have no offset (None): w = (q - 8) * scale; asymmetric: w = q * scale + offset."""

    packed: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


@dataclass(frozen=True)
class Fp8Weight:
    """codes float8_e4m3fn [N, K], scale float32 [N]."""

    codes: torch.Tensor
    scale: torch.Tensor


# ---- INT8 -------------------------------------------------------------------------------------


def quantize_int8(w: torch.Tensor, row_amax: torch.Tensor | None = None) -> Int8Weight:
    """Per-output-channel symmetric INT8. `row_amax` overrides each row's amax (a row-parallel
    shard passes the whole row's, reduced over the ranks, to match the unsharded result)."""
    w = w.float()
    amax = w.abs().amax(dim=1) if row_amax is None else row_amax.float()
    scale = amax.clamp(min=_EPS) / INT8_MAX
    codes = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(codes, scale)


def dequantize_int8(q: Int8Weight) -> torch.Tensor:
    return q.codes.float() * q.scale[:, None]


# ---- INT4 -------------------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in [0, 15] -> uint8 [N, K // 2]: column 2j low nibble, 2j + 1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"INT4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K] in [0, 15], the inverse of `pack_int4`."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"INT4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of the group size {group_size}")
    return w.float().reshape(n, k // group_size, group_size)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> Int4Weight:
    """Group-wise INT4 along the input dimension; see the module docstring for both forms."""
    g = _grouped(w, group_size)
    if symmetric:
        scale = g.abs().amax(dim=-1).clamp(min=_EPS) / 7
        codes = torch.round(g / scale[..., None]).clamp(-7, 7) + 8
        offset = None
    else:
        low, high = g.amin(dim=-1), g.amax(dim=-1)
        scale = (high - low).clamp(min=_EPS) / 15
        codes = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15)
        offset = low
    packed = pack_int4(codes.reshape(w.shape))
    return Int4Weight(packed, scale, offset, group_size)


def int4_codes(q: Int4Weight) -> torch.Tensor:
    """The unpacked codes [N, K] in [0, 15]."""
    return unpack_int4(q.packed)


def dequantize_int4(q: Int4Weight) -> torch.Tensor:
    n, k = q.shape
    codes = int4_codes(q).float().reshape(n, k // q.group_size, q.group_size)
    if q.offset is None:
        w = (codes - 8) * q.scale[..., None]
    else:
        w = codes * q.scale[..., None] + q.offset[..., None]
    return w.reshape(n, k)


def int4_scales_and_zeros(q: Int4Weight) -> torch.Tensor:
    """torch's int4pack layout [K // group_size, N, 2] of (scale, zero), w = (q - 8) * s + z."""
    zero = torch.zeros_like(q.scale) if q.offset is None else q.offset + 8 * q.scale
    return torch.stack((q.scale.t(), zero.t()), dim=-1).contiguous()


# ---- FP8 e4m3 ---------------------------------------------------------------------------------


def quantize_fp8(w: torch.Tensor, row_amax: torch.Tensor | None = None) -> Fp8Weight:
    """Per-output-channel e4m3 with scale = amax / 448 (`row_amax` as for INT8)."""
    w = w.float()
    amax = w.abs().amax(dim=1) if row_amax is None else row_amax.float()
    scale = amax.clamp(min=_EPS) / E4M3_MAX
    codes = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes, scale)


def dequantize_fp8(q: Fp8Weight) -> torch.Tensor:
    return q.codes.float() * q.scale[:, None]


def fp8_error_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest |w - dequantize(quantize(w))| allowed per element (module docstring)."""
    return torch.maximum(w.abs() * 2.0**-4, scale[:, None] * 2.0**-10)


def e4m3_bits_nonsaturating(x: torch.Tensor) -> torch.Tensor:
    """The OCP standard's non-saturating float32 -> e4m3fn cast, as uint8 bit patterns.

    Round to nearest even at 3 mantissa bits first (which is exactly what the saturating cast
    does inside the range), then: |x| > 464 (rounds past 448), inf and NaN -> 0x7F | sign, NaN.
    """
    x = x.float()
    saturated = x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).view(torch.uint8)
    overflow = ~torch.isfinite(x) | (x.abs() > 464.0)
    sign = torch.where(x < 0, 0x80, 0).to(torch.uint8)
    return torch.where(overflow, sign | 0x7F, saturated)


def e4m3_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 bit patterns -> float32 values (0x7F and 0xFF are NaN)."""
    return bits.view(FP8_DTYPE).float()
