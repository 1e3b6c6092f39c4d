"""The stream join target as Python calls it, on the CPU backend.

On a GPU the join waits for the step's stream launches; on the CPU, where
every step has run before its call returned, its aliased results are an
identity (xla_ffi/stream_launch.h). Operands past those only order it. A
call whose results do not alias is refused: on a GPU the aliases are what
keep the launches' device results alive until the join.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_superoffload import _grace_adam
from jax_superoffload._src.host import grace_adam


def _join(*xs, aliased=True, extra=()):
  return jax.ffi.ffi_call(
    grace_adam.STREAM_JOIN_TARGET,
    [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs],
    input_output_aliases={i: i for i in range(len(xs))} if aliased else None,
  )(*xs, *extra)


def _operands():
  rng = np.random.default_rng(37)
  return (
    jnp.asarray(rng.standard_normal((64, 3)), jnp.float32),
    jnp.asarray(rng.standard_normal(129), jnp.bfloat16),
    jnp.float32(np.nan),
    jnp.arange(5, dtype=jnp.int32),
    jnp.zeros((1,), jnp.float32) - 0.0,
  )


def test_join_is_an_identity_bit_for_bit():
  xs = _operands()
  got = jax.jit(lambda *xs: _join(*xs))(*xs)
  assert len(got) == len(xs)
  for x, y in zip(xs, got, strict=True):
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.asarray(y).tobytes() == np.asarray(x).tobytes()


def test_join_results_feed_later_computation():
  x = jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32)

  @jax.jit
  def step(x):
    (y,) = _join(x * 3.0)
    return y + 1.0

  assert np.asarray(step(x)).tobytes() == np.asarray(x * 3.0 + 1.0).tobytes()


def test_join_ordering_operands_are_only_read():
  xs = _operands()[:2]
  barrier = jnp.int32(-7)

  @jax.jit
  def join(xs, barrier):
    return _join(*xs, extra=(barrier, xs[0]))

  got = join(xs, barrier)
  assert len(got) == len(xs)
  for x, y in zip(xs, got, strict=True):
    assert np.asarray(y).tobytes() == np.asarray(x).tobytes()


def test_join_without_aliases_is_refused():
  x = jnp.ones(8, jnp.float32)
  with pytest.raises(Exception, match='must alias operand 0'):
    jax.block_until_ready(jax.jit(lambda x: _join(x, aliased=False))(x))


@pytest.mark.parametrize(
  ('name', 'target'),
  [
    ('jax_superoffload_stream_join', grace_adam.STREAM_JOIN_TARGET),
    ('jax_superoffload_stream_to_device', grace_adam.STREAM_TO_DEVICE_TARGET),
  ],
)
def test_filed_for_both_platforms(name, target):
  assert name == target
  assert name in _grace_adam.registrations()
  assert name in _grace_adam.stream_registrations()


def test_no_staging_without_a_stream_launch():
  assert _grace_adam.stream_staging_allocations() == 0


# The copy of joined results to the device (after the join, by a call of
# its own: XLA keeps every result of the join in host memory). On the CPU
# a plain copy, bit for bit, NaN and -0.0 included.
def test_to_device_copies_bit_for_bit():
  xs = _operands()
  got = jax.jit(lambda *xs: grace_adam._to_device(list(_join(*xs))))(*xs)
  for x, y in zip(xs, got, strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(
      np.asarray(x).reshape(-1).view(np.uint8),
      np.asarray(y).reshape(-1).view(np.uint8),
    )


def test_to_device_of_another_size_is_refused():
  x = jnp.ones(8, jnp.float32)
  call = jax.ffi.ffi_call(
    grace_adam.STREAM_TO_DEVICE_TARGET, jax.ShapeDtypeStruct((4,), jnp.float32)
  )
  with pytest.raises(Exception, match="must have operand 0's size"):
    jax.block_until_ready(jax.jit(call)(x))


# A bucket step through `_joined` with a join forced on (as on a GPU):
# the state is the step's without one, bit for bit, and the new weights
# the join's copy brings back are its new masters (on the CPU both run the
# same kernel at once).
def test_a_joined_step_copies_back_the_new_masters():
  rng = np.random.default_rng(7)
  shapes = [(16, 8), (5,)]
  grads = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
  hyper = grace_adam.Hyperparams(
    count=jnp.int32(1), learning_rate=1e-2, weight_decay=0.1
  )

  def step(join):
    place = grace_adam.StreamPlace(join=join)
    master = [jnp.full(s, 0.5, jnp.float32) for s in shapes]
    zeros = [jnp.zeros(s, jnp.float32) for s in shapes]
    return grace_adam.adam_step_segments(
      master, zeros, list(zeros), grads, None, hyper, place=place
    )

  plain, joined = jax.jit(lambda: step(False))(), jax.jit(lambda: step(True))()
  assert plain[3] == [] and len(joined[3]) == len(shapes)
  for a, b in zip(plain[:3], joined[:3], strict=True):
    for x, y in zip(a, b, strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for master, copied in zip(plain[0], joined[3], strict=True):
    assert not np.array_equal(np.asarray(master), np.full(master.shape, 0.5))
    np.testing.assert_array_equal(
      np.asarray(master).ravel(), np.asarray(copied).ravel()
    )
