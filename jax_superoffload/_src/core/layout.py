"""The schedule of kernel calls for a parameter tree, and its checks.

Leaves the kernel covers (float32, bfloat16 and float16 parameters) are
grouped by (parameter dtype, weight decay on/off), so one kernel call per
bucket serves every leaf in it; each group's leaves are taken in order and
split, at leaf boundaries, into buckets of about `bucket_elements` (a leaf
is never split: one larger than that is a bucket of its own). A bucket is
only a schedule: each leaf keeps its own state arrays, shaped like it, and
the kernel reads each gradient and writes each new weight where it
is. Every other numeric leaf (float64, complex, integer, bool) goes to an
optax fallback, which steps it with optax's own math and dtypes. The layout
is a pure function of the tree's structure, shapes, dtypes and mask, so
`init` and `update` build the same one without storing it.

Mutable leaves (`jax.Ref`s, Flax's hijax `Variable`s) are read (`x[...]`)
where they enter: the optimizer sees the arrays they hold, as optax's math
does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_superoffload._src.core import host_memory

KERNEL_PARAM_DTYPES = (
  np.dtype(np.float32),
  np.dtype(jnp.bfloat16),
  np.dtype(np.float16),
)


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves sharing a parameter dtype and a weight-decay flag."""

  dtype: np.dtype
  decay: bool
  leaves: tuple[int, ...]  # Indices into the flattened tree.
  sizes: tuple[int, ...]
  buckets: tuple[tuple[int, ...], ...]  # Positions in `leaves` per bucket.

  @property
  def bucket_sizes(self) -> tuple[int, ...]:
    return tuple(sum(self.sizes[j] for j in b) for b in self.buckets)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a parameter tree maps onto buckets and the fallback."""

  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  groups: tuple[Group, ...]
  fallback: tuple[int, ...]  # Leaves updated by the optax fallback.
  fallback_decay: tuple[bool, ...]

  @property
  def bucket_sizes(self) -> tuple[int, ...]:
    return tuple(n for g in self.groups for n in g.bucket_sizes)

  @property
  def num_buckets(self) -> int:
    return len(self.bucket_sizes)


def _path_str(path) -> str:
  return jax.tree_util.keystr(path) or '<root>'


def resolve_mask(mask: Any, tree: Any) -> list[bool]:
  """Per-leaf booleans from an optax-style mask (tree prefix or callable)."""
  leaves = jax.tree.leaves(tree)
  if mask is None:
    return [True] * len(leaves)
  mask_tree = mask(tree) if callable(mask) else mask
  try:
    full = jax.tree.broadcast(mask_tree, tree)
  except ValueError as e:
    raise ValueError(f'mask does not match the parameter tree: {e}') from None
  flags = jax.tree.leaves(full)
  for flag in flags:
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(
        'mask leaves must be Python booleans (the bucket layout is static),'
        f' got {type(flag).__name__}'
      )
  return [bool(f) for f in flags]


_SCALARS = (bool, int, float, complex, np.generic)
_PLAIN = (jax.Array, np.ndarray, jax.ShapeDtypeStruct, *_SCALARS)
_REF = getattr(jax, 'Ref', None)  # jax.new_ref's arrays (JAX >= 0.7).


def held_value(leaf: Any) -> Any:
  """`leaf`, or the array a mutable or array-like leaf holds.

  A `jax.Ref` (or a tracer of one) and a traced Flax hijax `Variable`
  (whose abstract value is no `ShapedArray`) are read with `leaf[...]`; an
  eager hijax `Variable` (any object with `__jax_array__`) as `jnp.asarray`
  reads it.
  """
  if isinstance(leaf, jax.core.Tracer):
    plain = isinstance(leaf.aval, jax.core.ShapedArray)
    return leaf if plain else leaf[...]
  if isinstance(leaf, _PLAIN):
    return leaf
  if _REF is not None and isinstance(leaf, _REF):
    return leaf[...]
  return jnp.asarray(leaf) if hasattr(leaf, '__jax_array__') else leaf


def is_ref(leaf: Any) -> bool:
  """Whether `leaf` lives in a `jax.Ref` (Flax's `ref=True` Variables too)."""
  if isinstance(leaf, jax.core.Tracer):
    return hasattr(leaf.aval, 'inner_aval')  # An AbstractRef.
  if _REF is not None and isinstance(leaf, _REF):
    return True
  return hasattr(leaf, '__jax_array__') and getattr(leaf, 'ref', 0) is True


@functools.cache
def refs_hold_host_memory() -> bool:
  """Whether this JAX keeps an array in pinned host memory in a `jax.Ref`.

  JAX 0.10 refuses to put one there ("Aval memory space MemorySpace.Host
  does not match the requested memory space None"); JAX 0.12 takes it and
  reads it back in device memory (on the CPU). True without host memory.
  """
  if _REF is None or not host_memory.host_memory_available():
    return True
  try:
    ref = jax.new_ref(host_memory.to_host(jnp.zeros((1,))))
  except ValueError:
    return False
  return not host_memory.typed_on_device(ref[...])


def as_array(leaf: Any) -> jax.Array:
  """A leaf as the array optax's math makes of it (scalars included)."""
  return leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)


