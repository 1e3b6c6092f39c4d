"""Bucket repartitioning (device buckets) and the casting side."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload


def tree():
  params = {f'layer{i}': jnp.linspace(-1, 1, 40 + i) for i in range(6)}
  params['embed'] = jnp.linspace(-2, 2, 20, dtype=jnp.bfloat16).reshape(5, 4)
  return jax.device_put(params, jax.devices()[0])


def run(tx, steps=6):
  params = tree()
  state = tx.init(params)
  step = jax.jit(tx.update)
  for i in range(steps):
    grads = jax.tree.map(
      lambda x, i=i: jnp.cos(x.astype(jnp.float32) * (i + 1)).astype(x.dtype),
      params,
    )
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def kinds(state):
  return [x.sharding.memory_kind for x in jax.tree.leaves(state.master)]


BASE = functools.partial(superoffload.adamw, 1e-2, bucket_bytes=200)


@pytest.mark.parametrize(
  ('device_buckets', 'expected'), [(0, 0), (2, 2), (0.5, 4), (1.0, 7)]
)
def test_device_buckets_split_state_and_match_default(device_buckets, expected):
  base, _ = run(BASE())
  got, state = run(BASE(device_buckets=device_buckets))
  for name in ('master', 'mu', 'nu'):
    # One leaf per bucket here (each leaf holds most of a 50-element one).
    placed = [
      x.sharding.memory_kind for x in jax.tree.leaves(getattr(state, name))
    ]
    assert placed.count('device') == expected, (name, placed)
    assert placed.count('pinned_host') == len(placed) - expected
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7),
    jax.tree.map(lambda x: x.astype(jnp.float32), got),
    jax.tree.map(lambda x: x.astype(jnp.float32), base),
  )


def test_device_buckets_are_the_last_to_arrive():
  params = tree()
  tx = BASE(device_buckets=1)
  state = tx.init(params)
  # Default arrival: reverse parameter order, so the first leaf ('embed')
  # arrives last and its bucket stays on the device.
  sizes = [
    x.size
    for x, k in zip(jax.tree.leaves(state.master), kinds(state), strict=True)
    if k == 'device'
  ]
  assert sizes == [20]
  # A user-given order: layer5's gradient arrives last.
  order = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  order.remove("['layer5']")
  order.append("['layer5']")
  state = BASE(device_buckets=1, arrival_order=order).init(params)
  sizes = [
    x.size
    for x, k in zip(jax.tree.leaves(state.master), kinds(state), strict=True)
    if k == 'device'
  ]
  assert sizes == [45]


def test_casting_sides_are_bit_identical():
  host, _ = run(BASE(cast='host'))
  device, _ = run(BASE(cast='device'))
  for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(device), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_auto_options_use_the_planner():
  got, state = run(BASE(cast='auto', device_buckets='auto'))
  base, _ = run(BASE())
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7),
    jax.tree.map(lambda x: x.astype(jnp.float32), got),
    jax.tree.map(lambda x: x.astype(jnp.float32), base),
  )
  assert set(kinds(state)) <= {'device', 'pinned_host'}


def test_bad_placement_options():
  with pytest.raises(ValueError, match='cast must be one of'):
    superoffload.adamw(1e-3, cast='gpu')
  with pytest.raises(ValueError, match='device_buckets must be'):
    superoffload.adamw(1e-3, device_buckets=-1)
  with pytest.raises(TypeError, match='device_buckets must be'):
    superoffload.adamw(1e-3, device_buckets='all')
  with pytest.raises(ValueError, match='arrival_order does not name'):
    superoffload.adamw(1e-3, device_buckets=1, arrival_order=['x']).init(tree())
