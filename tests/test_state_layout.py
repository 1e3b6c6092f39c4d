"""A state that optax-aware code reads as optax's.

optax's adam/adamw state is a tuple whose first element is
`ScaleByAdamState(count, mu, nu)`; code written for it reads
`opt_state[0].mu` (Flax's SPMD examples, optax's tree_utils tests). Ours
has the same first element, the master weights and the rest beside it.
Old checkpoints (the flat layout before) restore through
`legacy_layout` / `from_legacy_layout`: the fixture under tests/data was
written by the old code (tests/data/make_legacy_state_ckpt.py says how).
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload

_DATA = pathlib.Path(__file__).resolve().parent / 'data'


def _params():
  rng = np.random.default_rng(0)
  return {
    'b': jnp.asarray(rng.standard_normal(5), jnp.float32),
    'w': jnp.asarray(rng.standard_normal((4, 5)), jnp.float32),
  }


def _grads(params, k):
  return jax.tree.map(lambda p: jnp.cos(p * (k + 1)) - 0.2, params)


def _run(tx, params, steps):
  state = tx.init(params)
  for k in range(steps):
    updates, state = tx.update(_grads(params, k), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _same_bits(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _close(ours, theirs):
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), 1e-5, 1e-7)


def test_first_element_is_optax_scale_by_adam_state():
  params = _params()
  _, state = _run(superoffload.adamw(1e-2, weight_decay=1e-2), params, 3)
  _, theirs = _run(optax.adamw(1e-2, weight_decay=1e-2), params, 3)
  adam = state[0]
  assert isinstance(adam, optax.ScaleByAdamState)
  assert isinstance(theirs[0], optax.ScaleByAdamState)
  assert int(adam.count) == int(theirs[0].count) == 3
  # Param-shaped, and the moments themselves (what export_adam_state gives).
  exported = superoffload.export_adam_state(state)
  _same_bits(adam.mu, exported.mu)
  _same_bits(adam.nu, exported.nu)
  _close(adam.mu, theirs[0].mu)
  _close(adam.nu, theirs[0].nu)
  # The attribute reads of before still work, and agree with it.
  assert state.mu is adam.mu and state.nu is adam.nu
  assert state.count is adam.count
  assert jax.tree.structure(state.master) == jax.tree.structure(params)


def test_tree_get_finds_one_of_each_name():
  params = _params()
  tx = superoffload.adamw(1e-2)
  _, state = _run(tx, params, 2)
  for name in ('mu', 'nu', 'count'):
    found = optax.tree_utils.tree_get_all_with_path(state, name)
    assert len(found) == 1, (name, [p for p, _ in found])
    assert found[0][1] is getattr(state[0], name)
  got = optax.tree_utils.tree_get(state, 'ScaleByAdamState')
  assert isinstance(got, optax.ScaleByAdamState) and got is state[0]
  assert optax.tree_utils.tree_get(state, 'master') is state.master
  # tree_set reaches the moments as it does optax's.
  zeros = jax.tree.map(jnp.zeros_like, params)
  changed = optax.tree_utils.tree_set(state, mu=zeros)
  assert isinstance(changed[0], optax.ScaleByAdamState)
  _same_bits(changed[0].mu, zeros)
  _same_bits(changed.master, state.master)


def test_tree_map_params_maps_the_moments_as_optax_s():
  params = _params()
  tx, otx = superoffload.adamw(1e-2), optax.adamw(1e-2)
  _, state = _run(tx, params, 1)
  _, theirs = _run(otx, params, 1)
  f = lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)  # noqa: E731
  mapped = optax.tree_map_params(tx, f, state)
  mapped_theirs = optax.tree_map_params(otx, f, theirs)
  assert isinstance(mapped[0], optax.ScaleByAdamState)
  assert mapped[0].mu == mapped_theirs[0].mu
  assert mapped[0].nu == mapped_theirs[0].nu
  assert mapped.master == mapped_theirs[0].mu  # Param-shaped as well.


def _path_to_adam(state):
  """The key path of the one ScaleByAdamState in `state`."""
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
  found = [
    p
    for p, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_adam)[0]
    if is_adam(x)
  ]
  assert len(found) == 1, found
  return found[0]


def _follow(tree, path):
  """`tree` read along `path` by index and attribute, as user code does."""
  for key in path:
    if isinstance(key, jax.tree_util.SequenceKey):
      tree = tree[key.idx]
    elif isinstance(key, jax.tree_util.GetAttrKey):
      tree = getattr(tree, key.name)
    else:
      tree = tree[key.key]
  return tree


_WRAPPERS = {
  'plain': lambda adamw: adamw,
  'chain_clip': lambda adamw: optax.chain(
    optax.clip_by_global_norm(1.0), adamw
  ),
  'multisteps_chain': lambda adamw: optax.MultiSteps(
    optax.chain(optax.clip_by_global_norm(1.0), adamw), 2
  ),
}


@pytest.mark.parametrize('wrap', sorted(_WRAPPERS))
def test_wrapped_state_is_read_where_optax_s_is(wrap):
  params = _params()
  tx = _WRAPPERS[wrap](superoffload.adamw(1e-2))
  otx = _WRAPPERS[wrap](optax.adamw(1e-2))
  _, state = _run(tx, params, 4)
  _, theirs = _run(otx, params, 4)
  path = _path_to_adam(theirs)  # e.g. .inner_opt_state[1][0]
  adam = _follow(state, path)
  assert isinstance(adam, optax.ScaleByAdamState)
  assert int(adam.count) == int(_follow(theirs, path).count)
  _close(adam.mu, _follow(theirs, path).mu)
  _close(adam.nu, _follow(theirs, path).nu)
  _same_bits(
    optax.tree_utils.tree_get(state, 'mu'),
    superoffload.export_adam_state(_follow(state, path[:-1])).mu,
  )


def test_replace_sets_fields_of_either_part():
  state = superoffload.adam(1e-3).init(_params())
  row = jnp.ones([], jnp.int32)
  new = state.replace(count=row, skipped=row)
  assert new.count is row and new.skipped is row and new.mu is state.mu
  assert isinstance(new[0], optax.ScaleByAdamState)
  with pytest.raises(TypeError, match=r"no field\(s\) \['moo'\]"):
    state.replace(moo=1)


def fixture_module(name='make_legacy_state_ckpt'):
  spec = importlib.util.spec_from_file_location(name, _DATA / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_a_checkpoint_of_the_old_layout_restores_and_continues():
  """A checkpoint the old code wrote (tests/data) steps as the old code did.

  The fixture holds the state after two steps and the updates the old code
  computed for the third; the restored, converted state gives the same
  updates bit for bit.
  """
  ocp = pytest.importorskip('orbax.checkpoint')
  fixture = fixture_module()

  tx = fixture.tx()
  params = fixture.params0()
  like = {'params': params, 'opt_state': tx.init(params)}
  ckptr = ocp.StandardCheckpointer()
  with pytest.raises(ValueError, match='tree structures do not match'):
    ckptr.restore(_DATA / 'legacy_state_ckpt', like)
  old = ckptr.restore(
    _DATA / 'legacy_state_ckpt', superoffload.legacy_layout(like)
  )
  restored = superoffload.from_legacy_layout(old, like)
  assert jax.tree.structure(restored) == jax.tree.structure(like)
  state = restored['opt_state']
  assert isinstance(state[1][0], optax.ScaleByAdamState)
  assert int(state[1].count) == 2
  assert state[1].placement == like['opt_state'][1].placement
  for x, y in zip(
    jax.tree.leaves(state), jax.tree.leaves(like['opt_state']), strict=True
  ):
    assert x.sharding.memory_kind == y.sharding.memory_kind
  p = restored['params']
  updates, _ = tx.update(fixture.grads(p, 2), state, p)
  want = np.load(_DATA / 'legacy_state_next_updates.npz')
  _same_bits(updates, {k: want[k] for k in want.files})


def test_an_old_checkpoint_restores_into_a_stream_state_with_a_digest():
  """The stream executor's state has a `weights_digest` the old one lacks.

  Restored through the old layout, it gets a digest matching nothing (the
  first step compares the parameters on the host) and steps as the old
  code did, bit for bit.
  """
  ocp = pytest.importorskip('orbax.checkpoint')
  fixture = fixture_module()
  offload = superoffload.Offload(executor='stream')
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), superoffload.adamw(1e-2, offload=offload)
  )
  params = fixture.params0()
  like = {'params': params, 'opt_state': tx.init(params)}
  assert like['opt_state'][1].weights_digest is not None
  target = superoffload.legacy_layout(like)
  assert 'weights_digest' not in target['opt_state'][1]
  old = ocp.StandardCheckpointer().restore(_DATA / 'legacy_state_ckpt', target)
  restored = superoffload.from_legacy_layout(old, like)
  state = restored['opt_state']
  assert not np.any(np.asarray(state[1].weights_digest))
  p = restored['params']
  updates, new = tx.update(fixture.grads(p, 2), state, p)
  want = np.load(_DATA / 'legacy_state_next_updates.npz')
  _same_bits(updates, {k: want[k] for k in want.files})
  assert np.any(np.asarray(new[1].weights_digest))


def test_an_old_layout_state_is_refused_in_one_line():
  params = _params()
  tx = superoffload.adamw(1e-2)
  old = superoffload.legacy_layout(tx.init(params))
  assert isinstance(old, dict) and 'master' in old
  with pytest.raises(TypeError) as err:
    tx.update(_grads(params, 0), old, params)
  message = str(err.value)
  assert '\n' not in message
  assert 'superoffload.legacy_layout' in message
  assert 'superoffload.from_legacy_layout' in message
