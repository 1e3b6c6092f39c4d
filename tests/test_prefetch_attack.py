"""The kernel's prefetch policy through the whole optimizer, STV included.

The policy only changes which cache hints the kernel issues, so every policy
must give the same bits, through the speculative and the redo handler too,
and a bad JAX_SUPEROFFLOAD_PREFETCH must be a Python error from an update,
never a crash.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload

ENV = 'JAX_SUPEROFFLOAD_PREFETCH'
# Accepted, clipped, dropped, clipped: every STV handler and path runs.
SCALES = [0.01, 5.0, np.nan, 30.0, 0.02]


def tree():
  rng = np.random.default_rng(0)
  params = {
    'big': jnp.asarray(rng.standard_normal((300, 257)), jnp.float32),
    'half': jnp.asarray(rng.standard_normal(4099), jnp.bfloat16),
    'odd': jnp.asarray(rng.standard_normal(37), jnp.float32),
  }
  return jax.device_put(params, jax.devices()[0])


def grads(params, t, scale):
  rng = np.random.default_rng(10 + t)

  def one(x):
    g = np.array(rng.standard_normal(x.shape), np.float32)
    if np.isfinite(scale):
      g = np.array(g * np.float32(scale / 100))
    else:
      g.flat[7] = scale
    return jnp.asarray(g, x.dtype)

  return jax.device_put(jax.tree.map(one, params), jax.devices()[0])


def train(tx, params):
  state = tx.init(params)
  step = jax.jit(
    lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)
    ),
    donate_argnums=(0, 1),
  )
  for t, scale in enumerate(SCALES):
    params, state = step(params, state, grads(params, t, scale))
  return jax.device_get((params, state))


STV = dict(clip_norm=1.0, skip_nonfinite=True)


@pytest.mark.parametrize('options', [{}, STV], ids=['plain', 'stv'])
def test_every_policy_gives_the_same_bits_through_the_optimizer(
  monkeypatch, options
):
  results = {}
  for policy in ('t0', 'nta', 'none'):
    monkeypatch.setenv(ENV, policy)
    tx = superoffload.adamw(
      1e-2, executor='ffi', bucket_bytes=200_000, **options
    )
    results[policy] = train(tx, tree())
  if options:
    state = results['t0'][1]
    assert (int(state.redone), int(state.skipped)) == (2, 1)
  for policy in ('nta', 'none'):
    for got, want in zip(
      jax.tree.leaves(results[policy]),
      jax.tree.leaves(results['t0']),
      strict=True,
    ):
      np.testing.assert_array_equal(
        np.atleast_1d(got).view(np.uint8),
        np.atleast_1d(want).view(np.uint8),
        err_msg=policy,
      )


@pytest.mark.parametrize('options', [{}, STV], ids=['plain', 'stv'])
def test_bad_policy_is_an_error_from_the_update(monkeypatch, options):
  params = tree()
  tx = superoffload.adamw(1e-2, executor='ffi', **options)
  state = tx.init(params)
  monkeypatch.setenv(ENV, 'T0 ')
  with pytest.raises(Exception, match=f"{ENV} must be .* not 'T0 '"):
    jax.block_until_ready(
      jax.jit(tx.update)(grads(params, 1, 5.0), state, params)
    )
  # The state was not donated: it is intact and a valid policy steps on.
  monkeypatch.setenv(ENV, 'nta')
  updates, _ = jax.jit(tx.update)(grads(params, 1, 5.0), state, params)
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
