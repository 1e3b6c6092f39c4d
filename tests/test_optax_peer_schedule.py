"""optax's own `ScheduleAsLearningRateTest`, run on superoffload's adam/adamw.

The test (optax/schedules/_schedule_test.py) reads each optimizer's
signature, skips those whose `learning_rate` annotation is not optax's
`ScalarOrSchedule` ("Optimizer doesn't accept a learning schedule"), and
checks that a constant schedule steps as the same constant does. Its
source is read from the installed optax and run with superoffload's adam
and adamw in the place of optax's (the adam and adamw cases of optax's
optimizer table only). A skip counts as a failure here: the annotation is
what the test is about (the arguments are read as optax reads them).
"""

import importlib.util
import pathlib
import types
import unittest

import pytest
import test_optax_alias_peer as alias_peer


def _module(name: str) -> str:
  spec = importlib.util.find_spec(name)
  assert spec is not None and spec.origin, f'optax ships no {name}'
  return pathlib.Path(spec.origin).read_text()


def _table() -> types.ModuleType:
  """optax's alias_test, its optimizer table cut to adam and adamw."""
  table = types.ModuleType('optax_alias_table')
  table.SELECTED = alias_peer.SELECTED
  exec(compile(alias_peer._source(), 'alias_test.py', 'exec'), table.__dict__)
  return table


def _load(table: types.ModuleType) -> type[unittest.TestCase]:
  """ScheduleAsLearningRateTest over superoffload's adam and adamw."""
  text = _module('optax.schedules._schedule_test')
  text = text[: text.index("if __name__ == '__main__':")]
  for line in (
    'from optax._src import alias\n',
    'from optax._src import alias_test\n',
  ):
    assert line in text, line
    text = text.replace(line, '')
  module = types.ModuleType('optax_schedule_peer')
  module.alias = alias_peer._ours()
  module.alias_test = table
  exec(compile(text, '_schedule_test.py', 'exec'), module.__dict__)
  return module.ScheduleAsLearningRateTest


_TABLE = _table()
_TEST = _load(_TABLE)  # pytest collects no TestCase named with a "_".
CASES = sorted(n for n in dir(_TEST) if n.startswith('test_optimization'))


def test_only_the_adam_and_adamw_cases_run():
  selected = _TABLE._OPTIMIZERS_UNDER_TEST
  assert {c['opt_name'] for c in selected} == set(alias_peer.SELECTED)
  assert len(CASES) == len(selected)
  assert _TEST.__module__ == 'optax_schedule_peer'


@pytest.mark.parametrize('case', CASES)
def test_schedule_as_learning_rate(case):
  result = unittest.TestResult()
  _TEST(case).run(result)
  problems = result.failures + result.errors
  assert not problems, problems[0][1]
  assert not result.skipped, result.skipped[0][1]
