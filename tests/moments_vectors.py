"""Test vectors of the low-precision moment step, from the NumPy reference.

`python -m tests.moments_vectors` writes xla_ffi/testdata/moments_vectors.bin:
steps of bf16 and 8-bit moments (inputs, and what the float64 reference of
tests/moments_reference.py allows each output to be). The C++ test
(xla_ffi/lowp_moments_test.cc) steps them on every instruction set it is
built for, the NEON and SVE builds under qemu included, so the NumPy
reference judges every ISA; tests/test_moments_vectors.py checks that the
file is what this generator writes.

Layout, little-endian. Header: b'JSOMVEC1', u32 number of cases. A case:
u8 mu format, u8 nu format (0 f32, 1 bf16, 2 8-bit), u8 nesterov, u8 0,
u32 count (steps before this one), f32[8] learning rate, b1, 1 - b1, b2,
1 - b2, eps, eps_root, weight decay (as the kernel's scalars), u64 n; then
f32[n] master, f32[n] gradient, the two moments (f32[n]; u16[n] bf16 bits;
or u8[n] codes and f32[ceil(n / 256)] scales), f64[n] lowest and f64[n]
highest new master, and for each moment its expectation: f64[n] lowest and
f64[n] highest value (f32, bf16), or u8[blocks] finite, f64[blocks] lowest
and highest scale, u8[n] lowest and highest code magnitude, u8[n] negative
allowed, u8[n] non-negative allowed (8-bit).
"""

from __future__ import annotations

import pathlib
import struct

import numpy as np

from tests import moments_reference as ref

PATH = (
  pathlib.Path(__file__).parents[1] / 'xla_ffi/testdata/moments_vectors.bin'
)
MAGIC = b'JSOMVEC1'
F32, BF16, Q8 = 0, 1, 2
FORMATS = [(BF16, F32), (BF16, BF16), (Q8, Q8)]
SIZES = [1, 255, 257, 600]
HYPER = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
  return (ref.bf16_round(x).astype(np.float32).view(np.uint32) >> 16).astype(
    np.uint16
  )


def _moment(rng, fmt: int, n: int, signed: bool, zero: bool):
  """A stored moment: (its bytes to write, its float64 value)."""
  magnitude = 1e-3 if signed else 1e-6
  if fmt == Q8:
    codes = rng.integers(0, 256, n).astype(np.uint8)
    blocks = -(-n // ref.BLOCK)  # Exact arithmetic only: the same bytes
    spread = np.ldexp(1 + rng.random(blocks), rng.integers(-6, 6, blocks))
    scales = (magnitude * spread).astype(np.float32)  # on every machine.
    if zero:
      codes[:], scales[:] = 0, 0
    value = ref.decode(codes, scales, signed)
    return codes.tobytes() + scales.tobytes(), value
  x = rng.standard_normal(n) * magnitude
  x = np.zeros(n) if zero else (x if signed else np.abs(x))
  if fmt == BF16:
    return _bf16_bits(x).tobytes(), ref.bf16_round(x)
  x32 = x.astype(np.float32)
  return x32.tobytes(), x32.astype(np.float64)


def _expectation(fmt: int, want, tol, signed: bool) -> bytes:
  if fmt == F32:
    return (want - tol).tobytes() + (want + tol).tobytes()
  if fmt == BF16:
    lo, hi = ref.bf16_round(want - tol), ref.bf16_round(want + tol)
    return lo.tobytes() + hi.tobytes()
  e = ref.blockwise_expectation(want, tol, signed)
  return b''.join(
    [
      e.finite.astype(np.uint8).tobytes(),
      e.scale_lo.tobytes(),
      e.scale_hi.tobytes(),
      e.code_lo.astype(np.uint8).tobytes(),
      e.code_hi.astype(np.uint8).tobytes(),
      e.neg_ok.astype(np.uint8).tobytes(),
      e.pos_ok.astype(np.uint8).tobytes(),
    ]
  )


def _gradient(rng, n: int) -> np.ndarray:
  """Scales from 1e-3 to 1e4 alternating within blocks, and zeros."""
  g = rng.standard_normal(n) * np.where(np.arange(n) % 3 == 0, 1e4, 1e-3)
  g[np.arange(n) % 7 == 0] = 0.0
  return g.astype(np.float32)


def case(rng, mu_fmt: int, nu_fmt: int, n: int, nesterov: bool) -> bytes:
  """One case: its inputs and the reference's expectations, as bytes."""
  count = 6 if nesterov else 0  # The first step starts from zero moments.
  wd = 0.0 if nesterov else 0.1
  master = rng.standard_normal(n).astype(np.float32)
  grad = _gradient(rng, n)
  mu_bytes, mu = _moment(rng, mu_fmt, n, True, zero=count == 0)
  nu_bytes, nu = _moment(rng, nu_fmt, n, False, zero=count == 0)
  want = ref.adam_step(
    master.astype(np.float64),
    mu,
    nu,
    grad.astype(np.float64),
    t=count + 1,
    wd=wd,
    nesterov=nesterov,
    **HYPER,
  )
  b1, b2 = HYPER['b1'], HYPER['b2']
  scalars = [HYPER['lr'], b1, 1 - b1, b2, 1 - b2, HYPER['eps']]
  scalars += [HYPER['eps_root'], wd]
  master_lo = want['master'] - want['master_tol']
  master_hi = want['master'] + want['master_tol']
  return b''.join(
    [
      struct.pack('<BBBBI', mu_fmt, nu_fmt, nesterov, 0, count),
      np.asarray(scalars, np.float32).tobytes(),
      struct.pack('<Q', n),
      master.tobytes(),
      grad.tobytes(),
      mu_bytes,
      nu_bytes,
      master_lo.tobytes(),
      master_hi.tobytes(),
      _expectation(mu_fmt, want['mu'], want['mu_tol'], True),
      _expectation(nu_fmt, want['nu'], want['nu_tol'], False),
    ]
  )


def generate() -> bytes:
  rng = np.random.default_rng(2026)
  cases = [
    case(rng, mu, nu, n, nesterov)
    for mu, nu in FORMATS
    for nesterov in (False, True)
    for n in SIZES
  ]
  return MAGIC + struct.pack('<I', len(cases)) + b''.join(cases)


def main() -> None:
  PATH.parent.mkdir(parents=True, exist_ok=True)
  data = generate()
  PATH.write_bytes(data)
  print(f'wrote {PATH} ({len(data)} bytes)')


if __name__ == '__main__':
  main()
