"""bf16 and 8-bit moments with ZeRO (`mesh=`) and with sharded parameters.

The same gradients and parameters go through the transformation on one
device and over 8 (fake) devices; the moments are elementwise, or 8-bit
blocks that a shard holds whole, so every bit must agree. An 8-bit leaf
is split only where each shard is a run of whole 256-element blocks of the
leaf in row-major order (a leading-dimension split of a multiple of 256
elements a shard); the others are stepped whole on every device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_superoffload as superoffload

FORMATS = {
  'mu_bf16': dict(mu_dtype=jnp.bfloat16),
  'bf16': dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
  '8bit': dict(moments_8bit=True),
}
SHAPES = {
  'aligned': (64, 32),  # 256 elements a shard.
  'odd': (40,),  # 5 a shard: not whole blocks.
  'inner': (13, 40),  # Split along the second dimension: not one run.
  'wide': (8, 1024),
  'scalar': (),
}
# Parameter shardings for the "follow the parameters" runs.
SPECS = {
  'aligned': P('data', None),
  'odd': P('data'),
  'inner': P(None, 'data'),
  'wide': P('data', None),
  'scalar': P(),
}


def _mesh():
  return jax.make_mesh((8,), ('data',))


def _params() -> dict:
  rng = np.random.default_rng(0)
  return {
    k: jnp.asarray(rng.standard_normal(s), jnp.float32)
    for k, s in SHAPES.items()
  }


def _grads(rng, step: int) -> dict:
  """Step 1 is clipped under STV: +-8 everywhere, whose sum of squares is
  exact in fp32 in any order, so one device and 8 shards clip alike."""
  out = {}
  for k, s in SHAPES.items():
    g = rng.standard_normal(s)
    g = np.where(g < 0, -8.0, 8.0) if step == 1 else g * 1e-3
    out[k] = jnp.asarray(g, jnp.float32)
  return out


def _run(tx, put, steps=3):
  params = put(_params())
  state = tx.init(params)
  step = jax.jit(tx.update)
  rng = np.random.default_rng(1)
  for i in range(steps):
    updates, state = step(put(_grads(rng, i)), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _adamw(fmt, stv=False, **kw):
  return superoffload.adamw(
    1e-2,
    weight_decay=0.1,
    bucket_bytes=4096,  # Several buckets.
    clip_norm=1.0 if stv else None,
    skip_nonfinite=stv,
    **FORMATS[fmt],
    **kw,
  )


def _one_device(tree):
  return jax.device_put(tree, jax.devices()[0])


def _assert_same_bits(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('stv', [False, True])
@pytest.mark.parametrize('fmt', list(FORMATS))
def test_zero_equals_one_device_bit_for_bit(fmt, stv):
  mesh = _mesh()
  replicated = NamedSharding(mesh, P())
  one = _run(_adamw(fmt, stv), _one_device)
  sharded = _run(
    _adamw(fmt, stv, mesh=mesh, shard_axis='data'),
    lambda t: jax.device_put(t, replicated),
  )
  _assert_same_bits(one, sharded)
  state = sharded[1]
  if stv:
    assert int(state.redone) == 1


def test_8bit_leaves_are_split_only_in_whole_blocks():
  mesh = _mesh()
  _, state = _run(
    _adamw('8bit', mesh=mesh, shard_axis='data'),
    lambda t: jax.device_put(t, NamedSharding(mesh, P())),
    steps=1,
  )
  split = {'aligned', 'wide'}
  for name in SHAPES:
    for field in ('mu', 'nu', 'master'):
      x = getattr(state, field)[name]
      whole = not any(a is not None for a in x.sharding.spec)
      assert whole == (name not in split), (field, name, x.sharding.spec)
      if x.ndim:
        assert x.sharding.memory_kind == 'pinned_host'
    for field in ('mu_scales', 'nu_scales'):
      scales = getattr(state, field)[name]
      if name in split:  # One scale per block: 1/8 of them per device.
        assert tuple(scales.sharding.spec) == ('data',)
        for shard in scales.addressable_shards:
          assert shard.data.size * 8 == scales.size
  codes = state.mu['wide']
  assert {s.data.shape for s in codes.addressable_shards} == {(1, 1024)}


@pytest.mark.parametrize('fmt', list(FORMATS))
def test_state_follows_sharded_params_bit_for_bit(fmt):
  mesh = _mesh()

  def put(tree):
    return {
      k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
      for k, v in tree.items()
    }

  one = _run(_adamw(fmt), _one_device)
  followed = _run(_adamw(fmt), put)
  _assert_same_bits(one, followed)
  params, state = followed
  for name, spec in SPECS.items():
    whole_blocks = fmt != '8bit' or name in ('aligned', 'wide', 'scalar')
    want = spec if whole_blocks else P()
    got = state.mu[name].sharding.spec
    assert tuple(got) + (None,) * (len(want) - len(got)) == tuple(want) + (
      None,
    ) * (len(got) - len(want)), (name, got)
    assert params[name].sharding.spec == SPECS[name]


@pytest.mark.parametrize('fmt', ['bf16', '8bit'])
def test_following_whole_block_shards_gathers_nothing(fmt):
  mesh = _mesh()
  names = ('aligned', 'wide') if fmt == '8bit' else tuple(SPECS)
  params = {
    k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
    for k, v in _params().items()
    if k in names
  }
  tx = _adamw(fmt)
  state = tx.init(params)
  hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  assert not re.findall(r'all-gather(-start)?\(', hlo)
  # Each kernel call steps this device's shard: u8[8,32] of a (64, 32) leaf.
  calls = [
    line for line in hlo.splitlines() if 'custom_call_target="jax_super' in line
  ]
  local = '[8,32]'
  assert any(local in c for c in calls), calls
  assert not any('[64,32]' in c for c in calls), calls


@pytest.mark.parametrize('fmt', ['bf16', '8bit'])
def test_interchange_of_a_sharded_state_is_that_of_one_device(fmt):
  mesh = _mesh()
  replicated = NamedSharding(mesh, P())
  one_tx = _adamw(fmt)
  zero_tx = _adamw(fmt, mesh=mesh, shard_axis='data')
  _, one = _run(one_tx, _one_device)
  params, sharded = _run(zero_tx, lambda t: jax.device_put(t, replicated))
  exported = superoffload.export_adam_state(sharded)
  _assert_same_bits(superoffload.export_adam_state(one), exported)
  back = superoffload.import_adam_state(zero_tx, params, exported)
  _assert_same_bits(
    superoffload.export_adam_state(back), superoffload.export_adam_state(one)
  )
  assert back.mu['aligned'].sharding.is_equivalent_to(
    sharded.mu['aligned'].sharding, 2
  )
