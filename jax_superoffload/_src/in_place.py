"""Orders the weight updates after the backward pass, so XLA:CPU works in place.

In a donated training step, each new weight is written into its parameter's
buffer. XLA:CPU decides whether that is safe from data dependencies alone
(its copy insertion runs before the schedule exists): every other read of
the parameter must be an ancestor of the write. The backward pass reads a
weight twice, for its own gradient and for the gradient of the layer's
input, and the second read feeds only the *earlier* layers' gradients. An
update that depends on its own bucket's gradients is therefore unordered
with that read, and XLA copies the parameter at the start of the step: 8
bytes per parameter of memory traffic ahead of the forward pass
(optax.adamw's step pays the same copies).

So every bucket's host step waits for a token that depends on every
gradient, hence on every read of every weight, and the device-side
`params + updates` depends on the steps. The token enters through the
step's count, `count + (token >> 31) + 1` with a token that is always
negative but, to XLA, not provably so: a scalar the kernel reads anyway,
and nothing in the update loops. (A token that every update loop selected
on gave XLA:CPU a scalar operand in those loops, which it then compiles for
an odd number of elements with a bounds check per element and no vectors,
about 4x slower: bench_step's 640 odd leaves took 1.6x one leaf. An
`optimization_barrier` over the new weights did not stop the copies. A
`dynamic_update_slice` at an always-clamped index wrote, for a bucket
holding a single leaf, into a copy of the whole master.)

Measured on the 2-core CPU VM (`experiments/bench_train.py`): at 19M
parameters the step's parameter copies went from 18 to 0 and its temporary
memory from 20.8 to 14.3 MB; optax.adamw's step time over ours went from
1.00, 0.98 and 0.96 to 1.09, 1.03 and 1.07 at 4.8M, 19M and 50M parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def wanted(zero: object | None) -> bool:
  """Whether to order the updates: on the CPU backend, without ZeRO.

  On an accelerator the copies were never measured, and the barrier holds
  every update until the last bucket's weights have arrived; under ZeRO the
  weights are all-gathered first. Both keep XLA's default (correct,
  possibly copying) behaviour.
  """
  return zero is None and jax.default_backend() == 'cpu'


def count_after(count: jax.Array, grads: Sequence[jax.Array]) -> jax.Array:
  """`count`, unchanged, as a value that depends on every gradient given.

  One element of each gradient is enough for the dependency; the bits are
  masked so that no value, NaN included, can make the token non-negative.
  The maximum is a reduction, whose range XLA does not analyse.
  """
  firsts = [
    jnp.real(jnp.ravel(g)[:1]).astype(jnp.float32)
    for g in grads
    if g.size and jnp.issubdtype(g.dtype, jnp.inexact)
  ]
  if not firsts:
    return count
  bits = jax.lax.bitcast_convert_type(jnp.concatenate(firsts), jnp.int32)
  token = -1 - jnp.max(bits & 0x7FFFFFFF)
  count = jnp.asarray(count, jnp.int32)
  return count + jax.lax.shift_right_arithmetic(token, jnp.int32(31)) + 1
