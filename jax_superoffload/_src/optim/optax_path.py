"""optax's path: the leaves the kernel does not cover, by optax's own Adam.

float64 and complex leaves, integer and bool ones, and those of a moment
dtype the kernel does not take are stepped on the device with
`optax.scale_by_adam` and adamw's weight decay and learning rate, as
`optax.adamw` steps them (its updates and state, values and dtypes). The
update's `_optax_leaves` gives them their inputs and places their state.

The same operations as optax's, so the same numbers where XLA compiles
them alike. It does not always: optax divides each moment by one
`1 - b ** count` (optax.tree.bias_correction), and XLA:CPU rounds that
power an ulp apart depending on the graph around it (fused into the loop
of its one consumer, or computed apart when several leaves share it), so
optax's own update of a leaf differs by an ulp between two trees holding
it, and between eager and `jax.jit` (tests/test_dropin_kinds_int.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src.core import layout

# A leaf stepped beside a lone leaf of ours from a larger tree, so that
# optax's eager bias correction has several consumers, as in optax's own
# tree (see the module's docstring); under `jax.jit` it is dead code.
_BESIDE = np.zeros((1,), np.float32)


def step(
  opts: Any,
  lay: layout.Layout,
  ids: Sequence[int],
  count: jax.Array,
  grads: list[Any],
  params: list[Any],
  old: dict[str, list[jax.Array]],
) -> tuple[list[jax.Array], dict[str, list[jax.Array]]]:
  """`optax.adamw`'s math on leaves `ids`: their updates and new state.

  `opts`: the optimizer's `Options`; `grads` and `params` as given (Python
  scalars too), `old` their `master`, `mu` and `nu` on the device.

  The updates in a floating parameter's dtype, in the dtype of optax's
  math for integer and bool ones (whose `mu` then turns floating, as
  optax's does).
  """
  adam = optax.scale_by_adam(
    opts.b1,
    opts.b2,
    opts.eps,
    opts.eps_root,
    mu_dtype=opts.mu_dtype,
    nesterov=opts.nesterov,
  )
  mu, nu = old['mu'], old['nu']
  if len(ids) == 1 and len(lay.dtypes) > 1:  # See _BESIDE.
    grads, mu, nu = ([*xs, _BESIDE] for xs in (grads, mu, nu))
  u, adam_state = adam.update(grads, optax.ScaleByAdamState(count, mu, nu))
  u, adam_state = (
    u[: len(ids)],
    adam_state._replace(
      mu=adam_state.mu[: len(ids)], nu=adam_state.nu[: len(ids)]
    ),
  )
  hyper = opts.hyperparams(count)
  lr, wd = hyper.learning_rate, hyper.weight_decay
  decay = lay.fallback_decay
  u = [x + wd * p if d else x for x, p, d in zip(u, params, decay, strict=True)]
  u = [
    (-lr * x).astype(lay.dtypes[i]) if floating(lay, i) else -lr * x
    for x, i in zip(u, ids, strict=True)
  ]
  new = {
    'master': [
      optax.apply_updates(p, x) for p, x in zip(params, u, strict=True)
    ],
    'mu': list(adam_state.mu),
    'nu': list(adam_state.nu),
  }
  return u, new


def floating(lay: layout.Layout, i: int) -> bool:
  """Whether leaf i's parameter is floating (else integer or bool)."""
  return jnp.issubdtype(lay.dtypes[i], jnp.inexact)
