"""Grace Adam through XLA FFI: registration and the `ffi_call` wrappers."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_superoffload import _grace_adam
from jax_superoffload._src.core import adam_args
from jax_superoffload._src.core import backend
from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core.hyperparams import Hyperparams

# The target names are declared once, in xla_ffi/adam_ffi.h.
STREAM_ROOFLINE_TARGET = _grace_adam.STREAM_ROOFLINE_TARGET
ADAM_STEP_SEGMENTS_TARGET = _grace_adam.ADAM_STEP_SEGMENTS_TARGET
ADAM_STEP_LOWP_SEGMENTS_TARGET = _grace_adam.ADAM_STEP_LOWP_SEGMENTS_TARGET
ADAM_STEP_SPECULATIVE_TARGET = _grace_adam.ADAM_STEP_SPECULATIVE_TARGET
ADAM_STEP_VALIDATED_TARGET = _grace_adam.ADAM_STEP_VALIDATED_TARGET
# One row of stacked state stepped in place, from inside a scan's loop.
ADAM_STEP_ROW_TARGET = _grace_adam.ADAM_STEP_ROW_TARGET
# Stacked masters re-seeded before the loop, a row at a time: the rows'.
ADAM_RESEED_ROWS_TARGET = _grace_adam.ADAM_RESEED_ROWS_TARGET
# One per step after the bucket starts: every operand aliased to its result.
STREAM_JOIN_TARGET = _grace_adam.STREAM_JOIN_TARGET
STREAM_CLAIM_TARGET = _grace_adam.STREAM_CLAIM_TARGET
STREAM_TO_DEVICE_TARGET = _grace_adam.STREAM_TO_DEVICE_TARGET
# `adam_step` is a Segments call of one leaf, with or without a weights copy
# and its donated destination.
ADAM_STEP_TARGET = ADAM_STEP_SEGMENTS_TARGET
ADAM_STEP_LOWP_TARGET = ADAM_STEP_SEGMENTS_TARGET
ADAM_STEP_LOWP_INTO_TARGET = ADAM_STEP_SEGMENTS_TARGET

for _name, _capsule in _grace_adam.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform='cpu')


def stream_registration() -> tuple[bool, str]:
  """Files the stream-ordered handlers for the CUDA platform, once.

  They take the bucket targets' names, so a bucket call outside host
  compute on a GPU runs Grace Adam from the GPU's stream (stream_launch.h).
  Returns (filed, why not).
  """
  if backend.cross_compiling():
    return _file_stream_targets()  # Compiled against, never run here.
  loaded, why = _grace_adam.cuda_driver()
  if not loaded:
    return False, why
  return _file_stream_targets()


@functools.cache
def _file_stream_targets() -> tuple[bool, str]:
  try:
    for name, capsule in _grace_adam.stream_registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform='CUDA')
  except Exception as e:  # JAX raises several types here.
    return False, f'{type(e).__name__}: {e}'
  return True, ''


def host_pool_workers() -> int:
  """Worker threads the process's host pool has started so far."""
  return _grace_adam.host_pool_workers()


def instruction_set() -> str:
  """Returns the instruction set the kernel uses on this CPU (e.g. 'avx2')."""
  return _grace_adam.instruction_set()


def prefetch_policy() -> str:
  """Returns the kernel's software prefetch now: 't0', 'nta' or 'none'.

  The kernel's default unless the environment variable
  `JAX_SUPEROFFLOAD_PREFETCH` names another (for experiments; read when a
  kernel call is traced). Raises ValueError when that variable holds
  anything else.
  """
  return _grace_adam.prefetch_policy()


def settings() -> dict[str, str | np.int64]:
  """The kernel's settings as FFI attributes, fixed at trace time.

  `prefetch` (see `prefetch_policy`) and `host_threads`, the threads in all
  a step asks for (`JAX_SUPEROFFLOAD_HOST_THREADS`; 0: XLA's pool where it
  has several threads, else the CPUs this process may run on). Raises
  ValueError, naming the variable, for a malformed value.
  """
  return {
    'prefetch': _grace_adam.prefetch_policy(),
    'host_threads': np.int64(_grace_adam.host_threads()),
  }


def _bucket_attrs(
  hyper: Hyperparams,
  num_leaves: int,
  *,
  keep_nonfinite: bool = False,
  compute_sumsq: bool = False,
  reseed: bool = False,
  quantized: bool = False,
  staging_bytes: int = 0,
  hold_inputs: bool = False,
  weights_over_grads: bool = False,
) -> dict:
  """Every bucket handler's attributes (BucketAttrs, xla_ffi/ffi_support.h)."""
  return {
    'hold_inputs': bool(hold_inputs),
    'weights_over_grads': bool(weights_over_grads),
    'nesterov': bool(hyper.nesterov),
    'keep_nonfinite': bool(keep_nonfinite),
    'compute_sumsq': bool(compute_sumsq),
    'num_leaves': np.int64(num_leaves),
    'reseed': bool(reseed),
    'quantized': bool(quantized),
    'staging_bytes': np.int64(staging_bytes),
    **settings(),
  }


