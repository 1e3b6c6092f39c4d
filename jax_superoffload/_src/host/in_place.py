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

SuperOffload's host steps still start as soon as their bucket's gradients
exist; only the device-side `params + updates` is made to wait for a token
that depends on every bucket's new master weights, hence on every gradient,
hence on every read of every weight. The token reaches each update through
a select whose predicate is always true but, with two buckets or more, not
provably so: XLA keeps it and fuses it into the update's loop, so it costs
no buffer and no pass. (With one bucket XLA folds it, which is harmless:
that bucket's step already depends on every gradient.)

Only leaves whose size is a multiple of 64 get the token. XLA:CPU compiles
a loop with a scalar operand (the token) over an element count its
partitions do not divide with a bounds check per element and no vectors,
about 4x slower: bench_step's 640 leaves of 104,857 parameters cost 1.54x
one leaf with the token and 1.27x without. Such leaves keep XLA's default,
which copies a weight that the backward pass reads after its update could
start, as optax.adamw's step does.

Forms that did not work: a no-op `dynamic_update_slice` at an
always-clamped index wrote, for a bucket holding a single leaf, into a copy
of the whole master (bench_step's one-leaf step took 169 ms instead of
~62); an `optimization_barrier` over the new weights did not stop the
copies; a token in the host steps' count made every host step wait for the
whole backward pass, which kept every gradient alive (bench_train 19M:
temporaries 14.3 -> 73.2 MB, 18,937 page faults per step, 66.7 -> 83.8 ms).

Measured on the 2-core CPU VM (`experiments/bench_train.py`): at 19M
parameters the step's parameter copies went from 18 to 0 and its temporary
memory from 20.8 to 14.3 MB; optax.adamw's step time over ours went from
1.00, 0.98 and 0.96 to 1.09, 1.03 and 1.07 at 4.8M, 19M and 50M parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_superoffload._src.core import backend
from jax_superoffload._src.core import host_memory


def wanted(zero: object | None) -> bool:
  """Whether to order the updates: on the CPU backend, without ZeRO.

  On an accelerator the master weights live in host memory, where reading
  even one element is host compute, and the copies were never measured
  there; under ZeRO the token would need a collective. Both keep XLA's
  default (correct, possibly copying) behaviour.
  """
  return zero is None and backend.target() == 'cpu'


def token_after(masters: Sequence[jax.Array]) -> jax.Array:
  """An int32 scalar, always negative, that depends on every array given.

  One element of each (fp32) array is enough for the dependency; the bits
  are masked so that no value, NaN included, can make the result
  non-negative. The maximum is a reduction, which XLA computes once into
  its own scalar (a chain of scalar ops would be fused into, and recomputed
  by, every update loop) and whose range it does not analyse.
  """
  firsts = [host_memory.to_device(jnp.ravel(m)[:1]) for m in masters if m.size]
  if not firsts:
    return jnp.int32(-1)
  bits = jax.lax.bitcast_convert_type(jnp.concatenate(firsts), jnp.int32)
  return -1 - jnp.max(bits & 0x7FFFFFFF)


# Leaf sizes that get the token: divisible by the vector width and by the
# partition counts XLA:CPU picked on the 2-core VMs. A machine where it
# picks a count that does not divide 64 (say 12) compiles some of these
# loops the slow way too; that is unmeasured.
_TOKEN_MULTIPLE = 64


def after(x: jax.Array, token: jax.Array) -> jax.Array:
  """`x`, unchanged, as a value that depends on `token` (see module doc).

  Leaves whose size is not a multiple of 64 are returned as they are.
  """
  if x.size % _TOKEN_MULTIPLE:
    return x
  # `token` is always negative, so this selects `x`; XLA cannot prove it,
  # and fuses the select into the consumer's loop (no buffer, no pass).
  return jnp.where(token < 0, x, -x)
