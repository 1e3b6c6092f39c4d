"""How Adam's moments are stored: fp32, bf16, or 8-bit blockwise.

8-bit blockwise (`moments_8bit=True`): each leaf's moment, flattened in
row-major order, is cut into blocks of `BLOCK` elements (the last one
shorter). A block is stored as one fp32 scale, its largest magnitude, and
one byte per element: the element times the scale's fp32 reciprocal,
rounded to the nearest value of a small floating-point code map, ties to
the even code.

- mu (signed): bit 7 is the sign; bits 0-6 a magnitude with 3 mantissa
  bits and exponent bias 15: code c >= 8 means 2^((c >> 3) - 15) *
  (1 + (c & 7) / 8), c < 8 means c * 2^-17.
- nu (non-negative): 8 bits of magnitude, 3 mantissa bits, bias 31.

So each moment keeps a relative precision of 2^-4 over many octaves below
its block's largest value, which Adam's second moment needs. A block with
a NaN or an infinity stores that as its scale, and decodes to NaN.

The codes are decoded exactly; a moment is the decoded code times the
scale (one fp32 rounding). The Grace Adam kernel (moment_codec.h) and the
`jax.numpy` codec below give the same bits.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 256  # Elements per scale; kQuantBlock in lowp_moments.h.


class Blockwise(NamedTuple):
  """One leaf's 8-bit moment: codes shaped like the leaf, one scale a block."""

  codes: jax.Array  # uint8, the leaf's shape.
  scales: jax.Array  # float32[num_blocks(size)].


def num_blocks(size: int) -> int:
  return -(-int(size) // BLOCK)


_MU_BIAS, _NU_BIAS = 15, 31


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _float(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _encode_magnitude(y: jax.Array, bias: int) -> jax.Array:
  """Nearest code of y in [0, 1] (NaN: 0), ties to the even code.

  Integer arithmetic on y's bits, no table: tables would be constants in
  device memory, which host compute (the "xla_host" executor) cannot read.
  """
  bits = _bits(y)
  # Codes below 8 are multiples of 2^(-2 - bias): adding 2^(21 - bias),
  # whose ulp that is, rounds y to one by the FPU's nearest-even.
  magic = float(2.0 ** (21 - bias))
  subnormal = _bits(y + magic) - np.float32(magic).view(np.uint32)
  rebiased = bits - np.uint32((127 - bias) << 23)
  normal = (rebiased + np.uint32(0x7FFFF) + ((rebiased >> 20) & 1)) >> 20
  code = jnp.where(bits < np.uint32((128 - bias) << 23), subnormal, normal)
  return code * (y >= 0).astype(jnp.uint32)  # NaN: 0.


def _decode_magnitude(code: jax.Array, bias: int) -> jax.Array:
  code = code.astype(jnp.uint32)
  subnormal = code.astype(jnp.float32) * float(2.0 ** (-2 - bias))
  normal = _float(
    ((code >> 3) + np.uint32(127 - bias)) << 23 | (code & 7) << 20
  )
  return jnp.where(code < 8, subnormal, normal)


def quantize(x: jax.Array, signed: bool) -> Blockwise:
  """`x` (any float shape) as 8-bit blockwise codes and fp32 scales."""
  flat = x.astype(jnp.float32).reshape(-1)
  n = flat.shape[0]
  pad = num_blocks(n) * BLOCK - n
  blocks = jnp.pad(flat, (0, pad)).reshape(-1, BLOCK)
  # The largest magnitude by its bits, as the kernel takes it: a NaN's
  # bits exceed every number's, so a NaN becomes the scale.
  scales = _float((_bits(blocks) & np.uint32(0x7FFFFFFF)).max(axis=1))
  # Times the reciprocal, as the kernel (0 * inf and x * NaN: NaN, code 0).
  y = blocks * (1.0 / scales)[:, None]
  code = _encode_magnitude(jnp.abs(y), _MU_BIAS if signed else _NU_BIAS)
  if signed:
    negative = (_bits(y) >> 31) == 1
    code = jnp.where(negative & ~jnp.isnan(y), code | 128, code)
  codes = code.astype(jnp.uint8).reshape(-1)[:n].reshape(x.shape)
  return Blockwise(codes, scales.reshape(-1))


def dequantize(q: Blockwise, signed: bool) -> jax.Array:
  """The fp32 moment that `q` stores, shaped like its codes."""
  codes = q.codes.reshape(-1).astype(jnp.uint32)
  if signed:
    magnitude = _decode_magnitude(codes & 127, _MU_BIAS)
    magnitude = jnp.where(codes >= 128, -magnitude, magnitude)
  else:
    magnitude = _decode_magnitude(codes, _NU_BIAS)
  n = codes.shape[0]
  # Per block by broadcasting (a repeat would gather, which host compute
  # refuses between memories).
  padded = jnp.pad(magnitude, (0, num_blocks(n) * BLOCK - n))
  scaled = padded.reshape(-1, BLOCK) * _like_memory(q.scales, padded)[:, None]
  return scaled.reshape(-1)[:n].reshape(q.codes.shape)


def _like_memory(x: jax.Array, like: jax.Array) -> jax.Array:
  """`x` in `like`'s memory space.

  Inside host compute, results computed from a 0-d array (a scalar leaf's
  codes) are typed as device memory, while the leaf's scales, of shape
  (1,), stay in host memory.
  """
  space = jax.typeof(like).memory_space
  if jax.typeof(x).memory_space == space:
    return x
  return jax.device_put(x, space)


def storage_dtypes(mu_dtype: Any, nu_dtype: Any, moments_8bit: bool) -> tuple:
  """The dtypes the kernel's leaves store mu and nu in."""
  if moments_8bit:
    return np.dtype(np.uint8), np.dtype(np.uint8)
  f32 = np.dtype(np.float32)
  mu = f32 if mu_dtype is None else np.dtype(mu_dtype)
  nu = f32 if nu_dtype is None else np.dtype(nu_dtype)
  return mu, nu