def adam_step(
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
  lowp_out: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
  """One fused Adam/AdamW step by the Grace Adam kernel (CPU).

  See `jax_superoffload.kernels.adam_step` for the full documentation. With
  `lowp_out` (an array of the master's shape in `lowp_dtype`, its old
  contents ignored), the low-precision copy is written into that buffer when
  the caller donates it, rather than into a fresh one.
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
    nesterov=bool(nesterov),
  )
  lowp = adam_args.validate(
    master,
    grad,
    mu,
    nu,
    hyper,
    lowp_dtype=lowp_dtype,
    master_dtypes=(np.dtype(np.float32),),
  )
  state_type = jax.ShapeDtypeStruct(master.shape, jnp.float32)
  out_types = [jax.ShapeDtypeStruct((1,), jnp.float32), *[state_type] * 3]
  # master, mu and nu are updated in place when the caller donates them.
  aliases = _aliases(3, 1, 3)
  extra = []
  if lowp is not None:
    out_types.append(jax.ShapeDtypeStruct(master.shape, lowp))
  if lowp_out is not None:
    _check_lowp_out(lowp_out, master.shape, lowp)
    aliases[7] = 4
    extra.append(lowp_out)
  call = jax.ffi.ffi_call(
    ADAM_STEP_SEGMENTS_TARGET,
    out_types,
    # Elementwise, with per-batch scalars handled by the handler: every
    # operand gains the same leading batch dimensions.
    vmap_method='broadcast_all',
    input_output_aliases=aliases,
  )
  scalars = (jnp.asarray(count, jnp.int32), hyper.packed(), _unchanged(False))
  out = call(*scalars, master, mu, nu, grad, *extra, **_bucket_attrs(hyper, 1))
  return tuple(out[1:])


def _check_lowp_out(
  lowp_out: jax.Array, shape: tuple[int, ...], lowp: np.dtype | None
) -> None:
  """Checks a donated destination of the low-precision copy."""
  if lowp is None:
    raise ValueError('lowp_out needs lowp_dtype (bfloat16 or float16)')
  if tuple(lowp_out.shape) != tuple(shape) or np.dtype(lowp_out.dtype) != lowp:
    raise TypeError(
      f'lowp_out must be {lowp}{list(shape)}, got '
      f'{lowp_out.dtype}{list(lowp_out.shape)}'
    )


def stream_roofline(
  master: jax.Array, grad: jax.Array, mu: jax.Array, nu: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Moves the bytes of an Adam step with no Adam math (a benchmark bound).

  Reads `master`, `grad`, `mu` and `nu` (all float32, same shape) and returns
  `(master + grad, nu, mu)`, with the same threads and chunking as
  `adam_step`, so that the Adam kernel can be compared with the memory
  bandwidth limit of its own traffic.
  """
  arrays = {'master': master, 'grad': grad, 'mu': mu, 'nu': nu}
  for name, x in arrays.items():
    if x.dtype != jnp.float32 or x.shape != master.shape:
      raise TypeError(
        f'stream_roofline needs float32 arrays of one shape; {name} is '
        f'{x.dtype}{list(x.shape)}, master is {master.dtype}'
        f'{list(master.shape)}'
      )
  state_type = jax.ShapeDtypeStruct(master.shape, jnp.float32)
  call = jax.ffi.ffi_call(
    STREAM_ROOFLINE_TARGET,
    [state_type] * 3,
    vmap_method='broadcast_all',
    input_output_aliases={0: 0, 2: 1, 3: 2},
  )
  return tuple(call(master, grad, mu, nu, **settings()))


# Prepares an operand that is not state for a handler: as it is for host
# compute; flattened on the device for the handlers ordered on a GPU stream
# (executors.Stream), which copy what is in device memory to host memory
# themselves (stream_launch.h). Results shaped like the gradients take the
# placed gradients' shapes.
Place = Callable[[jax.Array], jax.Array]


def _as_is(x: jax.Array) -> jax.Array:
  return x


class StreamPlace:
  """The `Place` of the handlers ordered on a GPU stream.

  Flattens each operand on the device (rank 1 has one layout; the handler
  stages what is in device memory itself). With `join`, every call is
  followed by a join (`STREAM_JOIN_TARGET`): the handler only starts the
  host step, on a side stream and a worker thread (a bucket call's
  operands are held until the join, so the compute stream waits neither
  for their copies to staging nor for the step; other calls' copies it
  waits for), so its device results must stay untouched until the join
  has waited for the worker.
  The join takes them (aliased, nothing copied), and the host results read
  after the call (see `_joined`), and takes `barrier`, a scalar that
  exists only once every gradient does, so XLA cannot place it before the
  backward pass is over: the compute stream waits for host steps once.
  """

  def __init__(
    self,
    join: bool = False,
    barrier: jax.Array | None = None,
    staging_bytes: int = 0,
  ):
    self.join = join
    self.barrier = barrier
    self.staging_bytes = staging_bytes  # BucketAttrs::staging_bytes.

  def __call__(self, x: jax.Array) -> jax.Array:
    return x.reshape(-1)


def _on_host(x: jax.Array) -> bool:
  return jax.typeof(x).memory_space == jax.memory.Space.Host


def _joined(
  place: Place,
  out: list,
  on_host: set[int],
  copy: Sequence[int] = (),
  keep: Sequence[jax.Array] | None = None,
) -> tuple[list, list]:
  """`out` through a stream join when `place` asks for one, and copies.

  Every result passes through the join, aliased (nothing copied), so
  nothing can read it before the host step has written it: the state in
  pinned host memory too, which optax's wrappers read inside the step
  (`MultiSteps` selects between the state it held and the new one).
  `on_host`: the results in host memory, typed so after the join.
  `copy`: joined host results (the new weights) to copy to the device
  after the join (`_to_device`). `keep`: operands the step may still read
  after its start (the parameters, which its worker copies only when they
  changed, or every device operand of a call that holds its inputs), kept
  alive until the join. Returns `out` and those copies (none without a
  join).
  """
  out = list(out)
  if not getattr(place, 'join', False):
    return out, []
  barrier = place.barrier
  if barrier is None:  # Nothing to wait for: the results are needed now.
    barrier = jnp.zeros((), jnp.int32)
  # The results pass through (aliased). What the step reads from device
  # memory is kept alive only where it is in `keep` (a call that holds its
  # inputs); elsewhere the start makes the compute stream wait for its
  # copies to host memory (not for the host step), so XLA may reuse those
  # buffers after it. Nothing XLA copies asynchronously may hang off a
  # start (see `_to_device`).
  # The device results (or, where there are none, one host result) pass
  # through the join that waits; each host result through a join of its
  # own after it. One join passing them all cost the 1B unrolled step 68 s
  # of XLA:GPU's host-offload legalization, which walks a call's results
  # for each host result it meets (a leaf's own join: 0.2 s).
  first = [i for i in range(len(out)) if i not in on_host] or [min(on_host)]
  joined = [out[i] for i in first]
  done = _passing(STREAM_JOIN_TARGET, joined, barrier, *(keep or ()))
  for i, x in zip(first, done, strict=True):
    out[i] = x
  for i in sorted(on_host):
    if i not in first:
      (out[i],) = _passing(STREAM_JOIN_TARGET, [out[i]], done[0])
    # XLA keeps a result aliased to a host operand in host memory.
    out[i] = jax.device_put(out[i], jax.memory.Space.Host)
  return out, _to_device([out[i] for i in copy])


def _passing(target: str, xs: list, *ordering: jax.Array) -> list:
  """A call of `target` (a join or a claim) that passes `xs` on, aliased.

  Its results are `xs`' buffers; `ordering` it only takes, to run after
  them or keep them alive until it. It has effects (a join waits; a
  claim's results are written later, by a worker): never dropped.
  """
  call = jax.ffi.ffi_call(
    target,
    _like(xs),
    vmap_method='sequential',
    input_output_aliases=_aliases(0, 0, len(xs)),
    has_side_effect=True,
  )
  return list(call(*xs, *ordering))


def _to_device(xs: list[jax.Array]) -> list[jax.Array]:
  """Joined results copied to the device by a call of our own.

  XLA would copy a joined host result to the device asynchronously: a
  window its scheduler fills with work independent of the copy (the
  loss, gradient norms), moved to the step's end with the activations it
  reads. This call's results are device buffers, filled
  on the compute stream after the join; XLA sees a call, not a copy. Its
  operands are where XLA put the joined results: host memory, or, for a
  start's results that alias no operand (weights copies), device memory
  on XLA:GPU of jaxlib 0.12.1; the handler copies from either.
  """
  if not xs:
    return []
  call = jax.ffi.ffi_call(
    STREAM_TO_DEVICE_TARGET, _like(xs), vmap_method='sequential'
  )
  return list(call(*xs))


def _host_results(first: int, state: list[jax.Array]) -> set[int]:
  """Indices of the results aliased to the host-memory `state` operands."""
  return {first + j for j, x in enumerate(state) if _on_host(x)}


def _typed_like(results: list, operands: list) -> list:
  """Results aliased to host-memory operands, typed as host memory.

  JAX types every `ffi_call` result as device memory, while XLA keeps a
  result aliased to a pinned_host operand in that operand's buffer; typed
  so, a later move to the device is a real copy, not a no-op.
  """
  return [
    jax.device_put(r, jax.memory.Space.Host) if _on_host(x) else r
    for r, x in zip(results, operands, strict=True)
  ]


def _bucket_out_types(runs, grads, weight_dtypes) -> list:
  """A bucket call's result types.

  The f32[1] sum of squares, the state runs (each like its operands) and
  the weights in `weight_dtypes`, if any.
  """
  out_types = [jax.ShapeDtypeStruct((1,), jnp.float32)]
  for run in runs:
    out_types += _like(run)
  if weight_dtypes is not None:
    out_types += [
      jax.ShapeDtypeStruct(g.shape, d)
      for g, d in zip(grads, weight_dtypes, strict=True)
    ]
  return out_types


def _scalar_operands(hyper: Hyperparams, place: Place) -> list[jax.Array]:
  """The count and the packed scalars every bucket handler takes first."""
  return [place(jnp.asarray(hyper.count, jnp.int32)), place(hyper.packed())]


def _unchanged(flag: jax.typing.ArrayLike) -> jax.Array:
  """The s32[1] `unchanged` operand of a re-seeding bucket call."""
  return jnp.asarray(flag, jnp.int32).reshape(1)


def _like(xs: list[jax.Array], dtype=None) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct(x.shape, dtype or x.dtype) for x in xs]


