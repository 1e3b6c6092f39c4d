"""optax's own `AliasTest`, run on superoffload's `adam` and `adamw`.

The test source is read from the installed optax (`optax/_src/alias_test.py`)
and adapted in memory: its optimizer table keeps the adam and adamw cases,
and the optimizers it builds by those names are superoffload's. Each case
of `AliasTest` then runs as a test here.

Expected failures, each a documented difference (strict: they must fail):

- Recompilation: `test_optimization` asserts that the second `update`
  compiles nothing. Our `init` leaves the state committed to its memory
  spaces (pinned host memory), the first step's outputs carry their own
  placement, and JAX compiles once more for the changed input shardings;
  after that, no step compiles (tests/test_transform.py checks it).
- The moments' dtype for bf16 parameters with `mu_dtype=None`: fp32 here,
  the parameters' dtype in optax (see `adam`'s `mu_dtype`).
"""

import importlib.util
import pathlib
import re
import types
import unittest

import optax
import pytest

import jax_superoffload as superoffload

SELECTED = ('adam', 'adamw')
_RECOMPILES = (
  "init's state and a step's new state are committed to different "
  'placements, so JAX compiles the second update once more (documented)'
)
_FP32_MOMENTS = (
  'fp32 moments for bf16 parameters when mu_dtype=None, a deliberate '
  'difference from optax (documented in adam)'
)


def _source(recompile_check: bool = True) -> str:
  spec = importlib.util.find_spec('optax._src.alias_test')
  assert spec is not None and spec.origin, 'optax ships no alias_test.py'
  text = pathlib.Path(spec.origin).read_text()
  # Only AliasTest: the rest (L-BFGS) needs scikit-learn and tests no adam.
  text = text[: text.index('class LBFGSTest')]
  text = re.sub(r'^from sklearn import .*$', '', text, flags=re.M)
  # The table keeps the selected optimizers; sgd stays optax's own test.
  text = text.replace('_OPTIMIZERS_UNDER_TEST = (', '_ALL_OPTIMIZERS = (', 1)
  text = text.replace(
    '\nclass AliasTest(',
    '\n_OPTIMIZERS_UNDER_TEST = tuple(\n'
    "    c for c in _ALL_OPTIMIZERS if c['opt_name'] in SELECTED)\n"
    '\n\nclass AliasTest(',
    1,
  )
  text = text.replace(
    "opt_name=('sgd_mom', 'adam', 'adamw')", 'opt_name=SELECTED', 1
  )
  if not recompile_check:  # The rest of test_optimization, checked apart.
    assert text.count('        if it == 1:') == 1
    text = text.replace('        if it == 1:', '        if False:', 1)
  return text


def _ours() -> types.ModuleType:
  """optax's `alias` module with superoffload's adam and adamw."""
  from optax._src import alias

  ours = types.ModuleType('superoffload_alias')
  ours.__dict__.update(alias.__dict__)
  ours.adam = superoffload.adam
  ours.adamw = superoffload.adamw
  return ours


def _load(recompile_check: bool = True) -> type[unittest.TestCase]:
  module = types.ModuleType('optax_alias_peer')
  module.__dict__['SELECTED'] = SELECTED
  source = _source(recompile_check)
  exec(compile(source, 'optax/_src/alias_test.py', 'exec'), module.__dict__)
  module.alias = _ours()  # What _get_opt looks the optimizers up in.
  return module.AliasTest


# Not a module global, so that pytest does not collect the class itself.
_LOADED = {'AliasTest': _load(), 'NoRecompileCheck': _load(False)}
CASES = sorted(n for n in dir(_LOADED['AliasTest']) if n.startswith('test_'))


def _expected_failure(case: str, method) -> str | None:
  params = getattr(method, '__x_params_repr__', '') or ''
  if case.startswith('test_optimization'):
    return _RECOMPILES
  bf16_default = "params_dtype='bfloat16'" in params and (
    'state_dtype=None' in params
  )
  if case.startswith('test_explicit_dtype') and bf16_default:
    return _FP32_MOMENTS
  return None


def _params(case: str) -> pytest.param:
  reason = _expected_failure(case, getattr(_LOADED['AliasTest'], case))
  marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
  return pytest.param(case, marks=marks, id=case)


def test_the_selected_cases_are_there():
  # adam and adamw in each test of the table, and in test_explicit_dtype.
  assert len(CASES) == 64, len(CASES)
  assert _LOADED['AliasTest'].__module__ == 'optax_alias_peer'
  assert optax.adam is not superoffload.adam


@pytest.mark.parametrize('case', [_params(c) for c in CASES])
def test_alias(case):
  _LOADED['AliasTest'](case).debug()


@pytest.mark.parametrize(
  'case', [c for c in CASES if c.startswith('test_optimization')]
)
def test_optimization_but_the_second_compile(case):
  # The expected failures above stop at the recompile; the rest of the test
  # (convergence, tree_map_params, no compile once both placements are
  # compiled) must pass.
  _LOADED['NoRecompileCheck'](case).debug()
