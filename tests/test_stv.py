"""Speculation-then-validation: clipping and non-finite steps, exactly."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload

# Gradient scales per step: below and above the clip norm, NaN and Inf.
SCALES = [0.05, 3.0, 0.05, np.nan, 1.0, np.inf, 0.02, 8.0, -np.inf, 0.3]


def tree():
  rng = np.random.default_rng(0)
  return {
    'w': jnp.asarray(rng.standard_normal((6, 5)), jnp.float32),
    'b': jnp.asarray(rng.standard_normal(7), jnp.float32),
    's': jnp.asarray(0.5, jnp.float32),
  }


def grads(params, step, scale):
  rng = np.random.default_rng(100 + step)

  def one(x):
    if np.isfinite(scale):
      return (rng.standard_normal(x.shape) * scale).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    return np.where(rng.random(x.shape) < 0.3, np.float32(scale), g)

  return jax.tree.map(one, params)


def serial(clip_norm, skip_nonfinite, params):
  """The serial recipe: optax clipping, then AdamW; drop non-finite steps."""
  tx = optax.chain(
    optax.clip_by_global_norm(clip_norm) if clip_norm else optax.identity(),
    optax.adamw(1e-2, weight_decay=0.1, nesterov=True),
  )
  state = tx.init(params)
  for i, scale in enumerate(SCALES):
    g = grads(params, i, scale)
    if skip_nonfinite and not np.isfinite(scale):
      continue
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize('executor', ['ffi', 'xla_host', 'device'])
@pytest.mark.parametrize(
  ('clip_norm', 'skip_nonfinite'), [(1.0, True), (None, True)]
)
def test_stv_equals_the_serial_recipe(executor, clip_norm, skip_nonfinite):
  params = tree()
  tx = superoffload.adamw(
    1e-2,
    weight_decay=0.1,
    nesterov=True,
    clip_norm=clip_norm,
    skip_nonfinite=skip_nonfinite,
    executor=executor,
    bucket_bytes=4 * 16,  # Several buckets.
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  p = params
  for i, scale in enumerate(SCALES):
    updates, state = step(grads(p, i, scale), state, p)
    p = optax.apply_updates(p, updates)
    for x in jax.tree.leaves((state.mu, state.nu, state.master)):
      if x.ndim:  # Scalars stay on the device (transform.on_host).
        assert x.sharding.memory_kind == 'pinned_host'
  want = serial(clip_norm, skip_nonfinite, params)
  # fp32 rounding over 10 steps, 2 of them redone: optax itself rounds
  # differently (its 1 - b2**t in fp32 loses bits early on, and it clips
  # as (g / norm) * c rather than g * (c / norm)), so the two sides may be
  # a few tens of ulps apart; a redo bug would be far off.
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=5e-6, atol=5e-7),
    p,
    want,
  )
  nonfinite = sum(not np.isfinite(s) for s in SCALES)
  assert int(state.skipped) == nonfinite
  assert int(state.count) == len(SCALES) - nonfinite
  if clip_norm is None:
    assert int(state.redone) == 0
  else:
    assert int(state.redone) >= 2  # The steps at scales 3.0 and 8.0.


def test_clipping_without_skip_matches_optax_on_nan():
  params = tree()
  ours = superoffload.adamw(1e-2, clip_norm=1.0)
  theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  s, r = ours.init(params), theirs.init(params)
  g = grads(params, 0, np.nan)
  u, s = ours.update(g, s, params)
  v, r = theirs.update(g, r, params)
  p, q = optax.apply_updates(params, u), optax.apply_updates(params, v)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


def test_stv_that_never_triggers_changes_nothing():
  params = tree()
  plain = superoffload.adamw(1e-2)
  guarded = superoffload.adamw(1e-2, clip_norm=1e6, skip_nonfinite=True)
  s, r = plain.init(params), guarded.init(params)
  p = q = params
  for i in range(5):
    g = grads(params, i, 0.1)
    u, s = plain.update(g, s, p)
    v, r = guarded.update(g, r, q)
    p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
    np.testing.assert_array_equal(a, b)  # Bit for bit.
  assert int(r.redone) == 0 and int(r.skipped) == 0


def _mlp_train_step(tx, width=256):
  """A donated training step of a 3-layer MLP (one bucket per weight)."""
  rng = np.random.default_rng(0)
  params = {
    f'w{i}': jnp.asarray(rng.standard_normal((width, width)), jnp.float32) / 16
    for i in range(3)
  }
  params = jax.device_put(params, jax.devices()[0])

  def loss(params, x):
    for i in range(3):
      x = jnp.tanh(x @ params[f'w{i}'])
    return jnp.sum(x * x)

  def step(params, state, x):
    grads = jax.grad(loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1)), params


def _copies(hlo: str) -> list[str]:
  """The copies of arrays (not scalars) anywhere in the compiled module."""
  return [
    line
    for line in hlo.splitlines()
    if ' copy(' in line and not re.search(r'= \w+\[\] copy', line)
  ]


@pytest.mark.parametrize(
  'moments',
  [
    {},
    dict(mu_dtype=jnp.bfloat16),
    dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
    dict(moments_8bit=True),
  ],
  ids=['fp32', 'mu_bf16', 'bf16', '8bit'],
)
def test_armed_stv_needs_no_more_temporaries_and_no_copies(moments):
  # STV keeps each bucket's gradients until validation. Kept as temporaries
  # they made XLA:CPU map ~4 B/param afresh every step (page faults); kept
  # in the donated state they cost nothing per step. Nor may XLA copy any
  # state buffer: to make the double buffering work (fp32 moments), or
  # around the in-place step taken after the verdict (low-precision ones).
  bucket = 256 * 256 * 4
  x = jnp.ones((8, 256), jnp.float32)
  temps, hlos = {}, {}
  for name, kw in {
    'plain': {},
    'stv': dict(clip_norm=1.0, skip_nonfinite=True),
  }.items():
    tx = superoffload.adamw(1e-3, bucket_bytes=bucket, **kw, **moments)
    step, params = _mlp_train_step(tx)
    compiled = step.lower(params, tx.init(params), x).compile()
    temps[name] = compiled.memory_analysis().temp_size_in_bytes
    hlos[name] = compiled.as_text()
  allowed = 4096
  if moments:  # The step waits for the norm: all gradients live until then,
    allowed += sum(p.nbytes for p in jax.tree.leaves(params))  # as in optax.
  assert temps['stv'] <= temps['plain'] + allowed, temps
  assert not _copies(hlos['stv']), _copies(hlos['stv'])


def test_double_buffered_state_stays_in_place_and_swaps_rows():
  tx = superoffload.adamw(
    1e-3, bucket_bytes=256 * 256 * 4, clip_norm=1.0, skip_nonfinite=True
  )
  step, params = _mlp_train_step(tx)
  state = tx.init(params)
  buffers = jax.tree.leaves(
    (state.master, state.mu, state.nu, state.kept_grads)
  )
  pointers = [b.unsafe_buffer_pointer() for b in buffers]
  # Two rows per leaf, shaped like the parameter.
  for b, w in zip(
    jax.tree.leaves(state.master), jax.tree.leaves(params), strict=True
  ):
    assert b.shape == (2, *w.shape)
  assert int(state.row) == 0
  rows = []
  for x in (1.0, 1e-3, np.nan):  # Clipped, accepted, dropped.
    params, state = step(params, state, jnp.full((8, 256), x, jnp.float32))
    buffers = jax.tree.leaves(
      (state.master, state.mu, state.nu, state.kept_grads)
    )
    assert [b.unsafe_buffer_pointer() for b in buffers] == pointers
    rows.append(int(state.row))
  assert rows == [1, 0, 0]
  assert (int(state.redone), int(state.skipped), int(state.count)) == (1, 1, 2)
  assert step._cache_size() == 1
  current = state.current()
  for m, w in zip(
    jax.tree.leaves(current.master), jax.tree.leaves(params), strict=True
  ):
    np.testing.assert_array_equal(m, w)