def _aliases(first_operand: int, first_result: int, n: int) -> dict:
  return {first_operand + i: first_result + i for i in range(n)}


def adam_step_segments(
  master: list[jax.Array],
  mu: list[jax.Array],
  nu: list[jax.Array],
  grads: list[jax.Array],
  weight_dtypes: list[jax.typing.DTypeLike] | None,
  hyper: Hyperparams,
  *,
  params: list[jax.Array] | None = None,
  params_unchanged: jax.typing.ArrayLike = False,
  keep_nonfinite: bool = False,
  compute_sumsq: bool = False,
  place: Place | None = None,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], list, jax.Array]:
  """One kernel call over a bucket of k leaves: the optimizer's host step.

  `master`, `mu` and `nu` are the leaves' own fp32 state arrays, each
  aliased to its result (updated in place when donated); `grads` their
  gradients (f32, bf16 or f16), of the same shapes. With `params`, the step
  starts from them where they differ from the master rounded to their dtype
  (the parameters are the source of truth), unless `params_unchanged` (a
  scalar, traced or not) is true: it says that they are the weights the
  last step produced, which re-seed nothing, and the step does not read
  them. Returns the new master, mu and
  nu per leaf, the new weights in `weight_dtypes` (or an empty list), and
  the sum of the squared scaled gradients (f32[1]; zero unless
  `compute_sumsq`). `place` moves every operand but the state where the
  handler reads it (see `Place`).
  """
  runs, weights, sumsq = _bucket_call(
    ADAM_STEP_SEGMENTS_TARGET,
    [master, mu, nu],
    grads,
    weight_dtypes,
    params,
    hyper,
    (_unchanged(params_unchanged),),
    place=place,
    keep_nonfinite=bool(keep_nonfinite),
    compute_sumsq=bool(compute_sumsq),
  )
  return (*runs, weights, sumsq)


