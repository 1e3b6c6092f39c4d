"""Every code block of the README section "Use it in your own loop" runs."""

import math
import pathlib
import re

import pytest

_README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'
_SECTION = '## Use it in your own loop'


def _examples() -> list[str]:
  text = _README.read_text()
  section = text[text.index(_SECTION) :]
  section = section[: section.index('\n## ', len(_SECTION))]
  return re.findall(r'```python\n(.*?)```', section, flags=re.DOTALL)


def test_the_section_has_optax_nnx_and_linen_examples():
  examples = _examples()
  assert len(examples) == 3
  assert 'tx.update' in examples[0]
  assert 'nnx.Optimizer' in examples[1]
  assert 'TrainState' in examples[2]
  for code in examples:
    assert 'superoffload.adamw' in code


@pytest.mark.parametrize('index', range(3))
def test_example_runs_and_fits(index):
  pytest.importorskip('jax_superoffload')
  namespace: dict = {}
  exec(
    compile(_examples()[index], f'README example {index}', 'exec'), namespace
  )
  loss = float(namespace['loss'])
  # Fitting a constant target with a linear layer: the loss goes to ~0.
  assert math.isfinite(loss) and loss < 0.05, loss
