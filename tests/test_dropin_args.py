"""The arguments, read and checked as optax's are.

The signatures' annotations are the objects optax's are (not the strings
`from __future__ import annotations` makes of them), so code that inspects
them (optax's own `ScheduleAsLearningRateTest`) sees that a schedule is
accepted. Bad scalar arguments are refused when the optimizer is built,
with one line; schedules stay accepted.
"""

import inspect

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax._src import base

import jax_superoffload as superoffload


@pytest.mark.parametrize('name', ['adam', 'adamw'])
def test_annotations_are_optax_objects(name):
  ours = inspect.signature(getattr(superoffload, name)).parameters
  theirs = inspect.signature(getattr(optax, name)).parameters
  shared = [n for n in theirs if n in ours]
  assert 'learning_rate' in shared and len(shared) >= 6
  for n in shared:
    assert ours[n].annotation == theirs[n].annotation, n
  # optax's ScheduleAsLearningRateTest reads it so.
  assert ours['learning_rate'].annotation in (
    base.ScalarOrSchedule,
    base.Schedule,
  )


@pytest.mark.parametrize(
  ('kwargs', 'error', 'words'),
  [
    ({'learning_rate': '1e-3'}, TypeError, 'learning_rate must be a number'),
    ({'weight_decay': '0.1'}, TypeError, 'weight_decay must be a number'),
    ({'learning_rate': [1e-3]}, TypeError, 'learning_rate must be a number'),
    ({'learning_rate': 1e-3 + 1j}, TypeError, 'real number'),
    ({'weight_decay': -0.1}, ValueError, 'weight_decay must be non-negative'),
    ({'weight_decay': np.float32(-1)}, ValueError, 'non-negative'),
  ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, words):
  kwargs = {'learning_rate': 1e-3, **kwargs}
  with pytest.raises(error, match=words) as caught:
    superoffload.adamw(**kwargs)
  assert '\n' not in str(caught.value)


@pytest.mark.parametrize(
  'kwargs',
  [
    {'learning_rate': optax.linear_schedule(1e-3, 0.0, 10)},
    {'learning_rate': 1e-3, 'weight_decay': optax.constant_schedule(0.1)},
    {'learning_rate': jnp.float32(1e-3), 'weight_decay': np.float64(0.0)},
    {'learning_rate': 1, 'weight_decay': 0},
  ],
)
def test_numbers_and_schedules_are_accepted(kwargs):
  tx = superoffload.adamw(**kwargs)
  params = {'w': jnp.ones(3)}
  updates, _ = tx.update({'w': jnp.ones(3)}, tx.init(params), params)
  assert np.all(np.isfinite(updates['w']))