def _bucket_call(
  target: str,
  state: list[list[jax.Array]],
  grads: list[jax.Array],
  weight_dtypes: list[jax.typing.DTypeLike] | None,
  params: list[jax.Array] | None,
  hyper: Hyperparams,
  flags: tuple[jax.Array, ...] = (),
  place: Place | None = None,
  **attrs,
) -> tuple[list[list[jax.Array]], list[jax.Array], jax.Array]:
  """`_one_bucket_call`, on the leaves with elements where it is joined."""
  kept = _leaves_with_elements(place, grads)
  if kept is None:
    return _one_bucket_call(
      target, state, grads, weight_dtypes, params, hyper, flags, place, **attrs
    )
  runs, weights = [[] for _ in state], []
  sumsq = jnp.zeros((1,), jnp.float32)
  if kept:
    runs, weights, sumsq = _one_bucket_call(
      target,
      [_pick(run, kept) for run in state],
      _pick(grads, kept),
      _pick(weight_dtypes, kept),
      _pick(params, kept),
      hyper,
      flags,
      place,
      **attrs,
    )
  # A joined call returns every leaf's weights: the masters' by default.
  empty = _empty_weights(weight_dtypes or [m.dtype for m in state[0]])
  *runs, weights = _merged([*state, empty], kept, [*runs, weights])
  return runs, weights, sumsq


def _leaves_with_elements(place: Place | None, leaves: list) -> list | None:
  """The leaves a joined call takes where it leaves some out, else None.

  Where a call aliases an empty array in host memory, XLA:GPU types the
  operand's buffer as device memory and the result's as host memory, and
  its verifier refuses the program. An empty leaf needs no step: a joined
  call (`StreamPlace`) leaves it out, and it comes back as it went in.
  """
  if not getattr(place, 'join', False):
    return None
  kept = [j for j, x in enumerate(leaves) if x.size]
  return None if len(kept) == len(leaves) else kept


def _pick(xs: list | None, kept: list[int]) -> list | None:
  return None if xs is None else [xs[j] for j in kept]


def _empty_weights(dtypes: list) -> list[jax.Array]:
  return [jnp.zeros((0,), d) for d in dtypes]


def _merged(fill: list[list], kept: list[int], got: list[list]) -> list[list]:
  """Per-leaf lists: `got`'s leaves at `kept`, `fill`'s elsewhere."""
  out = [list(xs) for xs in fill]
  for xs, ys in zip(out, got, strict=True):
    if xs or ys:  # A list of no leaves (no weights) stays empty.
      for j, y in zip(kept, ys, strict=True):
        xs[j] = y
  return out


def _one_bucket_call(
  target: str,
  state: list[list[jax.Array]],
  grads: list[jax.Array],
  weight_dtypes: list[jax.typing.DTypeLike] | None,
  params: list[jax.Array] | None,
  hyper: Hyperparams,
  flags: tuple[jax.Array, ...] = (),
  place: Place | None = None,
  **attrs,
) -> tuple[list[list[jax.Array]], list[jax.Array], jax.Array]:
  """One call of a bucket handler (Segments or LowpSegments).

  In: the count, the scalars and `flags` (operands the handler takes after
  them), runs of k state leaves (each aliased to its result), the k
  gradients and, optionally, the k parameters. Out: the new state runs,
  the weights in `weight_dtypes` (or an empty list) and the f32[1] sum of
  squares. `place` moves the operands that are not state (see `Place`).

  A joined call (a GPU stream) holds its inputs until the join, so the
  compute stream never waits for their copies to the host; new weights
  of the gradients' dtypes it writes over them (`_claimed`), copied back
  by the worker right after its host step, in the backward pass.
  """
  place = place or _as_is
  joined = getattr(place, 'join', False)
  grads = [place(g) for g in grads]
  params = None if params is None else [place(p) for p in params]
  over = joined and weights_fit_grads(grads, weight_dtypes)
  if over:
    grads, weight_dtypes = _claimed(grads), None
  k, n = len(grads), len(state)
  scalars = [*_scalar_operands(hyper, place), *(place(f) for f in flags)]
  flat_state = [x for run in state for x in run]
  call = jax.ffi.ffi_call(
    target,
    _bucket_out_types(state, grads, weight_dtypes),
    vmap_method='sequential',
    input_output_aliases=_aliases(len(scalars), 1, n * k),
  )
  attrs.update(
    reseed=params is not None,
    staging_bytes=getattr(place, 'staging_bytes', 0),
    hold_inputs=joined,
    weights_over_grads=over,
  )
  out = call(
    *scalars,
    *flat_state,
    *grads,
    *(params or []),
    **_bucket_attrs(hyper, k, **attrs),
  )
  # No weights of their own: the masters, copied after the join, or none.
  read = set(range(1, 1 + k)) if weight_dtypes is None and not over else set()
  weights = range(1 + n * k, len(out)) if weight_dtypes is not None else read
  held = [*scalars, *([] if over else grads), *(params or [])]
  out, copies = _joined(
    place,
    out,
    _host_results(1, flat_state),
    copy=sorted(weights),
    keep=held if joined else params,
  )
  if over:  # After the join, which waited for the weights' copies.
    copies = _passed_on(grads, out[0])
  runs = [list(out[1 + r * k : 1 + (r + 1) * k]) for r in range(n)]
  if place is not _as_is:
    runs = [_typed_like(run, old) for run, old in zip(runs, state, strict=True)]
  if joined:
    return runs, copies, out[0]
  return runs, list(out[1 + n * k :]), out[0]


def weights_fit_grads(grads: list[jax.Array], weight_dtypes) -> bool:
  """Whether a joined start can write its new weights over its gradients.

  Each leaf's weights must have its gradient's dtype (so its size). Empty
  leaves do not count: a joined call leaves them out
  (`_leaves_with_elements`); so one of them alone cannot.
  """
  if weight_dtypes is None or not any(g.size for g in grads):
    return False
  return all(
    jnp.dtype(d) == g.dtype
    for g, d in zip(grads, weight_dtypes, strict=True)
    if g.size
  )


