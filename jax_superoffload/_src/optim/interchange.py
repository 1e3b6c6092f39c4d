"""Exact conversion between our state and optax's Adam state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import layout
from jax_superoffload._src.core import moments
from jax_superoffload._src.optim import state as state_lib


def export_adam_state(
  state: state_lib.SuperOffloadState,
) -> optax.ScaleByAdamState:
  """The count and moments of `state` as optax's `ScaleByAdamState`.

  `mu` and `nu` are trees like the parameters (their current rows when
  double-buffered by STV), in device memory; with them in place of the
  `ScaleByAdamState` of `optax.adamw(...).init(params)`, optax continues
  the run exactly where ours stood (up to the fp32 master, which optax does
  not keep). bf16 moments are exported as stored (nu widened to float32,
  exactly); 8-bit moments are decoded to the float32 values the step uses.

  Args:
    state: A `SuperOffloadState`.

  Returns:
    `optax.ScaleByAdamState(count, mu, nu)`.
  """
  if not isinstance(state, state_lib.SuperOffloadState):
    raise TypeError(f'expected a SuperOffloadState, got {type(state).__name__}')
  current = state.current()
  to_device = lambda t: jax.tree.map(host_memory.to_device, t)  # noqa: E731
  mu, nu = to_device(current.mu), to_device(current.nu)
  if state.mu_scales is not None:  # Decoded: the values the step uses.
    mu = _decoded(mu, to_device(state.mu_scales), signed=True)
    nu = _decoded(nu, to_device(state.nu_scales), signed=False)
  # bf16 second moments widen exactly to optax's float32.
  nu = jax.tree.map(
    lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, nu
  )
  return optax.ScaleByAdamState(
    count=host_memory.to_device(state.count), mu=mu, nu=nu
  )


def _decoded(codes: Any, scales: Any, signed: bool) -> Any:
  def leaf(c, s):
    if c.dtype != jnp.uint8:  # A leaf on optax's path.
      return c
    return moments.dequantize(moments.Blockwise(c, s), signed)

  return jax.tree.map(leaf, codes, scales)


def _find_adam(optax_state: Any) -> optax.ScaleByAdamState:
  found = [
    x
    for x in jax.tree.leaves(
      optax_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
    )
    if isinstance(x, optax.ScaleByAdamState)
  ]
  if len(found) != 1:
    raise ValueError(
      'import_adam_state needs an optax state holding exactly one '
      f'ScaleByAdamState (as optax.adam/adamw make), found {len(found)}'
    )
  return found[0]


def _like(
  new: Any, ours: jax.Array, path: str, name: str, param: Any
) -> jax.Array:
  """`new` (a parameter-shaped leaf) in the dtype and place of `ours`.

  But for the floating `mu` optax's step leaves on an integer or bool
  parameter `param` (see state._mu_turned_floating): kept as it is.
  """
  shape = tuple(ours.shape)
  if tuple(np.shape(new)) not in (shape, shape[1:]):
    raise ValueError(
      f'optax state {name} leaf {path} has shape {tuple(np.shape(new))}, '
      f'the parameter needs {shape}'
    )
  # Never the caller's buffer; 8-bit codes are made from fp32 (_encoded).
  dtype = jnp.float32 if ours.dtype == jnp.uint8 else ours.dtype
  _, param_dtype = layout.shape_dtype(param)
  if (
    name == 'mu'
    and not jnp.issubdtype(param_dtype, jnp.inexact)
    and jnp.issubdtype(jnp.result_type(new), jnp.inexact)
  ):
    dtype = jnp.result_type(new)
  x = jnp.array(new, dtype, copy=True)
  if x.shape != shape:  # Both rows of a double-buffered leaf.
    x = jnp.broadcast_to(x[None], shape)
  if ours.dtype == jnp.uint8:  # Encoded on the device, then placed.
    return x
  return jax.device_put(x, ours.sharding)


def import_adam_state(
  tx: optax.GradientTransformation,
  params: optax.Params,
  optax_state: optax.OptState,
) -> state_lib.SuperOffloadState:
  """Our state for `params`, continuing an optax Adam/AdamW run exactly.

  Args:
    tx: `superoffload.adam(...)` or `adamw(...)`.
    params: The parameters (the master weights start from them).
    optax_state: Any optax state holding exactly one `ScaleByAdamState`,
      e.g. that of `optax.adamw(...)`; its count and moments are taken.

  Returns:
    A `SuperOffloadState` with that count and those moments: exact for fp32
    moments (and for a bf16 `mu` from optax's `mu_dtype=jnp.bfloat16`);
    rounded to the storage of bf16 or 8-bit moments otherwise (lossy).
  """
  state = tx.init(params)
  if not isinstance(state, state_lib.SuperOffloadState):
    raise TypeError(
      'import_adam_state needs superoffload.adam/adamw as tx, whose init '
      f'returned {type(state).__name__}'
    )
  adam = _find_adam(optax_state)
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(params)[0]
  ]
  leaves, treedef = jax.tree.flatten(params)
  moments_in = {}
  for name in ('mu', 'nu'):
    # Leaf by leaf: the container types may differ (a flax State holding
    # the params, a dict holding the moments), the order and shapes not.
    theirs = jax.tree.leaves(getattr(adam, name))
    ours = jax.tree.leaves(getattr(state, name))
    if len(theirs) != len(ours):
      raise ValueError(
        f'optax state {name} has {len(theirs)} leaves, the parameters '
        f'{len(ours)}'
      )
    moments_in[name] = [
      _like(t, o, p, name, x)
      for t, o, p, x in zip(theirs, ours, paths, leaves, strict=True)
    ]
  fields = {n: jax.tree.unflatten(treedef, xs) for n, xs in moments_in.items()}
  if state.mu_scales is not None:
    fields.update(_encoded(state, treedef, moments_in))
  count = jax.device_put(
    jnp.asarray(adam.count, jnp.int32), state.count.sharding
  )
  return state.replace(count=count, **fields)


def _encoded(state, treedef, moments_in: dict) -> dict:
  """8-bit moments from fp32 ones (lossy: each rounded to its code)."""
  fields = {}
  for name, signed in (('mu', True), ('nu', False)):
    codes, scales = [], []
    ours = jax.tree.leaves(getattr(state, name))
    old_scales = jax.tree.leaves(getattr(state, f'{name}_scales'))
    for x, o, s in zip(moments_in[name], ours, old_scales, strict=True):
      if o.dtype != jnp.uint8:  # A leaf on optax's path.
        codes.append(x)
        scales.append(s)
        continue
      q = moments.quantize(x, signed)
      codes.append(jax.device_put(q.codes, o.sharding))
      scales.append(jax.device_put(q.scales, s.sharding))
    fields[name] = jax.tree.unflatten(treedef, codes)
    fields[f'{name}_scales'] = jax.tree.unflatten(treedef, scales)
  return fields
