"""The Linen + TrainState example trains like optax.adamw with superoffload."""

import numpy as np

from experiments.trainer import linen_train

_CORPUS = 'the quick brown fox jumps over the lazy dog. ' * 400


def test_linen_train_state_with_superoffload_matches_optax(tmp_path, capsys):
  data = tmp_path / 'corpus.txt'
  data.write_text(_CORPUS)
  argv = [f'--data={data}', '--steps=12', '--batch-size=4', '--seq-len=32']
  assert linen_train.main(argv) == 0
  out = capsys.readouterr().out
  assert 'step 0: loss' in out and 'done: loss' in out
  losses = linen_train.train(str(data), 12, 'superoffload', 4, 32)
  reference = linen_train.train(str(data), 12, 'optax', 4, 32)
  assert losses[-1] < 0.7 * losses[0]
  # Same init, data and AdamW math: the same losses up to fp32 rounding.
  np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-4)
