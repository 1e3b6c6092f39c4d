"""`adam` / `adamw`: Optax transformations with host-resident Adam state."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src import adam_args
from jax_superoffload._src import executors
from jax_superoffload._src import host_memory
from jax_superoffload._src import layout

DEFAULT_BUCKET_BYTES = 256 * 2**20


class SuperOffloadState(NamedTuple):
  """State of `superoffload.adam` / `adamw`.

  Attributes:
    count: Steps taken (int32 scalar), as in optax's `ScaleByAdamState`.
    mu: First moments, fp32 buckets in host memory.
    nu: Second moments, fp32 buckets in host memory.
    master: fp32 master weights, buckets in host memory.
    fallback: optax state for leaves the kernel does not cover (float64 or
      complex parameters, or a non-fp32 `mu_dtype`), in host memory.
  """

  count: jax.Array
  mu: tuple[jax.Array, ...]
  nu: tuple[jax.Array, ...]
  master: tuple[jax.Array, ...]
  fallback: optax.OptState


def _kernel_grad(g: jax.Array) -> jax.Array:
  # The kernel reads f32, bf16 and f16 gradients as stored; others (e.g. a
  # float64 gradient of an f32 parameter) are converted on the device.
  if g.dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    return g
  return g.astype(jnp.float32)


def _exact_delta(new: jax.Array, old: jax.Array) -> jax.Array:
  """An update `u` with `old + u == new` in fp32, so apply_updates is exact.

  `new - old` alone can round when a weight changes by more than half its
  magnitude (outside Sterbenz's lemma); one correction step recovers the
  residual. Low-precision parameters get fp32 updates: optax.apply_updates
  adds in fp32 and casts the sum, which is then exactly `new`.
  """
  new32, old32 = new.astype(jnp.float32), old.astype(jnp.float32)
  u = new32 - old32
  u = u + (new32 - (old32 + u))
  return u


def _state_to_host(x: jax.Array) -> jax.Array:
  # Scalars (the fallback's step counts) stay on the device: they are 4
  # bytes, and JAX drops the host memory space of 0-d results of
  # `jnp.where`, which wrappers such as optax.MultiSteps apply to the state.
  # Committed either way, so a second call does not recompile.
  if jnp.ndim(x) > 0:
    return host_memory.to_host(x)
  return host_memory.to_device(x)


def _validate_options(
  learning_rate, b1, b2, eps, eps_root, weight_decay, bucket_bytes
) -> None:
  adam_args.check_hyperparameters(
    learning_rate=None if callable(learning_rate) else learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
  )
  if not callable(weight_decay):
    adam_args.check_hyperparameters(weight_decay=weight_decay)
  if (
    not isinstance(bucket_bytes, (int, np.integer))
    or isinstance(bucket_bytes, bool)
    or bucket_bytes < 4
  ):
    raise ValueError(
      f'bucket_bytes must be an integer >= 4, got {bucket_bytes!r}'
    )


def _fallback_tx(
  learning_rate,
  b1,
  b2,
  eps,
  eps_root,
  mu_dtype,
  weight_decay,
  decay_mask,
  nesterov,
):
  return optax.chain(
    optax.scale_by_adam(
      b1, b2, eps, eps_root, mu_dtype=mu_dtype, nesterov=nesterov
    ),
    optax.add_decayed_weights(weight_decay, mask=list(decay_mask)),
    optax.scale_by_learning_rate(learning_rate),
  )


def superoffload_adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: float,
  b2: float,
  eps: float,
  eps_root: float,
  mu_dtype: Any,
  weight_decay: optax.ScalarOrSchedule,
  mask: Any,
  *,
  nesterov: bool,
  bucket_bytes: int | None,
  executor: str,
) -> optax.GradientTransformationExtraArgs:
  """Builds the transformation behind `adam` and `adamw` (see their docs)."""
  if bucket_bytes is None:
    bucket_bytes = DEFAULT_BUCKET_BYTES
  _validate_options(
    learning_rate, b1, b2, eps, eps_root, weight_decay, bucket_bytes
  )
  executor = executors.resolve(executor)
  use_kernel = mu_dtype is None or np.dtype(mu_dtype) == np.float32
  bucket_elements = max(1, int(bucket_bytes) // 4)
  no_decay = isinstance(weight_decay, (int, float)) and weight_decay == 0.0

  def make_layout(tree: Any) -> layout.Layout:
    n = len(jax.tree.leaves(tree))
    decay = [False] * n if no_decay else layout.resolve_mask(mask, tree)
    return layout.build_layout(
      tree, decay, bucket_elements=bucket_elements, use_kernel=use_kernel
    )

  def fallback_tx(lay: layout.Layout):
    return _fallback_tx(
      learning_rate,
      b1,
      b2,
      eps,
      eps_root,
      mu_dtype,
      weight_decay,
      lay.fallback_decay,
      nesterov,
    )

  def init_fn(params: optax.Params) -> SuperOffloadState:
    lay = make_layout(params)
    leaves = jax.tree.leaves(params)
    master, mu, nu = [], [], []
    for group in lay.groups:
      for bucket in layout.pack(group, leaves):
        master.append(host_memory.to_host(bucket))
        mu.append(host_memory.to_host(jnp.zeros_like(bucket)))
        nu.append(host_memory.to_host(jnp.zeros_like(bucket)))
    fallback = fallback_tx(lay).init([leaves[i] for i in lay.fallback])
    return SuperOffloadState(
      count=host_memory.to_device(jnp.zeros([], jnp.int32)),
      mu=tuple(mu),
      nu=tuple(nu),
      master=tuple(master),
      fallback=jax.tree.map(_state_to_host, fallback),
    )

  def check_state(
    lay: layout.Layout, state: SuperOffloadState, from_grads: bool
  ) -> None:
    if not isinstance(state, SuperOffloadState):
      raise TypeError(
        f'expected a SuperOffloadState, got {type(state).__name__}'
      )
    got = tuple(int(np.prod(np.shape(b))) for b in state.master)
    if got != lay.bucket_sizes or any(
      len(x) != len(got) for x in (state.mu, state.nu)
    ):
      hint = (
        ' (without params, the layout comes from the gradients: give them '
        "the parameters' dtypes, or pass params)"
        if from_grads
        else ''
      )
      raise ValueError(
        'optimizer state was built for another parameter tree: its '
        f'buckets hold {list(got)} elements, these parameters need '
        f'{list(lay.bucket_sizes)}{hint}'
      )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # Accepted for optax.GradientTransformationExtraArgs.
    reference = params if params is not None else updates
    lay = make_layout(reference)
    check_state(lay, state, from_grads=params is None)
    grads = layout.check_tree(lay, updates, 'gradients')
    param_leaves = (
      None if params is None else layout.check_tree(lay, params, 'params')
    )
    count = state.count
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    wd = weight_decay(count) if callable(weight_decay) else weight_decay

    new_master, new_mu, new_nu = [], [], []
    out_leaves: list[Any] = [None] * len(grads)
    k = 0
    for group in lay.groups:
      step = executors.BucketStep(
        count=count,
        learning_rate=lr,
        b1=b1,
        b2=b2,
        eps=eps,
        eps_root=eps_root,
        weight_decay=wd if group.decay else 0.0,
        nesterov=nesterov,
        want_delta=params is None,
      )
      for b, bucket in enumerate(group.buckets):
        leaf_ids = [group.leaves[j] for j in bucket]
        m, a, v, weights = executors.step_bucket(
          executor,
          step,
          state.master[k],
          state.mu[k],
          state.nu[k],
          [_kernel_grad(g) for g in layout.bucket_leaves(group, b, grads)],
          [lay.dtypes[i] for i in leaf_ids],
        )
        new_master.append(m)
        new_mu.append(a)
        new_nu.append(v)
        k += 1
        for i, w in zip(leaf_ids, weights, strict=True):
          w = w.reshape(lay.shapes[i])
          if params is None:
            out_leaves[i] = w  # The fp32 change of the master.
          else:
            out_leaves[i] = _exact_delta(w, param_leaves[i])
      # Zero-size leaves that no bucket holds (a group of only those).
      for i in group.leaves:
        if out_leaves[i] is None:
          out_leaves[i] = jnp.zeros(lay.shapes[i], jnp.float32)

    fallback_state = state.fallback
    if lay.fallback:
      fb_params = (
        None if params is None else [param_leaves[i] for i in lay.fallback]
      )
      fb_updates, fallback_state = fallback_tx(lay).update(
        [grads[i] for i in lay.fallback],
        jax.tree.map(host_memory.to_device, state.fallback),
        fb_params,
      )
      fallback_state = jax.tree.map(_state_to_host, fallback_state)
      for i, u in zip(lay.fallback, fb_updates, strict=True):
        out_leaves[i] = u

    new_state = SuperOffloadState(
      count=optax.safe_increment(count),
      mu=tuple(new_mu),
      nu=tuple(new_nu),
      master=tuple(new_master),
      fallback=fallback_state,
    )
    return jax.tree.unflatten(lay.treedef, out_leaves), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
