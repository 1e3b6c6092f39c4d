"""Orders the weight updates after the backward pass, so XLA:CPU works in place.

In a donated training step, each new weight is written into its parameter's
buffer. XLA:CPU decides whether that is safe from data dependencies alone
(its copy insertion runs before the schedule exists): every other read of
the parameter must be an ancestor of the write. The backward pass reads a
weight twice, for its own gradient and for the gradient of the layer's
input, and the second read feeds only the *earlier* layers' gradients. An
update that depends on its own bucket's gradients is therefore unordered
with that read, and XLA copies the parameter at the start of the step: 8
bytes per parameter of memory traffic ahead of the forward pass, and a
temporary the size of the model (optax.adamw pays the same copies).

SuperOffload's host steps still start as soon as their bucket's gradients
exist; only the device-side `params + updates` is made to wait for a token
that depends on every bucket's new master weights, hence on every gradient,
hence on every read of every weight. The token reaches each update through
a `dynamic_update_slice` that writes an element over itself at an index
that is always clamped to 0: a no-op that XLA cannot fold, and that it
fuses into the update's loop, so it costs no buffer and no pass.

Measured on the 2-core CPU VM (`experiments/bench_train.py`): at 19M
parameters the step's parameter copies went from 18 to 0 and its temporary
memory from 20.8 to 14.3 MB; optax.adamw's time over ours went from 0.98 to
1.05 at 19M and from 0.96 to 1.12 at 50M parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_superoffload._src import host_memory


def wanted(zero: object | None) -> bool:
  """Whether to order the updates: on the CPU backend, without ZeRO.

  On an accelerator the master weights live in host memory, where reading
  even one element is host compute, and the copies were never measured
  there; under ZeRO the token would need a collective. Both keep XLA's
  default (correct, possibly copying) behaviour.
  """
  return zero is None and jax.default_backend() == 'cpu'


def token_after(masters: Sequence[jax.Array]) -> jax.Array:
  """An int32 scalar, always negative, that depends on every array given.

  One element of each (fp32) array is enough for the dependency; the bits
  are masked so that no value, NaN included, can make the result
  non-negative.
  """
  bits = [
    jax.lax.bitcast_convert_type(
      host_memory.to_device(jnp.ravel(m)[:1]), jnp.int32
    )
    & 0x7FFFFFFF
    for m in masters
    if m.size
  ]
  if not bits:
    return jnp.int32(-1)
  return (-1 - functools.reduce(jnp.maximum, bits))[0]


def after(x: jax.Array, token: jax.Array) -> jax.Array:
  """`x`, unchanged, as a value that depends on `token` (see module doc)."""
  if x.size == 0:
    return x
  flat = x.reshape(-1)
  # `token` < 0 is clamped to 0: element 0 is written over itself.
  flat = jax.lax.dynamic_update_slice(flat, flat[:1], (token,))
  return flat.reshape(x.shape)
