"""The Adam step in plain `jax.numpy`, with the kernel's semantics.

Used by tests, by the `xla_host` and `device` executors, and for dtypes the
kernel does not cover (float64 master weights, for instance). Each line is
the same correctly rounded operation, in the same order, as the kernel's
formula in xla_ffi/adam_kernel.h; only the bias corrections are computed in
the master dtype rather than in double precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_superoffload._src.core import adam_args
from jax_superoffload._src.core.hyperparams import PACKED_NAMES
from jax_superoffload._src.core.hyperparams import Hyperparams


def inverse_bias_correction(decay, t):
  """1 / (1 - decay^t), accurate to a few ulps in the working precision.

  Taken as -1 / expm1(t * log(decay)), as the kernel's double-precision
  value rounds to: `1 - decay**t` directly cancels when decay^t is near 1
  (b2 = 0.999 early in training loses about eight bits in fp32).
  """
  return -1 / jnp.expm1(t * jnp.log(decay))


def adam_step_reference(
  master: jax.Array,
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  *,
  count: jax.typing.ArrayLike,
  learning_rate: jax.typing.ArrayLike,
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  eps_root: jax.typing.ArrayLike = 0.0,
  weight_decay: jax.typing.ArrayLike = 0.0,
  nesterov: bool = False,
  grad_scale: jax.typing.ArrayLike = 1.0,
  lowp_dtype: jax.typing.DTypeLike | None = None,
  keep_nonfinite: bool = False,
) -> tuple[jax.Array, ...]:
  """`kernels.adam_step` in `jax.numpy`, for any real floating master dtype.

  Args and returns are those of `jax_superoffload.kernels.adam_step`, except
  that `master`, `mu` and `nu` may be any one real floating dtype (the
  gradient is converted to it).
  """
  hyper = Hyperparams(
    count=count,
    learning_rate=learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
    weight_decay=weight_decay,
    grad_scale=grad_scale,
    nesterov=nesterov,
  )
  lowp = adam_args.validate(
    master,
    grad,
    mu,
    nu,
    hyper,
    lowp_dtype=lowp_dtype,
    master_dtypes=(
      np.dtype(np.float16),
      np.dtype(jnp.bfloat16),
      np.dtype(np.float32),
      np.dtype(np.float64),
    ),
  )
  out = reference_step(
    hyper, master, grad, mu, nu, keep_nonfinite=keep_nonfinite
  )
  return out if lowp is None else (*out, out[0].astype(lowp))


def _scalars(hyper: Hyperparams, dtype) -> dict[str, jax.Array]:
  """The packed scalars by name, in `dtype`.

  Python floats stay double for f64; otherwise they are rounded to f32
  first, as the kernel receives them.
  """
  if dtype == jnp.float64:
    return {n: jnp.asarray(hyper.scalar(n), dtype) for n in PACKED_NAMES}
  packed = hyper.packed()
  return {n: packed[i].astype(dtype) for i, n in enumerate(PACKED_NAMES)}


def reference_step(
  hyper: Hyperparams,
  master: jax.Array,
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  *,
  keep_nonfinite: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The new (master, mu, nu), in the master's dtype (arguments unchecked)."""
  dtype = master.dtype
  s = _scalars(hyper, dtype)
  lr, b1_, omb1 = s['learning_rate'], s['b1'], s['one_minus_b1']
  b2_, omb2, eps_ = s['b2'], s['one_minus_b2'], s['eps']
  eps_root_, wd, scale = s['eps_root'], s['weight_decay'], s['grad_scale']
  count, nesterov = hyper.count, hyper.nesterov
  t = jnp.asarray(count, jnp.int32).astype(dtype) + 1
  c1 = inverse_bias_correction(b1_, t)
  c1_next = inverse_bias_correction(b1_, t + 1)
  c2 = inverse_bias_correction(b2_, t)

  g = grad.astype(dtype) * scale
  new_mu = b1_ * mu + omb1 * g
  new_nu = b2_ * nu + omb2 * (g * g)
  if nesterov:
    mu_hat = b1_ * (new_mu * c1_next) + omb1 * (g * c1)
  else:
    mu_hat = new_mu * c1
  update = mu_hat / (jnp.sqrt(new_nu * c2 + eps_root_) + eps_)
  # As in the kernel, weight decay is skipped when zero, so an inf weight
  # with no decay does not turn into NaN through 0 * inf.
  update = jnp.where(wd != 0, update + wd * master, update)
  new_master = master - lr * update
  if keep_nonfinite:  # Elements with NaN/Inf gradients keep their values.
    finite = jnp.isfinite(g)
    new_master = jnp.where(finite, new_master, master)
    new_mu = jnp.where(finite, new_mu, mu)
    new_nu = jnp.where(finite, new_nu, nu)
  return new_master, new_mu, new_nu