def _passed_on(claimed: list[jax.Array], joined: jax.Array) -> list:
  """Claimed gradients as the new weights, after the join (`joined`).

  A join of their own: XLA:GPU of jaxlib 0.12.0.1 places every result of
  a call that passes host memory on in host memory, so device buffers
  cannot pass through the bucket's join. `joined`, one of that join's
  results, orders it after that one, which has waited for the worker's
  copies; it waits for nothing more itself.
  """
  return _passing(STREAM_JOIN_TARGET, claimed, joined)


def _claimed(grads: list[jax.Array]) -> list[jax.Array]:
  """`grads` handed over, in place, to the new weights a start writes.

  The start that reads them writes its new weights into their buffers
  once its host step is done (BucketAttrs::weights_over_grads), and the
  join passes them on as the weights. From this call on XLA takes the
  buffers as written: every other read of the gradients comes before it
  (or reads a copy), and nothing else uses them until that join. The
  gradients' buffers are the start's to hold until the join anyway (the
  compute stream does not wait for their copies to the host), and free
  once copied: weights placed there cost no device memory.
  """
  return _passing(STREAM_CLAIM_TARGET, grads)


def adam_step_lowp_segments(
  master: list[jax.Array],
  mu: list[jax.Array],
  nu: list[jax.Array],
  scales: tuple[list[jax.Array], list[jax.Array]] | None,
  grads: list[jax.Array],
  weight_dtypes: list[jax.typing.DTypeLike] | None,
  hyper: Hyperparams,
  *,
  params: list[jax.Array] | None = None,
  params_unchanged: jax.typing.ArrayLike = False,
  keep_nonfinite: bool = False,
  compute_sumsq: bool = False,
  skip: jax.typing.ArrayLike = False,
  place: Place | None = None,
) -> tuple[list, list, list, tuple | None, list, jax.Array]:
  """`adam_step_segments` with low-precision (bf16 or 8-bit) moments.

  `mu` and `nu` per leaf are bf16 and f32, bf16 and bf16, or uint8 codes
  with `scales` = (mu scales, nu scales), f32[ceil(size / 256)] per leaf
  (moments.py describes the 8-bit format). The moments are decoded, the
  step taken in fp32 and the new moments stored rounded. Returns the new
  master, mu, nu and scales (or None) per leaf, the new weights in
  `weight_dtypes` (or an empty list) and the sum of the squared scaled
  gradients (f32[1]; zero unless `compute_sumsq`). `params_unchanged`: as
  in `adam_step_segments`. With `skip` true
  (a scalar, traced or not) the call steps nothing: the state comes back
  as it was and the weights are left unwritten.
  """
  state = [master, mu, nu] + (list(scales) if scales is not None else [])
  runs, weights, sumsq = _bucket_call(
    ADAM_STEP_LOWP_SEGMENTS_TARGET,
    state,
    grads,
    weight_dtypes,
    params,
    hyper,
    (jnp.asarray(skip, jnp.int32).reshape(1), _unchanged(params_unchanged)),
    place=place,
    keep_nonfinite=bool(keep_nonfinite),
    compute_sumsq=bool(compute_sumsq),
    quantized=scales is not None,
  )
  new_scales = (runs[3], runs[4]) if scales is not None else None
  return runs[0], runs[1], runs[2], new_scales, weights, sumsq


def adam_step_speculative(
  master: list[jax.Array],
  mu: list[jax.Array],
  nu: list[jax.Array],
  kept: list[jax.Array],
  row: jax.Array,
  grads: list[jax.Array],
  weight_dtypes: list[jax.typing.DTypeLike] | None,
  hyper: Hyperparams,
  *,
  params: list[jax.Array] | None = None,
  params_unchanged: jax.typing.ArrayLike = False,
  keep_nonfinite: bool = False,
  place: Place | None = None,
) -> tuple[list, list, list, list, jax.Array, list]:
  """STV's speculative step on double-buffered leaves, one bucket.

  `master`, `mu` and `nu` are ``f32[2, *shape]`` per leaf: two rows, of which
  `row` (int32 scalar) is current. Reads that row and the gradients, writes
  the other row, the gradients as fp32 into `kept` (``f32[*shape]`` per leaf)
  and the new weights in `weight_dtypes`. With `params`, they are copied
  into the current row first where it does not round to them. Every state
  buffer aliases its result. Returns master, mu, nu and kept per leaf, the
  sum of the squared scaled gradients (f32[1]) and the weights. `place`
  moves the operands that are not state (see `Place`).
  """
  some = _leaves_with_elements(place, grads)
  args = (master, mu, nu, kept, row, grads, weight_dtypes, hyper)
  kwargs = dict(
    params=params,
    params_unchanged=params_unchanged,
    keep_nonfinite=keep_nonfinite,
    place=place,
  )
  if some is None:
    return _speculative(*args, **kwargs)
  got = [[], [], [], [], []]
  sumsq = jnp.zeros((1,), jnp.float32)
  if some:
    pick = [_pick(x, some) if isinstance(x, list) else x for x in args]
    kwargs['params'] = _pick(params, some)
    *got[:4], sumsq, got[4] = _speculative(*pick, **kwargs)
  empty = _empty_weights(weight_dtypes or [])
  *runs, weights = _merged([master, mu, nu, kept, empty], some, got)
  return (*runs, sumsq, weights)


