"""Adam with bf16 or 8-bit blockwise moments in float64, from the math.

Written from the formats' definitions (the docstring of
jax_superoffload/_src/core/moments.py), not from the kernel: code values are
tabulated from their formula and a code is found by searching that table.
The checks accept the kernel's result where it equals the reference's
rounding of the exact value, or the rounding of a value within the fp32
evaluation error of it (a value that close to a midpoint may round either
way); that error is a count of fp32 roundings times 2^-24.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

BLOCK = 256
U = 2.0**-24  # fp32 unit roundoff.


def code_table(signed: bool) -> np.ndarray:
  """Each code's magnitude, in float64, from the format's formula."""
  bias, count = (15, 128) if signed else (31, 256)
  out = np.empty(count)
  for c in range(count):
    if c < 8:
      out[c] = c * 2.0 ** (-2 - bias)
    else:
      out[c] = 2.0 ** ((c >> 3) - bias) * (1 + (c & 7) / 8)
  return out


def nearest_code(y: float, table: np.ndarray) -> int:
  """The code nearest y (y >= 0), ties to the even code."""
  d = np.abs(table - y)
  best = np.flatnonzero(d == d.min())
  even = [c for c in best if c % 2 == 0]
  return int(even[0] if even else best[0])


def decode(codes: np.ndarray, scales: np.ndarray, signed: bool) -> np.ndarray:
  table = code_table(signed)
  c = codes.reshape(-1).astype(np.int64)
  mag = table[c & 127] if signed else table[c]
  val = np.where(signed & (c >= 128), -mag, mag)
  return val * np.repeat(scales.astype(np.float64), BLOCK)[: c.size]


def bf16_round(x: np.ndarray) -> np.ndarray:
  """x (float64) rounded to bf16 to nearest even, as float64."""
  f = x.astype(np.float32)  # Exact for the values compared here.
  bits = f.view(np.uint32).astype(np.uint64)
  rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
  return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def adam_step(
  master, mu, nu, g, *, t, lr, b1, b2, eps, eps_root, wd, nesterov
) -> dict:
  """One Adam(W) step in float64 from float64 inputs; t counts from 1."""
  mu = b1 * mu + (1 - b1) * g
  nu = b2 * nu + (1 - b2) * g * g
  if nesterov:
    mu_hat = b1 * mu / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
  else:
    mu_hat = mu / (1 - b1**t)
  nu_hat = nu / (1 - b2**t)
  direction = mu_hat / (np.sqrt(nu_hat + eps_root) + eps) + wd * master
  return {
    'master': master - lr * direction,
    'mu': mu,
    'nu': nu,
    'master_tol': (
      4 * U * np.abs(master)
      + lr * np.abs(direction) * _direction_error(t, b1, b2, nesterov)
    ),
    # fp32 evaluation error of the moments: 3-4 roundings each.
    'mu_tol': 4 * U * (np.abs(b1 * mu) + np.abs((1 - b1) * g)),
    'nu_tol': 4 * U * (np.abs(nu) + np.abs(g * g)),
  }


def _direction_error(t: int, b1: float, b2: float, nesterov: bool) -> float:
  """Relative fp32 error of Adam's direction, to first order, doubled.

  About a dozen roundings (moments, bias corrections, square root,
  division, decay), plus the bias corrections' conditioning: with b stored
  in fp32 (relative error U), 1 - b^t is off by t b^t U / (1 - b^t)
  relative: 999 U for b2 = 0.999 at t = 1. optax's float32 step carries
  the same error.
  """

  def conditioning(b, n):
    return n * b**n / (1 - b**n) * U

  c1 = conditioning(b1, t + 1 if nesterov else t) + conditioning(b1, t)
  return 2 * (16 * U + c1 + conditioning(b2, t) / 2)


def check_close(got, want, tol, what: str) -> None:
  got = np.asarray(got, np.float64)
  bad = ~(np.abs(got - want) <= tol) & ~(np.isnan(got) & np.isnan(want))
  if bad.any():
    i = np.flatnonzero(bad)[0]
    raise AssertionError(
      f'{what}: {bad.sum()} of {bad.size} differ; first at {i}: got '
      f'{got.flat[i]!r}, want {want.flat[i]!r} +- {tol.flat[i]!r}'
    )


def check_bf16(stored, want, tol, what: str) -> None:
  """`stored` is the bf16 rounding of a value within want +- tol.

  Rounding is monotone, so those are the bf16 values from the rounding of
  want - tol to that of want + tol.
  """
  got = np.asarray(stored, np.float64)
  lo, hi = bf16_round(want - tol), bf16_round(want + tol)
  ok = ((lo <= got) & (got <= hi)) | (np.isnan(got) & np.isnan(want))
  if not ok.all():
    i = np.flatnonzero(~ok)[0]
    raise AssertionError(
      f'{what}: {(~ok).sum()} of {ok.size} are not bf16 roundings; first at '
      f'{i}: got {got.flat[i]!r}, want {want.flat[i]!r} +- {tol.flat[i]!r}'
    )


class Blockwise(NamedTuple):
  """What 8-bit codes and scales may be for a float64 moment (flat).

  Per block: `finite`, and the scale's interval [scale_lo, scale_hi]; per
  element: the interval of code magnitudes [code_lo, code_hi], and whether
  the code may be negative (`neg_ok`) and non-negative (`pos_ok`).
  """

  finite: np.ndarray
  scale_lo: np.ndarray
  scale_hi: np.ndarray
  code_lo: np.ndarray
  code_hi: np.ndarray
  neg_ok: np.ndarray
  pos_ok: np.ndarray


def blockwise_expectation(want, tol, signed: bool) -> Blockwise:
  """The codes and scales that round a value within want +- tol.

  A block's scale is its largest magnitude, within the block's largest
  tolerance; a code is the rounding of a value within y +- dy, y the
  element over the scale (and 2 U y more, the fp32 division by it). Codes
  are monotone in magnitude, so the allowed magnitudes run from the code
  of the smallest |value| in the interval to that of the largest; a sign
  other than y's only where the interval holds zero.
  """
  table = code_table(signed)
  n = want.size
  blocks = -(-n // BLOCK)
  out = Blockwise(
    np.ones(blocks, bool),
    np.zeros(blocks),
    np.zeros(blocks),
    np.zeros(n, np.int64),
    np.zeros(n, np.int64),
    np.zeros(n, bool),
    np.ones(n, bool),
  )
  for b in range(blocks):
    part = slice(b * BLOCK, min(n, (b + 1) * BLOCK))
    x, e = want[part], tol[part]
    if not np.isfinite(x).all():
      out.finite[b] = False
      continue
    scale, slack = np.abs(x).max(), np.abs(e).max()
    out.scale_lo[b], out.scale_hi[b] = scale - slack, scale + slack
    if scale == 0:  # Every code 0.
      continue
    for i, (xi, ei) in enumerate(zip(x, e, strict=True)):
      y = xi / scale
      dy = (ei + slack) / scale + 2 * U * abs(y)
      lo, hi = y - dy, y + dy
      smallest = 0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))
      j = b * BLOCK + i
      out.code_lo[j] = nearest_code(smallest, table)
      out.code_hi[j] = nearest_code(max(abs(lo), abs(hi)), table)
      out.neg_ok[j] = signed and (y < 0 or lo <= 0)
      out.pos_ok[j] = y >= 0 or hi >= 0
  return out


def check_blockwise(codes, scales, want, tol, signed: bool, what: str) -> None:
  """8-bit codes and scales against the float64 moment `want` (flat)."""
  codes = np.asarray(codes).reshape(-1).astype(np.int64)
  scales = np.asarray(scales, np.float64)
  e = blockwise_expectation(want, tol, signed)
  for b in np.flatnonzero(~e.finite):
    assert np.isnan(scales[b]) or np.isinf(scales[b]), (what, b, scales[b])
  finite = e.finite
  bad = finite & ~((e.scale_lo <= scales) & (scales <= e.scale_hi))
  if bad.any():
    b = np.flatnonzero(bad)[0]
    raise AssertionError(
      f'{what} block {b}: scale {scales[b]!r}, want [{e.scale_lo[b]!r}, '
      f'{e.scale_hi[b]!r}]'
    )
  magnitude = codes & 127 if signed else codes
  negative = signed & (codes >= 128)
  sign_ok = (magnitude == 0) | np.where(negative, e.neg_ok, e.pos_ok)
  ok = (e.code_lo <= magnitude) & (magnitude <= e.code_hi) & sign_ok
  ok |= ~np.repeat(finite, BLOCK)[: codes.size]
  if not ok.all():
    i = np.flatnonzero(~ok)[0]
    raise AssertionError(
      f'{what} element {i}: code {codes[i]}, want magnitude in '
      f'[{e.code_lo[i]}, {e.code_hi[i]}] (negative ok {e.neg_ok[i]}, '
      f'non-negative ok {e.pos_ok[i]}) for {want[i]!r} +- {tol[i]!r}'
    )
