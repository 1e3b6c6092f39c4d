"""Byte-level text corpus and a deterministic, resumable batch iterator.

The default corpus is the Python standard library's own source code, so a run
needs no downloads. Text is tokenized as raw bytes (vocab 256).

The iterator cuts the corpus into non-overlapping windows of ``seq_len + 1``
bytes, shuffles them once per epoch with a numpy RNG seeded by
``(seed, epoch)``, and yields them in batches. Its whole position is the small
dict ``{"seed", "epoch", "index"}`` of ints, so a checkpoint can store it and
`BatchIterator.set_state` can resume the exact same stream.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N803, N806

import pathlib
import sysconfig

import numpy as np

# Folders under the stdlib that hold third-party code, not the stdlib.
_SKIP_DIRS = frozenset({'site-packages', 'dist-packages', '__pycache__'})


def stdlib_dir() -> pathlib.Path:
  """Returns the directory of the Python standard library's sources."""
  return pathlib.Path(sysconfig.get_paths()['stdlib'])


def _is_text(data: bytes) -> bool:
  """Heuristic: treats files with a NUL byte in their head as binary."""
  return b'\0' not in data[:8192]


def _list_files(root: pathlib.Path, pattern: str) -> list[pathlib.Path]:
  """Sorted files under `root` matching `pattern`, skipping hidden/3rd-party."""
  files = []
  for path in root.rglob(pattern):
    parts = path.relative_to(root).parts
    if any(p in _SKIP_DIRS or p.startswith('.') for p in parts):
      continue
    if path.is_file():
      files.append(path)
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_corpus(path: str | None, max_bytes: int) -> np.ndarray:
  """Reads a byte-level corpus.

  Args:
    path: A text file, a folder (all its text files, sorted by relative
      path), or None for the stdlib's ``.py`` sources.
    max_bytes: Stop after this many bytes (files are cut at the cap).

  Returns:
    tokens_N: uint8 array of the corpus bytes, files joined by newlines.

  Raises:
    FileNotFoundError: If `path` does not exist.
    ValueError: If no text was found.
  """
  if path is None:
    files = _list_files(stdlib_dir(), '*.py')
  else:
    root = pathlib.Path(path).expanduser()
    if root.is_file():
      files = [root]
    elif root.is_dir():
      files = _list_files(root, '*')
    else:
      raise FileNotFoundError(f'no such file or folder: {path}')
  chunks, total = [], 0
  for file in files:
    if total >= max_bytes:
      break
    try:
      data = file.read_bytes()
    except OSError:
      continue
    if not data or not _is_text(data):
      continue
    data = data[: max_bytes - total]
    chunks.append(data)
    total += len(data)
  if not chunks:
    raise ValueError(f'no text found in {path or stdlib_dir()}')
  return np.frombuffer(b'\n'.join(chunks), dtype=np.uint8).copy()


class BatchIterator:
  """Deterministic shuffled batches of (inputs, targets) from a corpus.

  Each epoch visits every full window of ``seq_len + 1`` tokens once, in an
  order fixed by ``(seed, epoch)``; the window grid is shifted by a random
  per-epoch offset so epochs see different boundaries. A trailing partial
  batch of an epoch is dropped.
  """

  def __init__(
    self, tokens_N: np.ndarray, batch_size: int, seq_len: int, seed: int
  ):
    """Initializes the iterator at the start of epoch 0.

    Args:
      tokens_N: 1-D integer array of token ids.
      batch_size: Sequences per batch.
      seq_len: Tokens per input sequence.
      seed: Seed of the shuffling RNG.

    Raises:
      ValueError: If the corpus has fewer windows than one batch.
    """
    self.tokens_N = np.asarray(tokens_N)
    self.batch_size = batch_size
    self.seq_len = seq_len
    # Windows per epoch; one window of slack leaves room for the offset.
    self.num_windows = len(self.tokens_N) // (seq_len + 1) - 1
    if self.num_windows < batch_size:
      raise ValueError(
        f'corpus of {len(self.tokens_N)} tokens is too small for '
        f'batch_size={batch_size}, seq_len={seq_len}'
      )
    self.seed = seed
    self.epoch = 0
    self.index = 0
    self._order_epoch = -1
    self._offset = 0
    self._order = np.empty(0, np.int64)

  @property
  def batches_per_epoch(self) -> int:
    """Number of full batches in one epoch."""
    return self.num_windows // self.batch_size

  def get_state(self) -> dict[str, int]:
    """Returns the position as a small JSON-serializable dict of ints."""
    return {'seed': self.seed, 'epoch': self.epoch, 'index': self.index}

  def set_state(self, state: dict[str, int]) -> None:
    """Restores a position returned by `get_state`."""
    self.seed = int(state['seed'])
    self.epoch = int(state['epoch'])
    self.index = int(state['index'])
    self._order_epoch = -1

  def _ensure_order(self) -> None:
    """Computes the window order and offset of the current epoch."""
    if self._order_epoch != self.epoch:
      rng = np.random.default_rng([self.seed, self.epoch])
      self._offset = int(rng.integers(self.seq_len + 1))
      self._order = rng.permutation(self.num_windows)
      self._order_epoch = self.epoch

  def __iter__(self) -> 'BatchIterator':
    return self

  def __next__(self) -> tuple[np.ndarray, np.ndarray]:
    """Returns the next batch and advances the position.

    Returns:
      inputs_BxL: int32 token ids.
      targets_BxL: int32 next-token ids (inputs shifted by one).
    """
    if self.index + self.batch_size > self.num_windows:
      self.epoch += 1
      self.index = 0
    self._ensure_order()
    window = self.seq_len + 1
    ids_B = self._order[self.index : self.index + self.batch_size]
    starts_B = self._offset + ids_B * window
    idx_BxW = starts_B[:, None] + np.arange(window)[None, :]
    chunk_BxW = self.tokens_N[idx_BxW].astype(np.int32)
    self.index += self.batch_size
    return chunk_BxW[:, :-1], chunk_BxW[:, 1:]


def split_holdout(
  tokens_N: np.ndarray, fraction: float
) -> tuple[np.ndarray, np.ndarray]:
  """Cuts the corpus into a training head and a held-out tail.

  Args:
    tokens_N: The corpus.
    fraction: Share of the tokens, at the end, held out (0 holds none).

  Returns:
    ``(train_N, eval_M)``, which together are `tokens_N`.
  """
  held_out = int(len(tokens_N) * fraction)
  cut = len(tokens_N) - held_out
  return tokens_N[:cut], tokens_N[cut:]


def eval_batches(
  tokens_M: np.ndarray, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[np.ndarray, np.ndarray]]:
  """The fixed evaluation batches: consecutive windows of the held-out tail.

  Args:
    tokens_M: The held-out tokens.
    batch_size: Sequences per batch.
    seq_len: Tokens per input sequence.
    max_batches: At most this many batches.

  Returns:
    Up to `max_batches` pairs ``(inputs_BxL, targets_BxL)`` of int32, the
    same at every evaluation; [] when the tail holds less than one batch.
  """
  window = seq_len + 1
  num_batches = min(max_batches, len(tokens_M) // window // batch_size)
  batches = []
  for b in range(num_batches):
    start = b * batch_size * window
    chunk = tokens_M[start : start + batch_size * window]
    chunk_BxW = chunk.reshape(batch_size, window).astype(np.int32)
    batches.append((chunk_BxW[:, :-1], chunk_BxW[:, 1:]))
  return batches
