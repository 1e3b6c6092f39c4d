"""The public optimizers `adam` and `adamw`, spelt as optax spells them.

The offload choices, which optax's optimizers do not have, are one
`Offload` object. The keywords that held them before are accepted for one
more release, with a `DeprecationWarning` naming the new spelling.
"""

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import optax

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import layout
from jax_superoffload._src.optim import init as init_lib
from jax_superoffload._src.optim import options as options_lib
from jax_superoffload._src.optim import scan_scope
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.optim import update as update_lib
from jax_superoffload._src.optim.offload import Offload


class _Unset:
  """The default of a deprecated keyword: not given."""

  def __repr__(self) -> str:
    return '<deprecated>'


_UNSET = _Unset()
DEPRECATED_KEYWORDS = tuple(f.name for f in dataclasses.fields(Offload))


def _offload_keywords(factory: Callable[..., Any]) -> Callable[..., Any]:
  """Accepts `Offload`'s fields as keywords of `factory`, deprecated.

  They stay in the signature (as `_UNSET` keyword-only parameters) so that
  `optax.inject_hyperparams` binds them as before: a numeric `clip_norm`
  given so is still an injected hyperparameter.
  """
  signature = inspect.signature(factory)
  extra = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_UNSET)
    for name in DEPRECATED_KEYWORDS
  ]

  @functools.wraps(factory)
  def wrapped(*args, **kwargs):
    old = {k: kwargs.pop(k) for k in DEPRECATED_KEYWORDS if k in kwargs}
    old = {k: v for k, v in old.items() if v is not _UNSET}
    if old:
      kwargs['offload'] = _from_keywords(factory.__name__, old, kwargs)
    return factory(*args, **kwargs)

  params = list(signature.parameters.values())
  wrapped.__signature__ = signature.replace(parameters=params + extra)
  return wrapped


def _from_keywords(name: str, old: dict[str, Any], kwargs: dict) -> Offload:
  """The `Offload` that deprecated keywords spell, with their warning."""
  if kwargs.get('offload') is not None:
    raise TypeError(
      f'{name}() got offload= and the keywords it replaces '
      f'({", ".join(old)}): pass only offload=Offload(...)'
    )
  spelled = ', '.join(f'{k}={v!r}' for k, v in old.items())
  warnings.warn(
    f'{name}({", ".join(f"{k}=..." for k in old)}) is deprecated: pass '
    f'{name}(..., offload=superoffload.Offload({spelled})); the keywords '
    'go in the next release',
    DeprecationWarning,
    stacklevel=3,
  )
  return Offload(**old)