def _speculative(
  master: list[jax.Array],
  mu: list[jax.Array],
  nu: list[jax.Array],
  kept: list[jax.Array],
  row: jax.Array,
  grads: list[jax.Array],
  weight_dtypes: list[jax.typing.DTypeLike] | None,
  hyper: Hyperparams,
  *,
  params: list[jax.Array] | None,
  params_unchanged: jax.typing.ArrayLike,
  keep_nonfinite: bool,
  place: Place | None,
) -> tuple[list, list, list, list, jax.Array, list]:
  """`adam_step_speculative`'s call on every leaf it is given."""
  place = place or _as_is
  grads = [place(g) for g in grads]
  params = None if params is None else [place(p) for p in params]
  k = len(master)
  out_types = _bucket_out_types((master, mu, nu, kept), grads, weight_dtypes)
  operands = [
    *_scalar_operands(hyper, place),
    place(jnp.asarray(row, jnp.int32).reshape(1)),
    place(_unchanged(params_unchanged)),
    *master,
    *mu,
    *nu,
    *kept,
    *grads,
    *(params or []),
  ]
  call = jax.ffi.ffi_call(
    ADAM_STEP_SPECULATIVE_TARGET,
    out_types,
    vmap_method='sequential',
    input_output_aliases=_aliases(4, 1, 4 * k),
  )
  out = call(
    *operands,
    **_bucket_attrs(
      hyper,
      k,
      keep_nonfinite=keep_nonfinite,
      reseed=params is not None,
      staging_bytes=getattr(place, 'staging_bytes', 0),
    ),
  )
  state = (master, mu, nu, kept)
  on_host = _host_results(1, [x for run in state for x in run])
  out, _ = _joined(place, out, on_host, keep=params)
  runs = [list(out[1 + r * k : 1 + (r + 1) * k]) for r in range(4)]
  if place is not _as_is:
    runs = [_typed_like(run, old) for run, old in zip(runs, state, strict=True)]
  weights = list(out[1 + 4 * k :])
  if getattr(place, 'join', False):
    # Typed as host memory, the copies stay there through the validated
    # step (rewritten only on a redo) and reach the device at the end. The
    # call writes them there, or (XLA:GPU, jaxlib 0.12.1) to the device.
    weights = [jax.device_put(w, jax.memory.Space.Host) for w in weights]
  return (*runs, out[0], weights)


def adam_step_validated(
  master: list[jax.Array],
  mu: list[jax.Array],
  nu: list[jax.Array],
  kept: list[jax.Array],
  row: jax.Array,
  weights: list[jax.Array] | None,
  hyper: Hyperparams,
  *,
  redo: jax.Array,
  skip: jax.Array,
  redo_scale: jax.Array,
  place: Place | None = None,
) -> tuple[list, list, list, list]:
  """Finishes `adam_step_speculative` once validation has spoken (internal).

  With `redo`, takes the step again from the untouched row `row` with the
  kept gradients times `redo_scale`, over the other row and the weights
  copies (exact: the same kernel step as without speculation). Otherwise
  returns its inputs (aliased: no copy, no work). A skipped step leaves
  row `row` current, so it needs nothing either.
  """
  some = _leaves_with_elements(place, master)
  args = (master, mu, nu, kept, row, weights, hyper)
  kwargs = dict(redo=redo, skip=skip, redo_scale=redo_scale, place=place)
  if some is None:
    return _validated(*args, **kwargs)
  got = [[], [], [], []]
  if some:
    pick = [_pick(x, some) if isinstance(x, list) else x for x in args]
    got = list(_validated(*pick, **kwargs))
  # The weights' copies reach the device; an empty one is made there.
  empty = _empty_weights([w.dtype for w in weights or []])
  return tuple(_merged([master, mu, nu, empty], some, got))


def _validated(
  master: list[jax.Array],
  mu: list[jax.Array],
  nu: list[jax.Array],
  kept: list[jax.Array],
  row: jax.Array,
  weights: list[jax.Array] | None,
  hyper: Hyperparams,
  *,
  redo: jax.Array,
  skip: jax.Array,
  redo_scale: jax.Array,
  place: Place | None,
) -> tuple[list, list, list, list]:
  """`adam_step_validated`'s call on every leaf it is given."""
  k = len(master)
  weights = list(weights or [])
  hyper = hyper.replace(grad_scale=1.0)  # The redo scales by redo_scale.
  out_types = _like(master) + _like(mu) + _like(nu) + _like(weights)
  call = jax.ffi.ffi_call(
    ADAM_STEP_VALIDATED_TARGET,
    out_types,
    vmap_method='sequential',
    input_output_aliases={
      **_aliases(5, 0, 3 * k),
      **_aliases(5 + 4 * k, 3 * k, len(weights)),
    },
  )
  place = place or _as_is
  flags = jnp.stack([redo, skip]).astype(jnp.int32)
  scalars = [
    *_scalar_operands(hyper, place),
    place(jnp.asarray(row, jnp.int32).reshape(1)),
    place(flags),
    place(jnp.asarray(redo_scale, jnp.float32).reshape(1)),
  ]
  staging = getattr(place, 'staging_bytes', 0)
  out = call(
    *scalars,
    *master,
    *mu,
    *nu,
    *kept,
    *weights,
    **_bucket_attrs(hyper, k, staging_bytes=staging),
  )
  on_host = _host_results(0, [*master, *mu, *nu, *weights])
  # The weights copies in host memory are read after the call (copied to
  # the device): through the join, which copies them.
  read = {i for i in on_host if i >= 3 * k}
  out, copies = _joined(place, out, on_host, copy=sorted(read))
  runs = [list(out[r * k : (r + 1) * k]) for r in range(3)]
  if place is not _as_is:
    state = (master, mu, nu)
    runs = [_typed_like(run, old) for run, old in zip(runs, state, strict=True)]
  return (*runs, copies if copies else list(out[3 * k :]))


