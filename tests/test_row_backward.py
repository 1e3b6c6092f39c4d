"""`row_backward.scan`: a layer scan whose backward loop is the library's.

Judged against JAX's own transpose of the same scan (a fully
rematerialized `jax.lax.scan`): the gradients must be those, bit for bit,
and the hook must see each row's gradient, in the stack, in the loop's
order (L-1 first), before the rows below it are written.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_superoffload._src.core import row_backward

L, D = 4, 16


def _layer(p, c, scale):
  h = jnp.tanh(c @ p['w'] + p['b']) * scale
  return h, jnp.sum(h, axis=-1)  # A per-layer output (ys) too.


def _inputs():
  k = jax.random.split(jax.random.key(3), 4)
  stacked = {
    'w': 0.3 * jax.random.normal(k[0], (L, D, D)),
    'b': 0.1 * jax.random.normal(k[1], (L, D)),
  }
  return stacked, jax.random.normal(k[2], (8, D)), jax.random.normal(k[3], (D,))


def _loss(run, stacked, x, scale):
  c, ys = run(stacked, x, scale)
  return jnp.sum(c**2) + jnp.sum(jnp.sin(ys))


def _jax_scan(stacked, x, scale):
  body = jax.checkpoint(lambda p, c: _layer(p, c, scale), prevent_cse=False)
  return jax.lax.scan(lambda c, p: body(p, c), x, stacked)


def _ours(seen):
  def run(stacked, x, scale):
    layer = lambda p, c: _layer(p, c, scale)  # noqa: E731
    fn, consts = row_backward.applies(layer, x, stacked)

    def on_row(aux, grads, i):
      # Rows i..L-1 of the stack are written, the rows below still zero.
      written = jnp.any(grads['w'] != 0, axis=(1, 2))
      jax.debug.callback(
        lambda i, w: seen.append((int(i), w.tolist())), i, written
      )
      return jax.tree.map(lambda g, a: g + 0 * a, grads, aux)

    aux = jax.tree.map(jnp.zeros_like, stacked)
    return row_backward.scan(fn, consts, x, stacked, on_row, aux)

  return run


def test_gradients_are_jaxs_own_and_the_hook_sees_each_row_in_order():
  stacked, x, scale = _inputs()
  seen = []
  want = jax.jit(
    jax.grad(lambda s, x: _loss(_jax_scan, s, x, scale), argnums=(0, 1))
  )(stacked, x)
  got = jax.jit(
    jax.grad(lambda s, x: _loss(_ours(seen), s, x, scale), argnums=(0, 1))
  )(stacked, x)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert [i for i, _ in seen] == [3, 2, 1, 0]
  for i, written in seen:
    assert written == [r >= i for r in range(L)], (i, written)


def test_the_forward_is_the_scans():
  stacked, x, scale = _inputs()
  want = _jax_scan(stacked, x, scale)
  got = _ours([])(stacked, x, scale)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_layer_closing_over_a_differentiated_value_is_not_taken():
  stacked, x, scale = _inputs()
  taken = []

  def loss(scale):
    layer = lambda p, c: _layer(p, c, scale)  # noqa: E731
    taken.append(row_backward.applies(layer, x, stacked) is not None)
    return jnp.sum(_jax_scan(stacked, x, scale)[0])

  jax.grad(loss)(scale)
  assert taken == [False]


@pytest.mark.parametrize('what', ['int_carry', 'int_ys'])
def test_integer_carries_and_outputs_are_not_taken(what):
  stacked, x, _ = _inputs()
  if what == 'int_carry':
    layer = lambda p, c: ((jnp.tanh(c[0] @ p['w']), c[1] + 1), None)  # noqa: E731
    carry = (x, jnp.zeros((), jnp.int32))
  else:
    layer = lambda p, c: (jnp.tanh(c @ p['w']), jnp.argmax(c))  # noqa: E731
    carry = x
  assert row_backward.applies(layer, carry, stacked) is None
