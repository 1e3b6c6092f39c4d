"""The optax-shaped API: adam/adamw as optax spells them, plus `Offload`."""

import dataclasses
import inspect
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload
from jax_superoffload._src.planning import planner

LR = 1e-2


def params_and_grads():
  params = {f'w{i}': jnp.linspace(-1.0, 1.0, 40 + i) for i in range(4)}
  params['b'] = jnp.linspace(-2, 2, 20, dtype=jnp.bfloat16).reshape(5, 4)
  grads = [
    jax.tree.map(lambda x, t=t: jnp.cos(x * (t + 1)).astype(x.dtype), params)
    for t in range(4)
  ]
  return params, grads


def final_params(tx, params, grads):
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in grads:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def assert_same_bits(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('name', ['adam', 'adamw'])
def test_the_signature_is_optax_then_offload(name):
  ours = list(
    inspect.signature(getattr(superoffload, name)).parameters.values()
  )
  theirs = list(inspect.signature(getattr(optax, name)).parameters.values())
  spelled = [(p.name, p.kind, p.default) for p in ours[: len(theirs)]]
  assert spelled == [(p.name, p.kind, p.default) for p in theirs]
  offload = ours[len(theirs)]
  assert (offload.name, offload.kind, offload.default) == (
    'offload',
    inspect.Parameter.KEYWORD_ONLY,
    None,
  )
  # The rest are the deprecated keywords, one per field of Offload.
  rest = [p.name for p in ours[len(theirs) + 1 :]]
  assert rest == [f.name for f in dataclasses.fields(superoffload.Offload)]


def test_adam_is_adamw_without_decay():
  params, grads = params_and_grads()
  got, _ = final_params(superoffload.adam(LR), params, grads)
  want, _ = final_params(
    superoffload.adamw(LR, weight_decay=0.0), params, grads
  )
  assert_same_bits(got, want)


OLD_SPELLINGS = [
  dict(executor='xla_host'),
  dict(bucket_bytes=64, device_buckets=1),
  dict(clip_norm=0.5, skip_nonfinite=True),
  dict(cast='device', bucket_bytes=128),
]


@pytest.mark.parametrize('old', OLD_SPELLINGS, ids=str)
def test_the_old_keywords_warn_and_do_what_offload_does(old):
  params, grads = params_and_grads()
  with pytest.warns(DeprecationWarning) as record:
    tx_old = superoffload.adamw(LR, weight_decay=0.1, **old)
  message = str(record[0].message)
  assert 'offload=superoffload.Offload(' in message, message
  for key in old:
    assert key in message
  with warnings.catch_warnings():
    warnings.simplefilter('error', DeprecationWarning)
    tx_new = superoffload.adamw(
      LR, weight_decay=0.1, offload=superoffload.Offload(**old)
    )
  got, got_state = final_params(tx_old, params, grads)
  want, want_state = final_params(tx_new, params, grads)
  assert_same_bits(got, want)
  assert_same_bits(got_state, want_state)


def test_offload_and_old_keywords_together_are_refused():
  with pytest.raises(TypeError, match='offload= and the keywords'):
    superoffload.adam(LR, offload=superoffload.Offload(), executor='xla_host')


def test_offload_is_frozen_and_compares_by_value():
  offload = superoffload.Offload(arrival_order=['a', 'b'])
  assert offload.arrival_order == ('a', 'b')
  assert offload == superoffload.Offload(arrival_order=('a', 'b'))
  assert hash(superoffload.Offload()) == hash(superoffload.Offload())
  with pytest.raises(dataclasses.FrozenInstanceError):
    offload.executor = 'ffi'
  with pytest.raises(TypeError):
    superoffload.Offload('ffi')  # Keywords only.


@pytest.mark.parametrize(
  ('fields', 'error', 'match'),
  [
    (dict(executor='gpu'), ValueError, 'executor must be one of'),
    (dict(cast='gpu'), ValueError, 'cast must be one of'),
    (dict(device_buckets=-1), ValueError, 'device_buckets must be'),
    (dict(bucket_bytes=2), ValueError, 'bucket_bytes must be'),
    (dict(clip_norm=0.0), ValueError, 'clip_norm must be'),
    (dict(nu_dtype=jnp.float16), ValueError, 'nu_dtype must be'),
    (
      dict(moments_8bit=True, nu_dtype=jnp.bfloat16),
      ValueError,
      'moments_8bit',
    ),
    (dict(shard_axis='data'), ValueError, 'mesh and shard_axis go together'),
  ],
)
def test_offload_is_checked_when_made(fields, error, match):
  with pytest.raises(error, match=match):
    superoffload.Offload(**fields)


def test_an_injected_clip_norm_through_offload():
  def clipped(learning_rate, clip_norm):
    offload = superoffload.Offload(clip_norm=clip_norm)
    return superoffload.adamw(learning_rate, offload=offload)

  params, grads = params_and_grads()
  tx = optax.inject_hyperparams(clipped)(LR, clip_norm=1.0)
  state = tx.init(params)
  assert 'clip_norm' in state.hyperparams
  step = jax.jit(tx.update)
  for t, g in enumerate(grads):
    state.hyperparams['clip_norm'] = jnp.asarray(0.5 + 0.25 * t)
    _, state = step(g, state, params)
  assert step._cache_size() <= 2  # init's placement, then a step's.


_NO_PLANNER = """
import sys
import jax.numpy as jnp
import jax_superoffload as superoffload

params = {'w': jnp.ones((4, 3)), 'b': jnp.zeros(3)}
tx = superoffload.adamw(1e-3)
state = tx.init(params)
updates, state = tx.update(params, state, params)
updates['w'].block_until_ready()
planning = [m for m in sys.modules if m.endswith(('.planner', '.cost_model'))]
print('PLANNING', planning)
"""


def test_a_default_optimizer_never_imports_the_planner():
  out = subprocess.run(
    [sys.executable, '-c', _NO_PLANNER],
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  ).stdout
  assert 'PLANNING []' in out, out


def test_a_traced_update_reads_the_auto_choices_from_the_state(monkeypatch):
  offload = superoffload.Offload(
    device_buckets='auto', cast='auto', bucket_bytes=200
  )
  tx = superoffload.adamw(LR, offload=offload)
  params, grads = params_and_grads()
  state = tx.init(params)  # Plans, once for this tree.
  assert state.placement is not None
  assert jax.eval_shape(tx.init, params).placement == state.placement

  def refuse(*args, **kwargs):
    raise AssertionError('the planner ran')

  monkeypatch.setattr(planner, 'plan', refuse)
  with pytest.raises(AssertionError, match='the planner ran'):
    tx.init(params)  # The patch is where "auto" plans.
  step = jax.jit(tx.update)
  for g in grads:  # Traced once, then run: no planning either way.
    _, state = step(g, state, params)
  assert int(state.count) == len(grads)