def shape_dtype(leaf: Any) -> tuple[tuple[int, ...] | None, Any]:
  """The shape and dtype of a parameter, as optax reads them.

  Arrays, tracers and `jax.ShapeDtypeStruct`s by their own; NumPy arrays
  and Python and NumPy scalars as `jnp.asarray` makes them (a Python float
  is float32, and so is a NumPy float64 without `jax_enable_x64`). (None,
  None) for anything else. Extended dtypes (PRNG keys) are returned as JAX
  has them, the others as NumPy dtypes.
  """
  leaf = held_value(leaf)
  if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
    dtype = leaf.dtype
    if not jnp.issubdtype(dtype, jax.dtypes.extended):
      dtype = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    return tuple(leaf.shape), dtype
  if isinstance(leaf, _SCALARS):
    return (), np.dtype(jnp.result_type(leaf))
  return None, None


def is_numeric(dtype: Any) -> bool:
  """Whether Adam's math (optax's) applies: numbers and booleans."""
  return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)


def build_layout(
  tree: Any, decay: Sequence[bool], *, bucket_elements: int, use_kernel: bool
) -> Layout:
  """Assigns each leaf of `tree` to a bucket group or to the fallback."""
  leaves_with_paths, treedef = jax.tree.flatten_with_path(tree)
  paths = tuple(_path_str(p) for p, _ in leaves_with_paths)
  shapes, dtypes = [], []
  for path, (_, leaf) in zip(paths, leaves_with_paths, strict=True):
    shape, dtype = shape_dtype(leaf)
    if shape is None:
      raise TypeError(f'parameter {path} is not an array: {type(leaf)}')
    if not is_numeric(dtype):
      raise TypeError(
        f'parameter {path} has dtype {dtype}{list(shape)}; Adam steps '
        'numbers (exclude such leaves, e.g. with optax.multi_transform or '
        'nnx.Optimizer(wrt=nnx.Param))'
      )
    shapes.append(shape)
    dtypes.append(dtype)
  members: dict[tuple[np.dtype, bool], list[int]] = {}
  fallback = []
  for i, dtype in enumerate(dtypes):
    if use_kernel and dtype in KERNEL_PARAM_DTYPES:
      members.setdefault((dtype, bool(decay[i])), []).append(i)
    else:
      fallback.append(i)
  groups = []
  for (dtype, group_decay), idx in sorted(
    members.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])
  ):
    sizes = tuple(int(np.prod(shapes[i], dtype=np.int64)) for i in idx)
    groups.append(
      Group(
        dtype,
        group_decay,
        tuple(idx),
        sizes,
        _split(sizes, bucket_elements),
      )
    )
  return Layout(
    treedef,
    paths,
    tuple(shapes),
    tuple(dtypes),
    tuple(groups),
    tuple(fallback),
    tuple(bool(decay[i]) for i in fallback),
  )


def _split(sizes: Sequence[int], target: int) -> tuple[tuple[int, ...], ...]:
  """Greedy buckets of whole leaves, each up to `target` elements."""
  buckets, current, filled = [], [], 0
  for j, size in enumerate(sizes):
    if current and filled > 0 and filled + size > target:
      buckets.append(tuple(current))
      current, filled = [], 0
    current.append(j)
    filled += size
  if filled > 0:
    buckets.append(tuple(current))
  elif current and buckets:  # Trailing zero-size leaves join the last one.
    buckets[-1] += tuple(current)
  return tuple(buckets)


def check_tree(layout: Layout, tree: Any, what: str) -> list[Any]:
  """Flattens `tree` against the layout, naming any mismatching leaf.

  The leaves are returned as given (Python and NumPy scalars included),
  mutable ones read (`held_value`); `as_array` makes arrays of them.
  """
  leaves_with_paths, treedef = jax.tree.flatten_with_path(tree)
  if treedef != layout.treedef:
    got = {_path_str(p) for p, _ in leaves_with_paths}
    want = set(layout.paths)
    missing = sorted(want - got)[:3]
    extra = sorted(got - want)[:3]
    raise ValueError(
      f"{what} do not have the parameters' tree structure: missing "
      f'{missing or "none"}, unexpected {extra or "none"}; got {treedef}, '
      f'expected {layout.treedef}'
    )
  leaves = [held_value(leaf) for _, leaf in leaves_with_paths]
  for path, leaf, shape in zip(
    layout.paths, leaves, layout.shapes, strict=True
  ):
    if tuple(np.shape(leaf)) != shape:
      raise ValueError(
        f'{what} leaf {path} has shape {tuple(np.shape(leaf))}, the '
        f'parameter has shape {shape}'
      )
    if not is_numeric(jnp.result_type(leaf)):
      raise TypeError(
        f'{what} leaf {path} has non-numeric dtype {jnp.result_type(leaf)}'
      )
  return leaves