@_offload_keywords
def adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  eps_root: jax.typing.ArrayLike = 0.0,
  mu_dtype: Any | None = None,
  *,
  nesterov: bool = False,
  offload: Offload | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam whose state lives in host memory and whose step runs on the CPU.

  A drop-in replacement for `optax.adam` with the same arguments and the
  same numbers (up to fp32 rounding). The first and second moments and an
  fp32 master copy of the weights live in pinned host memory, as trees
  shaped like the parameters (see `SuperOffloadState`); each step moves the
  gradients to the host, runs the fused Grace Adam kernel there (XLA host
  compute) over a few leaves per call and brings the new weights back in
  the parameters' dtype. Parameters passed to `update` that no longer
  round to the master (weights loaded, surgery) are where the step
  starts. The accelerator keeps only the parameters, the gradients and the
  activations.

  With :math:`g_t` the gradient, :math:`t` the step (from 1):

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \\
    \hat m_t = m_t / (1-\beta_1^t), \quad \hat v_t = v_t / (1-\beta_2^t), \\
    w_t = w_{t-1} - \eta_t\, \hat m_t / (\sqrt{\hat v_t + \epsilon_{root}}
    + \epsilon),

  on the fp32 master :math:`w`; with ``nesterov=True``,
  :math:`\hat m_t = \beta_1 m_t / (1-\beta_1^{t+1}) + (1-\beta_1) g_t /
  (1-\beta_1^t)`. The returned updates satisfy
  ``optax.apply_updates(params, updates) == new_master.astype(params.dtype)``
  leaf by leaf, so bf16 or f16 parameters track an fp32 master exactly as
  mixed-precision training does.

  Args:
    learning_rate: A float or an optax schedule of the step count.
    b1: Decay rate of the first moment.
    b2: Decay rate of the second moment.
    eps: Added to the denominator outside the square root.
    eps_root: Added to the second moment inside the square root.
    mu_dtype: Dtype of the first moment, as in optax: `None` or float32
      (fp32), or bfloat16 (stored rounded to nearest even, 2 B/param less
      host memory and traffic), use the kernel; any other floating or
      complex dtype takes the optax path (state still in host memory).
      A deliberate difference from optax: with `None`, bf16 and f16
      parameters get fp32 moments (optax keeps them in the parameters'
      dtype). They are the moments of the fp32 master, and a 16-bit `nu`
      loses every change below its precision: a step moves `nu` by
      `1 - b2` = 1e-3 of the gap to :math:`g^2`, under bf16's 2^-9 relative
      rounding. Pass `mu_dtype` (and `Offload.nu_dtype`) for 16-bit
      moments.
    nesterov: Use the Nesterov (NAdam) momentum.
    offload: Where the state lives and the step runs: an `Offload`
      (executor, buckets, casting side, device buckets, moment formats,
      clipping and non-finite steps by speculation-then-validation, the
      hardware "auto" plans for, ZeRO over a mesh); default `Offload()`.

  Returns:
    An `optax.GradientTransformationExtraArgs`. `update` needs `params` to
    return exact updates; without them it returns the fp32 change of the
    master weights.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import jax_superoffload as superoffload
    >>> params = {'w': jnp.ones(3)}
    >>> tx = optax.chain(superoffload.adam(1e-3))
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.ones(3)}, state, params)
    >>> optax.apply_updates(params, updates)['w']
    Array([0.999, 0.999, 0.999], dtype=float32)

  References:
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2014.
    Lian et al., `SuperOffload: Unleashing the Power of Large-Scale LLM
    Training on Superchips <https://arxiv.org/abs/2509.21271>`_, 2025.
  """
  return adamw(
    learning_rate,
    b1,
    b2,
    eps,
    eps_root,
    mu_dtype,
    weight_decay=0.0,
    mask=None,
    nesterov=nesterov,
    offload=offload,
  )


@_offload_keywords
def adamw(
  learning_rate: optax.ScalarOrSchedule,
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  eps_root: jax.typing.ArrayLike = 0.0,
  mu_dtype: Any | None = None,
  weight_decay: optax.ScalarOrSchedule = 1e-4,
  mask: Any | Callable[[optax.Params], Any] | None = None,
  *,
  nesterov: bool = False,
  offload: Offload | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW whose state lives in host memory and whose step runs on the CPU.

  A drop-in replacement for `optax.adamw`: `adam` (see its documentation for
  the offloading; `Offload` for its options) plus decoupled weight decay
  (Loshchilov and Hutter), applied to the fp32 master weights:

  .. math::
    w_t = w_{t-1} - \eta_t \left(\hat m_t / (\sqrt{\hat v_t +
    \epsilon_{root}} + \epsilon) + \lambda w_{t-1}\right).

  Args:
    learning_rate: A float or an optax schedule of the step count.
    b1: Decay rate of the first moment.
    b2: Decay rate of the second moment.
    eps: Added to the denominator outside the square root.
    eps_root: Added to the second moment inside the square root.
    mu_dtype: Dtype of the first moment (see `adam`: `None` keeps fp32
      moments for bf16 parameters, unlike optax).
    weight_decay: The decay rate :math:`\lambda`, a float or a schedule.
    mask: As in optax: a tree (or a prefix of one) of booleans, or a
      callable returning one from the parameters; `True` leaves are decayed.
      Its leaves must be Python booleans, since they shape the buckets.
    nesterov: Use the Nesterov (NAdam) momentum.
    offload: Where the state lives and the step runs: an `Offload`
      (executor, buckets, casting side, device buckets, moment formats,
      clipping and non-finite steps by speculation-then-validation, the
      hardware "auto" plans for, ZeRO over a mesh); default `Offload()`.

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import jax_superoffload as superoffload
    >>> tx = superoffload.adamw(1e-3, weight_decay=0.1)
    >>> state = tx.init({'w': jnp.ones(3)})

    A clip norm that `optax.inject_hyperparams` may change between steps:

    >>> def clipped(learning_rate, clip_norm):
    ...   offload = superoffload.Offload(clip_norm=clip_norm)
    ...   return superoffload.adamw(learning_rate, offload=offload)
    >>> tx = optax.inject_hyperparams(clipped)(1e-3, clip_norm=1.0)

  References:
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  opts = options_lib.build(
    learning_rate,
    b1,
    b2,
    eps,
    eps_root,
    mu_dtype,
    weight_decay,
    mask,
    nesterov,
    Offload() if offload is None else offload,
  )
  return _transformation(opts)


def _state_in_refs(params: Any) -> bool:
  """Whether the state will be kept in `jax.Ref`s that lose host memory.

  Flax keeps an optimizer's state in Refs where it keeps the parameters in
  them (`nnx.var_defaults(ref=True)`), and this JAX's Refs do not keep
  pinned host memory (`layout.refs_hold_host_memory`): the state is then
  made and stepped in device memory, as `Offload(device_buckets=1.0)`
  makes it.
  """
  leaves = jax.tree.leaves(params)
  return any(map(layout.is_ref, leaves)) and not layout.refs_hold_host_memory()


def _resident(opts: options_lib.Options) -> options_lib.Options:
  """`opts` with every bucket's state on the device (updated there)."""
  return dataclasses.replace(opts, device_buckets=1.0)


def _on_device(state: Any) -> Any:
  """`state` with every leaf in device memory (optax's path's ones too)."""
  fields = ('master', 'mu', 'nu', 'kept_grads', 'mu_scales', 'nu_scales')
  moved = {
    name: jax.tree.map(host_memory.to_device, getattr(state, name))
    for name in fields
    if getattr(state, name) is not None
  }
  return state_lib.with_fields(state, **moved)


def _transformation(
  opts: options_lib.Options,
) -> optax.GradientTransformationExtraArgs:
  """The transformation of `opts`: pure `init` and `update`.

  Without mesh arguments, where the state lives follows from their
  arguments alone (`init_following`, `update_following`), so a state
  restored into an `eval_shape` target steps as a fresh one, and one
  transformation serves any number of trees. Mutable leaves (`jax.Ref`s,
  Flax's hijax Variables) are read where they enter, as optax's math reads
  them.
  """
  read = functools.partial(jax.tree.map, layout.held_value)

  def init_fn(params):
    if _state_in_refs(params):
      return _on_device(init_lib.init_following(_resident(opts), read(params)))
    return init_lib.init_following(opts, read(params))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # Accepted for optax.GradientTransformationExtraArgs.
    return update_lib.update_following(opts, read(updates), state, read(params))

  # How `overlap_scan` knows the transformation is ours, and its options.
  setattr(update_fn, scan_scope.OPTIONS_ATTRIBUTE, opts)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