def _check_row_leaves(
  master, mu, nu, grads, params, weights, over=False
) -> None:
  """Raises ValueError unless the row step's leaves fit together.

  `over`: the weights go over the gradients, which must be stacked.
  """
  if over and (grads[0].shape != master[0].shape or weights is not None):
    raise ValueError(
      'adam_step_row: weights_over_grads writes over stacked gradients, '
      'and takes no weights'
    )
  runs = {'mu': mu, 'nu': nu, 'grads': grads}
  if params is not None:
    runs['params'] = params
  if weights is not None:
    runs['weights'] = weights
  for name, run in runs.items():
    if len(run) != len(master):
      raise ValueError(
        f'adam_step_row: {len(master)} master leaves but {len(run)} {name}'
      )
  for j, (m, u, v, g) in enumerate(zip(master, mu, nu, grads, strict=True)):
    for name, x in (('master', m), ('mu', u), ('nu', v)):
      if x.dtype != jnp.float32 or x.shape != m.shape or not x.ndim:
        raise ValueError(
          f'adam_step_row: leaf {j}: {name} must be f32[L, ...] like the '
          f'master {m.shape}, got {x.dtype}{list(x.shape)}'
        )
    rows = m.shape[0]
    stacked = g.shape == m.shape
    if stacked != (grads[0].shape == master[0].shape):
      raise ValueError(
        f"adam_step_row: leaf {j}: the gradients must all be the row's or "
        f'all stacked like the masters; got {list(g.shape)} for '
        f'{list(m.shape)}'
      )
    shapes = ([] if stacked else [g.shape]) + (
      [] if params is None else [params[j].shape]
    )
    for shape in shapes:
      if m.size != rows * math.prod(shape):
        raise ValueError(
          f'adam_step_row: leaf {j}: stacked state {list(m.shape)} is not '
          f'{rows} rows of the row shape {list(shape)}'
        )
    if rows != master[0].shape[0]:
      raise ValueError(
        f'adam_step_row: leaf {j} has {rows} rows, leaf 0 {master[0].shape[0]}'
      )
    w = None if weights is None else weights[j]
    if w is not None and (
      w.dtype not in (jnp.bfloat16, jnp.float16) or w.shape != m.shape
    ):
      raise ValueError(
        f'adam_step_row: leaf {j}: weights must be bf16 or f16 shaped like '
        f'the master {m.shape}, got {w.dtype}{list(w.shape)}'
      )


def adam_step_row(
  master: list[jax.Array],
  mu: list[jax.Array],
  nu: list[jax.Array],
  grads: list[jax.Array],
  row: jax.typing.ArrayLike,
  hyper: Hyperparams,
  *,
  params: list[jax.Array] | None = None,
  weights: list[jax.Array] | None = None,
  keep_nonfinite: bool = False,
  place: Place | None = None,
  scalars: list[jax.Array] | None = None,
  weights_over_grads: bool = False,
) -> list[jax.Array]:
  """Steps row `row` of stacked fp32 state in place.

  `master`, `mu` and `nu` are ``f32[L, ...]`` per leaf (a scanned layer
  stack's state; pinned host memory on a GPU), `grads` row `row`'s
  gradients (f32, bf16 or f16; L-th part of the state's size each) or
  every row's, shaped like the masters (stacked, see below), `row` an
  int32 scalar (a scan's counter), read when the step runs. Elements
  ``[row * n, (row + 1) * n)`` of each leaf's state take exactly the step
  `adam_step_segments` takes on that row as its own bucket (with `params`,
  the row's parameters, re-seeded first). The call writes the state where
  it lives, without results: no copy, also as a loop-invariant operand of
  a scan. Whoever reads the state afterwards must order that read after
  the call: a stream join after the loop, aliasing the state, whose
  barrier is a value the loop computes (the stacked gradients; on a
  constant one XLA:CPU copied the state for the join before the loop, and
  the steps' writes were lost). On a GPU the join also reports a row
  outside ``[0, L)``; on the CPU the call fails at once. With `weights`
  (bf16 or f16, shaped like the master; pinned host memory on a GPU),
  the same pass writes row `row` of each with its new master rounded to
  nearest even, in place like the state, and leaves their other rows as
  they were. No sum of squares. `place` moves every operand but the
  state, `weights` and stacked gradients (see `Place`).

  Returns `grads`. Stacked ones pass through the call, aliased: the step
  reads its row where they are when it runs (on a GPU its worker fetches
  it, so the compute stream waits for no gradient copy), so they must
  stay alive, unchanged, until a join that waits for it (`join_rows`'s
  `keep`); write the next rows into the returned arrays. With them `row`
  is a cursor (`row_cursor`, set to L before the loop): the call steps
  row ``cursor - 1`` and leaves the cursor there, so the calls of a loop
  running its rows from L - 1 down need no row from the device; and on a
  GPU the call holds its inputs: `scalars` (`scalar_operands`, made before
  the loop) and the cursor must stay alive until that join too, and the
  compute stream waits for nothing. `weights_over_grads` (stacked
  gradients, no `weights`): the step writes each leaf's new master, in its
  gradient's dtype (rounded to nearest even), over the row of the
  gradient it read (on a GPU its worker copies it back there): after the
  join the returned arrays hold the new weights (`written_rows`).
  """
  _check_row_leaves(master, mu, nu, grads, params, weights, weights_over_grads)
  kept = [j for j, g in enumerate(grads) if g.size]
  if not kept:
    return list(grads)
  place = place or _as_is
  stacked = grads[kept[0]].shape == master[kept[0]].shape

  def run(xs):
    return [xs[j] for j in kept]

  operands = [
    *(scalars or _scalar_operands(hyper, place)),
    _row_operand(row, stacked, place),
    *run(master),
    *run(mu),
    *run(nu),
    *(run(grads) if stacked else (place(g) for g in run(grads))),
    *(place(p) for p in (run(params) if params is not None else ())),
    *(run(weights) if weights is not None else ()),
  ]
  first_grad = len(operands) - len(kept) * (
    1 + (params is not None) + (weights is not None)
  )
  call = jax.ffi.ffi_call(
    ADAM_STEP_ROW_TARGET,
    _like(run(grads)) if stacked else (),
    has_side_effect=True,
    input_output_aliases=_aliases(first_grad, 0, len(kept)) if stacked else {},
  )
  out = call(
    *operands,
    **_bucket_attrs(
      hyper,
      len(kept),
      keep_nonfinite=keep_nonfinite,
      reseed=params is not None,
      staging_bytes=getattr(place, 'staging_bytes', 0),
      hold_inputs=stacked and getattr(place, 'join', False),
      weights_over_grads=weights_over_grads,
    ),
  )
  passed = dict(zip(kept, out, strict=True)) if stacked else {}
  return [passed.get(j, g) for j, g in enumerate(grads)]


