"""`overlap_scan`'s rows read their parameters only when they changed.

For the rows of a scanned stack: the row steps in the loop take no
parameters; a re-seed of the stack before the loop (`reseed_rows`, one
call per decay group) reads them, a row at a time, and only where the
state's digest of the stack's parameters (weights_digest.py) says they are
not the weights the last step produced.
The numbers stay those of the step without the scope (test_overlap_scan.py
and the attack suites); these tests fail where the rows, or their
re-seed, read the parameters every step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_superoffload._src.optim import weights_digest
from tests import test_overlap_scan as base

TARGETS = {
  'row': 'custom_call_target="jax_superoffload_adam_step_row"',
  'reseed': 'custom_call_target="jax_superoffload_adam_reseed_rows"',
}


def _stack_ids(params) -> list[int]:
  """The ids of the stack's leaves (the rows' one digest group)."""
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(params)
  ]
  return [i for i, p in enumerate(paths) if "'blocks'" in p]


def _calls(hlo: str, kind: str) -> list[str]:
  return [line for line in hlo.splitlines() if TARGETS[kind] in line]


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_rows_take_no_parameters_and_reseed_before_the_loop(dtype):
  tx = base._tx()
  params = base._params(dtype)
  state = tx.init(params)
  step = base._step(tx, True, True)
  hlo = step.lower(params, state, base._batch(0)).compile().as_text()
  rows, reseeds = _calls(hlo, 'row'), _calls(hlo, 'reseed')
  assert rows and all('while/body' in x for x in rows), rows
  assert all('reseed = false' in x for x in rows), rows
  # One per decay group ('w' decays; 'b' and 'norm' do not), none in the
  # loop.
  assert len(reseeds) == 2, reseeds
  assert not any('while/body' in x for x in reseeds), reseeds


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.float16])
def test_after_a_scoped_step_the_next_parameters_match_the_digest(dtype):
  tx = base._tx()
  params = base._params(dtype)
  state = tx.init(params)
  step = base._step(tx, True, False)
  ids = _stack_ids(params)
  for i in range(3):
    params, state = step(params, state, base._batch(i))
    leaves = jax.tree.leaves(params)
    same = weights_digest.unchanged(
      state.weights_digest, [leaves[j] for j in ids], ids
    )
    assert bool(same), f'step {i}: the stack would be read again'
  moved = jax.tree.map(lambda p: p, params)
  moved['blocks'] = {**params['blocks'], 'b': params['blocks']['b'] + 1.0}
  leaves = jax.tree.leaves(moved)
  assert not bool(
    weights_digest.unchanged(
      state.weights_digest, [leaves[j] for j in ids], ids
    )
  ), 'changed parameters must not match'


def _masters(state) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(state.master['blocks'])]


def test_a_forged_digest_means_the_rows_read_no_parameters():
  """Changed stack parameters, a digest that says unchanged: not read.

  The rows then step from the master as it was (the step given the
  parameters it was made from, with the same gradients); with the state's
  own digest they re-seed from the changed ones. Fails where the rows or
  their re-seed read the parameters anyway (a copy per row on a GPU).
  """
  tx = base._tx()
  params = base._params()
  state = tx.init(params)
  blocks = jax.tree.map(lambda p: p * 0.5, params['blocks'])
  loaded = {**params, 'blocks': blocks}
  ids = _stack_ids(loaded)
  leaves = jax.tree.leaves(loaded)
  stack = [leaves[i] for i in ids]
  forged = state.replace(
    weights_digest=weights_digest.after_step(len(leaves), [(ids, stack, stack)])
  )
  x = base._batch(0)
  step = base._step(tx, True, False)
  honest = _masters(step(loaded, state, x)[1])
  skipped = _masters(step(loaded, forged, x)[1])
  # The same gradients (the loss at the loaded weights), the master as it
  # was: the parameters it was made from re-seed nothing.
  grads = jax.jit(jax.grad(base._loss))(loaded, x)
  _, want = jax.jit(tx.update)(grads, state, params)
  same = lambda xs, ys: all(  # noqa: E731
    np.array_equal(a, b) for a, b in zip(xs, ys, strict=True)
  )
  assert same(_masters(want), skipped)
  assert not same(honest, skipped)


def test_edited_weights_after_matching_steps_reseed_the_rows():
  """A digest that matched, then an edit: the next step reads and re-seeds.

  Bit for bit against the step without the scope, over steps where the
  digest matched (nothing read) and the edited one (read).
  """
  tx = base._tx()

  def edit(params):
    w = params['blocks']['w'].at[2, 5].set(3.0)
    return {**params, 'blocks': {**params['blocks'], 'w': w}}

  def run(scoped):
    params = base._params()
    state = tx.init(params)
    step = base._step(tx, scoped, False)
    for i in range(4):
      if i == 2:
        params = edit(params)
      params, state = step(params, state, base._batch(i))
    return jax.tree.map(np.asarray, (params, state))

  base._assert_bitwise(run(True), run(False))
