"""STV with bf16 and 8-bit moments, against the float64 reference.

Each step is checked from the state before it (decoded) against
`moments_reference.adam_step` fed the gradients clipped in float64:
g * clip_norm / ||g|| when ||g|| >= clip_norm. The step computes the norm
in fp32, so its clipped gradients are off by a common factor 1 + e, with
|e| at most the error of an fp32 sum of the n squares (n U, recursive
summation's bound) plus a few roundings; the reference is run at g (1 +- e)
too, and the check allows twice the change that makes. A dropped step
(non-finite gradients, `skip_nonfinite`) must leave the state as it was,
bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload
from tests import moments_reference as ref
from tests.test_moments import FORMATS
from tests.test_moments import HYPER
from tests.test_moments import _check_leaf
from tests.test_moments import _params
from tests.test_moments import reference_steps

CLIP = 1.0
# Per step: a factor on unit-normal gradients; NaN and Inf poison 30% of
# the elements. Below the clip norm, far above it, non-finite, alternating.
SCALES = [1e-3, 30.0, np.nan, 1e-2, 1e4, np.inf, 3.0, -np.inf, 1e-3]


def _grads(rng, params, scale) -> dict:
  out = {}
  for name, p in params.items():
    g = rng.standard_normal(p.shape)
    if np.isfinite(scale):
      g = (
        g
        * scale
        * np.where(np.arange(p.size) % 3 == 0, 10.0, 0.1).reshape(p.shape)
      )
    else:
      g = np.where(rng.random(p.shape) < 0.3, scale, g)
    out[name] = jnp.asarray(g, p.dtype)
  return out


def _norm(grads) -> float:
  flat = [np.asarray(g, np.float64).reshape(-1) for g in grads.values()]
  return float(np.sqrt(sum(np.sum(g * g) for g in flat)))


def _clipped_reference(state, grads, t: int, nesterov: bool) -> dict:
  """The reference step, its tolerances widened for the fp32 norm."""
  norm = _norm(grads)
  factor = 1.0 if norm < CLIP else CLIP / norm
  want = reference_steps(state, grads, t, nesterov, factor)
  if factor == 1.0:
    return want
  n = sum(np.size(g) for g in grads.values()) + len(grads)
  e = (n + 8) * ref.U
  for side in (1 - e, 1 + e):
    other = reference_steps(state, grads, t, nesterov, factor * side)
    for leaf, w in want.items():
      for key in ('master', 'mu', 'nu'):
        change = np.abs(other[leaf][key] - w[key])
        w[f'{key}_tol'] = w[f'{key}_tol'] + 2 * change
  return want


def _host_state(state) -> list[np.ndarray]:
  fields = (state.master, state.mu, state.nu, state.mu_scales, state.nu_scales)
  return [np.asarray(x) for x in jax.tree.leaves(fields)]


@pytest.mark.parametrize('executor', ['ffi', 'xla_host'])
@pytest.mark.parametrize('fmt', ['bf16', '8bit', 'mu_bf16'])
def test_clipped_and_dropped_steps_match_the_float64_reference(fmt, executor):
  rng = np.random.default_rng(5)
  params = _params(rng)
  nesterov = fmt == '8bit'
  tx = superoffload.adamw(
    HYPER['lr'],
    weight_decay=HYPER['wd'],
    nesterov=nesterov,
    clip_norm=CLIP,
    skip_nonfinite=True,
    executor=executor,
    bucket_bytes=4096,  # Several buckets.
    **FORMATS[fmt],
  )
  state = tx.init(params)
  update = jax.jit(tx.update, donate_argnums=(1,))
  t = clipped = 0
  for scale in SCALES:
    grads = _grads(rng, params, scale)
    before = _host_state(state)
    want = None
    if np.isfinite(scale):
      want = _clipped_reference(state, grads, t + 1, nesterov)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    if want is None:  # Dropped: nothing moved.
      for a, b in zip(before, _host_state(state), strict=True):
        np.testing.assert_array_equal(a, b)
      assert not any(np.any(u) for u in jax.tree.leaves(updates))
      continue
    t += 1
    clipped += _norm(grads) >= CLIP
    for leaf in params:
      _check_leaf(state, leaf, want[leaf])
  assert int(state.count) == t
  assert int(state.skipped) == sum(not np.isfinite(s) for s in SCALES)
  assert int(state.redone) == clipped >= 3


@pytest.mark.parametrize('fmt', ['bf16', '8bit'])
def test_stv_that_never_triggers_changes_no_bit(fmt):
  rng = np.random.default_rng(6)
  params = _params(rng)
  runs = []
  for stv in (False, True):
    tx = superoffload.adamw(
      HYPER['lr'],
      weight_decay=HYPER['wd'],
      bucket_bytes=4096,
      clip_norm=1e30 if stv else None,
      skip_nonfinite=stv,
      **FORMATS[fmt],
    )
    state, p = tx.init(params), params
    step = jax.jit(tx.update)
    grads_rng = np.random.default_rng(7)
    for _ in range(3):
      updates, state = step(_grads(grads_rng, params, 1e-2), state, p)
      p = optax.apply_updates(p, updates)
    runs.append((_host_state(state), jax.tree.leaves(p)))
  for a, b in zip(*(r[0] + r[1] for r in runs), strict=True):
    np.testing.assert_array_equal(a, b)