def _row_operand(row: jax.typing.ArrayLike, stacked: bool, place: Place):
  """A row step's row: the row, or with stacked gradients the cursor.

  Raises:
    ValueError: If a cursor is not an int32[1] array.
  """
  if not stacked:
    return place(jnp.asarray(row, jnp.int32).reshape(1))
  if jnp.shape(row) != (1,) or jnp.result_type(row) != jnp.int32:
    raise ValueError(
      'adam_step_row: with stacked gradients the row is a cursor, an int32[1] '
      f'array; got {jnp.result_type(row)}{list(jnp.shape(row))}'
    )
  return row


def written_rows(buffers: list[jax.Array], joined: jax.Array) -> list:
  """Buffers row steps wrote their new weights over, after their join.

  `buffers`: stacked gradients that `adam_step_row(...,
  weights_over_grads=True)` steps wrote over, as the loop left them;
  `joined`: a result of the join (`join_rows`) that waited for those
  steps, and on a GPU for their workers' copies back. Passed on, aliased,
  by a join of their own ordered after it: reads of the weights come after.
  """
  return _passed_on(buffers, joined)


def scalar_operands(hyper: Hyperparams, place: Place) -> list[jax.Array]:
  """A row step's count and packed scalars, to make once, before a loop.

  `adam_step_row(..., scalars=...)` of stacked gradients holds them until
  the join: inside the loop they would be a temporary of each iteration.
  """
  return _scalar_operands(hyper, place)


def row_cursor(rows: int) -> jax.Array:
  """A row cursor for `adam_step_row` of stacked gradients, set to `rows`.

  An int32[1] host buffer of the step's own (not a constant): through a
  stream claim, which passes it on and waits for nothing, unlike a join,
  which would wait for the host steps started before it.
  """
  start = host_memory.to_host(jnp.full((1,), rows, jnp.int32))
  return _typed_like(_passing(STREAM_CLAIM_TARGET, [start]), [start])[0]


def reseed_rows(
  master: list[jax.Array],
  params: list[jax.Array],
  hyper: Hyperparams,
  *,
  params_unchanged: jax.typing.ArrayLike = False,
  place: Place | None = None,
) -> list[jax.Array]:
  """Stacked masters re-seeded from stacked `params`, a row at a time.

  `master` are ``f32[L, ...]`` per leaf (host memory on a GPU), each
  aliased to its result; `params` the stacked parameters (f32, bf16 or
  f16, as many elements); `hyper` the row steps' (their learning rate sets
  the re-seed's tolerance). Each row becomes what `adam_step_row` with
  ``params=`` would re-seed it to, so that the row steps then take no
  parameters. Unless `params_unchanged` (a bool scalar, read when the
  re-seed runs: the parameters are the weights the last step produced,
  which would re-seed nothing), the call reads the parameters, a row at a
  time: on a GPU its worker copies each row then, through one row of
  staging, while the stack, unlike a row of it inside a loop, is alive.
  One call per stack: XLA:GPU's host-offload legalization took minutes
  and 24 GB on the 1B step's twenty per-row calls chained through the
  masters. The results are the masters, typed where they live. `place`
  moves every operand but the masters (see `Place`).
  """
  if not master:
    return []
  if len(params) != len(master):
    raise ValueError(
      f'reseed_rows: {len(master)} master leaves but {len(params)} params'
    )
  for j, (m, p) in enumerate(zip(master, params, strict=True)):
    if m.dtype != jnp.float32 or not m.ndim or m.size != p.size:
      raise ValueError(
        f'reseed_rows: leaf {j}: master {m.dtype}{list(m.shape)} must be '
        f'f32[L, ...] with as many elements as its params {list(p.shape)}'
      )
    if m.shape[0] != master[0].shape[0]:
      raise ValueError(
        f'reseed_rows: leaf {j} has {m.shape[0]} rows, leaf 0 '
        f'{master[0].shape[0]}'
      )
  place = place or _as_is
  operands = [
    *_scalar_operands(hyper, place),
    place(_unchanged(params_unchanged)),
    *master,
    *(place(p) for p in params),
  ]
  call = jax.ffi.ffi_call(
    ADAM_RESEED_ROWS_TARGET,
    _like(master),
    input_output_aliases=_aliases(3, 0, len(master)),
    has_side_effect=True,
  )
  out = call(
    *operands,
    **_bucket_attrs(
      hyper,
      len(master),
      reseed=True,
      staging_bytes=getattr(place, 'staging_bytes', 0),
    ),
  )
  return _typed_like(list(out), master)


def join_rows(
  state: list[jax.Array],
  barrier: jax.Array,
  *,
  to_device: int = 0,
  keep: Sequence[jax.Array] = (),
) -> tuple[list[jax.Array], list[jax.Array]]:
  """Stacked state after every row step started on it: an aliasing join.

  Pass `state` through the stream join (nothing copied; on a GPU it waits
  for the launches started on the stream so far). Row steps write where
  the state lives without results, so only this call orders a read of it
  after them: its `barrier` must be a value the loop computes (see
  `adam_step_row`). Called before the loop with a constant barrier, it
  hands the row steps buffers of the step's own (a state the caller did
  not donate is copied there, never written under them). Returns the
  state, typed where it lives, and device copies of its first
  `to_device` arrays (a call of our own on a GPU, see `_to_device`).
  `keep`: operands a launch may still read (`reseed_rows`' parameters),
  kept alive until the join.
  """
  if not state:
    return [], []
  out = _typed_like(_passing(STREAM_JOIN_TARGET, state, barrier, *keep), state)
  first = out[:to_device]
  if backend.target() == 'gpu':
    return out, _to_device(first)
  return out, [host_memory.to_device(x) for x in first]
