"""Adam with bf16 or 8-bit blockwise moments in float64, from the math.

Written from the formats' definitions (the docstring of
jax_superoffload/_src/moments.py), not from the kernel: code values are
tabulated from their formula and a code is found by searching that table.
The checks accept the kernel's result where it equals the reference's
rounding of the exact value, or the rounding of a value within the fp32
evaluation error of it (a value that close to a midpoint may round either
way); that error is a count of fp32 roundings times 2^-24.
"""

from __future__ import annotations

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


def check_blockwise(codes, scales, want, tol, signed: bool, what: str) -> None:
  """8-bit codes and scales against the float64 moment `want` (flat)."""
  codes = np.asarray(codes).reshape(-1)
  scales = np.asarray(scales, np.float64)
  table = code_table(signed)
  for b in range(scales.size):
    x, e = want[b * BLOCK : (b + 1) * BLOCK], tol[b * BLOCK : (b + 1) * BLOCK]
    c = codes[b * BLOCK : (b + 1) * BLOCK]
    if not np.isfinite(x).all():
      assert np.isnan(scales[b]) or np.isinf(scales[b]), (what, b, scales[b])
      continue
    scale = np.abs(x).max()
    slack = np.abs(e).max()
    if not abs(scales[b] - scale) <= slack:
      raise AssertionError(
        f'{what} block {b}: scale {scales[b]!r}, want {scale!r}'
      )
    if scale == 0:
      assert (c == 0).all(), (what, b)
      continue
    for i in range(x.size):
      _check_code(int(c[i]), x[i] / scale, (e[i] + slack) / scale, table,
                  signed, f'{what} block {b} element {i}')  # fmt: skip


def _check_code(code: int, y: float, dy: float, table, signed: bool, what):
  """`code` is the rounding of a value within y +- dy (or 2 U y more).

  Codes are monotone in magnitude, so the allowed magnitudes run from the
  code of the smallest |value| in the interval to that of the largest; a
  sign other than y's only where the interval holds zero.
  """
  dy += 2 * U * abs(y)  # The fp32 division by the scale.
  lo, hi = y - dy, y + dy
  smallest = 0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))
  allowed = range(
    nearest_code(smallest, table),
    nearest_code(max(abs(lo), abs(hi)), table) + 1,
  )
  magnitude = code & 127 if signed else code
  negative = signed and code >= 128
  sign_ok = magnitude == 0 or negative == (y < 0) or lo <= 0 <= hi
  if magnitude not in allowed or not sign_ok:
    raise AssertionError(
      f'{what}: code {code}, want one of {list(allowed)} (sign {y < 0}) '
      f'for y={y!r} +- {dy!r}'
    )
