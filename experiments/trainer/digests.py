"""Checksums of sharded arrays that no process has to gather.

The digest of an array is the sum, mod 2**64, of splitmix64's finalizer
applied to (global flat index x golden ratio) XOR (the element's bits) over
every element. A sum does not depend on how the elements are split into
blocks, so each process digests the shards it holds (replica 0 of each, so
that a replicated block counts once), the processes add their parts with
one small all-gather, and the result is the same for any topology: a
checkpoint saved by 2 processes verifies when 1 or 4 restore it.

It is a checksum against damage, not a cryptographic hash: any one changed
element, or two swapped ones, changes it (unless the mixed values collide,
about 2**-64).
"""

import zlib
from typing import Any

import jax
import numpy as np


class DamagedCheckpointError(Exception):
  """A checkpoint whose content differs from what was saved."""


# The checksum of checkpoints written since digests replaced CRC-32s.
KIND = 'sum-splitmix64'
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
# Elements digested at a time (bounds the temporary arrays' memory).
_CHUNK = 1 << 20


def _mix(z: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
  z = (z ^ (z >> np.uint64(30))) * _M1
  z = (z ^ (z >> np.uint64(27))) * _M2
  return z ^ (z >> np.uint64(31))


def _block_digest(
  data: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]
) -> int:
  """Sum mod 2**64 of mix(global flat index, element bits) over a block.

  `data` is the block ``array[index]`` of a global array of `shape`; the
  sum over any partition of the array into blocks is the same, so the
  digest does not depend on how the array is sharded.
  """
  data = np.ascontiguousarray(data)
  bits = data.view(f'u{data.dtype.itemsize}').astype(np.uint64)
  strides = [int(np.prod(shape[k + 1 :])) for k in range(len(shape))]
  flat = np.zeros(data.shape, np.uint64)
  for axis, (part, stride) in enumerate(zip(index, strides, strict=True)):
    start = part.start or 0
    offsets = np.arange(data.shape[axis], dtype=np.uint64) + np.uint64(start)
    view = [1] * data.ndim
    view[axis] = -1
    flat = flat + (offsets * np.uint64(stride)).reshape(view)
  flat, bits = flat.reshape(-1), bits.reshape(-1)
  total = np.uint64(0)
  with np.errstate(over='ignore'):
    for i in range(0, flat.size, _CHUNK):
      part = _mix(flat[i : i + _CHUNK] * _GOLDEN ^ bits[i : i + _CHUNK])
      total += part.sum(dtype=np.uint64)
  return int(total)


def local_digest(x: Any) -> int:
  """This process's part of `x`'s digest: its shards of replica 0 only.

  A NumPy array (the same on every process) counts on process 0 only.
  """
  if not isinstance(x, jax.Array):
    if jax.process_index() != 0:
      return 0
    x = np.asarray(x)
    return _block_digest(x, tuple(slice(0, n) for n in x.shape), x.shape)
  total = 0
  for shard in x.addressable_shards:
    if shard.replica_id == 0:
      data = np.asarray(shard.data)
      total += _block_digest(data, shard.index, x.shape)
  return total % 2**64


def vote(local: list[int], ok: bool) -> tuple[list[int], list[int]]:
  """Sums every process's digests and names the processes not `ok`.

  A collective over processes (every process calls it with as many
  digests); alone, nothing to add.
  """
  if jax.process_count() == 1:
    return local, [] if ok else [0]
  from jax.experimental import multihost_utils

  words = np.array(
    [int(ok)] + [w for d in local for w in (d & 0xFFFFFFFF, d >> 32)],
    np.uint32,
  )
  rows = np.asarray(multihost_utils.process_allgather(words))
  failed = [p for p, row in enumerate(rows) if not row[0]]
  halves = rows[:, 1:].astype(np.uint64).reshape(len(rows), -1, 2)
  sums = [
    int(sum(int(lo) | int(hi) << 32 for lo, hi in halves[:, i]) % 2**64)
    for i in range(halves.shape[1])
  ]
  return sums, failed


def global_digests(arrays: Any) -> list[int]:
  """The digest of every array, summed over processes (a collective)."""
  return vote([local_digest(x) for x in arrays], ok=True)[0]


# Checkpoints written before the digests: CRC-32s of whole arrays.


def _crc32(x: Any) -> int:
  """CRC-32 of an array's bytes (brought to host memory).

  An array sharded over several processes is gathered whole first (a
  collective: every process calls this for the same arrays in the same
  order), so the checksum does not depend on the topology and a restore
  onto another process count verifies it too.
  """
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    x = multihost_utils.process_allgather(x, tiled=True)
  data = np.ascontiguousarray(np.asarray(x))
  return zlib.crc32(data.reshape(-1).view(np.uint8))


def verify_crc32(arrays: dict[str, Any], saved: Any) -> None:
  """Raises `DamagedCheckpointError` on the first array whose CRC differs."""
  if saved is None:  # Written before checksums existed.
    return
  for key, x in arrays.items():
    if saved.get(key) != _crc32(x):
      raise DamagedCheckpointError(f'array {key} fails its checksum')
