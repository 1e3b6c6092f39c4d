"""Tests for experiments.trainer.data: corpus reading, deterministic batches."""

import json

import numpy as np
import pytest

from experiments.trainer import data


def _tokens(n: int = 5000) -> np.ndarray:
  return (np.arange(n) % 251).astype(np.uint8)


def test_stdlib_corpus_is_deterministic_and_capped():
  a = data.read_corpus(None, 50_000)
  b = data.read_corpus(None, 50_000)
  assert a.dtype == np.uint8
  assert len(a) <= 50_000 + 100  # Plus newline separators.
  assert len(a) >= 40_000
  np.testing.assert_array_equal(a, b)


def test_reads_file_and_folder(tmp_path):
  (tmp_path / 'b.txt').write_text('world')
  (tmp_path / 'a.txt').write_text('hello')
  (tmp_path / 'blob.bin').write_bytes(b'\0\1\2')
  (tmp_path / '.hidden').write_text('secret')
  folder = data.read_corpus(str(tmp_path), 1000)
  assert folder.tobytes() == b'hello\nworld'
  single = data.read_corpus(str(tmp_path / 'b.txt'), 3)
  assert single.tobytes() == b'wor'
  with pytest.raises(FileNotFoundError):
    data.read_corpus(str(tmp_path / 'missing'), 10)


def test_batches_are_shifted_targets():
  it = data.BatchIterator(_tokens(), batch_size=4, seq_len=16, seed=0)
  inputs, targets = next(it)
  assert inputs.shape == targets.shape == (4, 16)
  assert inputs.dtype == np.int32
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


def test_same_seed_same_stream_other_seed_differs():
  a = data.BatchIterator(_tokens(), 4, 16, seed=1)
  b = data.BatchIterator(_tokens(), 4, 16, seed=1)
  c = data.BatchIterator(_tokens(), 4, 16, seed=2)
  for _ in range(5):
    xa, _ = next(a)
    xb, _ = next(b)
    xc, _ = next(c)
    np.testing.assert_array_equal(xa, xb)
  assert not np.array_equal(xa, xc)


def test_state_round_trip_across_epochs():
  tokens = _tokens(2000)
  it = data.BatchIterator(tokens, 4, 16, seed=3)
  per_epoch = it.batches_per_epoch
  for _ in range(per_epoch + 2):  # Cross an epoch boundary.
    next(it)
  state = it.get_state()
  assert set(state) == {'seed', 'epoch', 'index'}
  assert all(isinstance(v, int) for v in state.values())
  expected = [next(it)[0] for _ in range(per_epoch + 1)]

  restored = data.BatchIterator(tokens, 4, 16, seed=0)
  restored.set_state(json.loads(json.dumps(state)))
  for want in expected:
    np.testing.assert_array_equal(next(restored)[0], want)


def test_epoch_visits_each_window_once():
  tokens = np.arange(17 * 40, dtype=np.int64)
  it = data.BatchIterator(tokens, 3, 16, seed=0)
  starts = [int(x[0]) for _ in range(it.batches_per_epoch) for x in next(it)[0]]
  assert len(set(starts)) == len(starts)
  assert it.get_state()['epoch'] == 0
  next(it)
  assert it.get_state()['epoch'] == 1


def test_too_small_corpus_raises():
  with pytest.raises(ValueError, match='too small'):
    data.BatchIterator(_tokens(50), 4, 16, seed=0)
