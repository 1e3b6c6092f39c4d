"""The README's "## API" section lists exactly the public API, as it is.

Each list item of the section documents one name by its first code span:
`name` or `name(params)` for a name of `jax_superoffload.__all__`, and
`kernels.name...` / `ulysses.name...` for a name of that submodule's
`__all__` (every module in `jax_superoffload.__all__` is checked this way).
Functions must carry a signature; classes may. A signature's parameters
must be those of `inspect.signature`, in order, with `*` before the
keyword-only ones, `/` after positional-only ones and `=...` on exactly
those with a default (the defaults' text is not compared).
"""

import inspect
import pathlib
import re
import types

import pytest

import jax_superoffload

_README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'
_HEADING = '## API'
# A list item (nested or not) whose text starts with a code span.
_ITEM = re.compile(r'^[ \t]*[-*] `([^`]+)`', re.MULTILINE)
_ENTRY = re.compile(r'([A-Za-z_][\w.]*)(?:\((.*)\))?')
_SUBMODULES = {
  name: getattr(jax_superoffload, name)
  for name in jax_superoffload.__all__
  if isinstance(getattr(jax_superoffload, name), types.ModuleType)
}


def _section() -> str:
  text = _README.read_text()
  starts = [m.end() for m in re.finditer(r'^## API[ \t]*$', text, re.M)]
  assert len(starts) == 1, f'README.md needs one {_HEADING!r} heading'
  section = text[starts[0] :]
  end = re.search(r'^## ', section, re.MULTILINE)
  return section[: end.start()] if end else section


def _entries() -> list[tuple[str, str | None]]:
  """(qualified name, signature text or None) of each documented item."""
  entries = []
  for span in _ITEM.findall(_section()):
    match = _ENTRY.fullmatch(span.strip())
    assert match, f'README {_HEADING}: cannot read the entry `{span}`'
    entries.append((match.group(1), match.group(2)))
  return entries


def _split_params(text: str) -> list[str]:
  """Splits `a, b=(1, 2), *, c='x,y'` at its top-level commas."""
  tokens, depth, quote, start = [], 0, None, 0
  for i, char in enumerate(text):
    if quote:
      quote = None if char == quote else quote
    elif char in '\'"':
      quote = char
    elif char in '([{':
      depth += 1
    elif char in ')]}':
      depth -= 1
    elif char == ',' and depth == 0:
      tokens.append(text[start:i])
      start = i + 1
  tokens.append(text[start:])
  return [t.strip() for t in tokens if t.strip()]


def _readme_form(text: str) -> list[str]:
  """`a, b=1, *, c=...` as ['a', 'b=', '*', 'c=']."""
  form = []
  for token in _split_params(text):
    name, has_default, _ = token.partition('=')
    form.append(name.strip() + has_default)
  return form


def _code_form(obj) -> list[str]:
  """`inspect.signature(obj)` in the form of `_readme_form`."""
  params = list(inspect.signature(obj).parameters.values())
  form, star = [], False
  for i, param in enumerate(params):
    kind = param.kind
    if kind is param.VAR_POSITIONAL:
      form.append('*' + param.name)
      star = True
      continue
    if kind is param.VAR_KEYWORD:
      form.append('**' + param.name)
      continue
    if kind is param.KEYWORD_ONLY and not star:
      form.append('*')
      star = True
    has_default = param.default is not param.empty
    form.append(param.name + ('=' if has_default else ''))
    following = params[i + 1] if i + 1 < len(params) else None
    if kind is param.POSITIONAL_ONLY and (
      following is None or following.kind is not param.POSITIONAL_ONLY
    ):
      form.append('/')
  return form


def _names(form: list[str]) -> list[str]:
  return [t.lstrip('*').rstrip('=') for t in form if t not in ('*', '/')]


def _resolve(qualified: str):
  module_name, _, name = qualified.rpartition('.')
  module = _SUBMODULES[module_name] if module_name else jax_superoffload
  return getattr(module, name)


def _documented(module_name: str) -> list[str]:
  prefix = f'{module_name}.' if module_name else ''
  return [
    qualified[len(prefix) :]
    for qualified, _ in _entries()
    if qualified.startswith(prefix) and '.' not in qualified[len(prefix) :]
  ]


def test_every_entry_names_the_package_or_one_of_its_submodules():
  unknown = [
    qualified
    for qualified, _ in _entries()
    if qualified.rpartition('.')[0] not in ('', *_SUBMODULES)
  ]
  assert not unknown, (
    f'README {_HEADING} entries outside jax_superoffload and its submodules'
    f' {sorted(_SUBMODULES)}: {unknown}'
  )


def test_no_name_is_documented_twice():
  names = [qualified for qualified, _ in _entries()]
  twice = sorted({n for n in names if names.count(n) > 1})
  assert not twice, f'README {_HEADING} documents these twice: {twice}'


@pytest.mark.parametrize(
  'module_name', ['', *_SUBMODULES], ids=lambda m: m or 'jax_superoffload'
)
def test_documented_names_are_the_public_names(module_name):
  module = _SUBMODULES[module_name] if module_name else jax_superoffload
  assert hasattr(module, '__all__'), f'{module.__name__} has no __all__'
  public, documented = set(module.__all__), set(_documented(module_name))
  missing, extra = sorted(public - documented), sorted(documented - public)
  assert not missing and not extra, (
    f'README {_HEADING} vs {module.__name__}.__all__: missing from the'
    f' README {missing}, in the README but not in __all__ {extra}'
  )


def test_every_function_has_a_signature():
  bare = []
  for qualified, signature in _entries():
    try:
      obj = _resolve(qualified)
    except (AttributeError, KeyError):
      continue  # Reported by the tests of the names.
    if signature is None and inspect.isroutine(obj):
      bare.append(qualified)
  assert not bare, (
    f'README {_HEADING}: give these functions a signature, name(...): {bare}'
  )


def test_signatures_match_the_code():
  errors = []
  for qualified, signature in _entries():
    if signature is None:
      continue
    try:
      obj = _resolve(qualified)
    except (AttributeError, KeyError):
      continue  # Reported by the tests of the names.
    readme, code = _readme_form(signature), _code_form(obj)
    if _names(readme) != _names(code):
      errors.append(
        f'{qualified}: the README has parameters {_names(readme)},'
        f' inspect.signature has {_names(code)}'
      )
    elif readme != code:
      shown = ', '.join(t.replace('=', '=...') for t in code)
      errors.append(
        f'{qualified}: markers or defaults differ; the README has'
        f' ({signature}), the code reads ({shown})'
      )
  assert not errors, f'README {_HEADING} signatures:\n' + '\n'.join(errors)
