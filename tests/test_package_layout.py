"""The package's shape: an import graph without cycles, short functions."""

import ast
import collections
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'jax_superoffload'
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
  """Every module of the package by dotted name, parsed."""
  out = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix('').parts)
    if parts[-1] == '__init__':
      parts.pop()
    out['.'.join(parts)] = ast.parse(path.read_text(), str(path))
  return out


def _imported(name: str, tree: ast.Module, modules) -> set[str]:
  """The package's modules `name` imports, at any depth of its code.

  `from a import b` names module `a.b` when that is a module, else `a`.
  Importing `a.b.c` also runs the `__init__` of `a` and `a.b`; those count
  too, except where they are packages `name` lies in (already importing).
  """
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      assert not node.level, f'{name}: relative import'
      base = node.module
      targets = [f'{base}.{alias.name}' for alias in node.names]
      targets = [t if t in modules else base for t in targets]
    else:
      continue
    for target in targets:
      parts = target.split('.')
      for k in range(1, len(parts) + 1):
        prefix = '.'.join(parts[:k])
        if prefix in modules and not (name + '.').startswith(prefix + '.'):
          found.add(prefix)
  return found


def import_graph() -> dict[str, set[str]]:
  modules = _modules()
  return {n: _imported(n, t, modules) for n, t in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` as a list of nodes (first repeated last), or None."""
  state = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done.
  stack = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state[nxt] == 1:
        return [*stack[stack.index(nxt) :], nxt]
      if state[nxt] == 0 and (cycle := visit(nxt)):
        return cycle
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if state[node] == 0 and (cycle := visit(node)):
      return cycle
  return None


def test_the_import_graph_has_no_cycle():
  graph = import_graph()
  assert 'jax_superoffload._src.optim.update' in graph
  assert find_cycle(graph) is None, ' -> '.join(find_cycle(graph))


def _package(module: str) -> str:
  """`jax_superoffload._src.X` for a module of package X, else `module`."""
  parts = module.split('.')
  return '.'.join(parts[:3]) if parts[1:2] == ['_src'] else module


def test_the_packages_form_floors():
  # core <- parallel <- host <- planning, and optim above them all: no two
  # packages import each other, even through different modules.
  packages = collections.defaultdict(set)
  for name, imports in import_graph().items():
    for other in imports:
      if _package(other) != _package(name) and other.count('.') >= 2:
        packages[_package(name)].add(_package(other))
  graph = {
    p: packages.get(p, set()) for p in set(packages).union(*packages.values())
  }
  assert find_cycle(graph) is None, ' -> '.join(find_cycle(graph))
  assert 'jax_superoffload._src.optim' not in set().union(
    *(v for k, v in graph.items() if k not in PUBLIC)
  )


PUBLIC = {
  'jax_superoffload',
  'jax_superoffload.kernels',
  'jax_superoffload.ulysses',
  # Commands and the entries into trainers: the top floor too.
  'jax_superoffload.convert_checkpoint',
  'jax_superoffload.integrations',
  'jax_superoffload.integrations.maxtext',
}


def test_the_private_modules_import_no_public_one():
  # The public modules are the top floor: below them, _src imports _src.
  for name, imports in import_graph().items():
    if name not in PUBLIC:
      assert not imports & PUBLIC, (name, imports & PUBLIC)


def test_the_cycle_check_finds_a_function_level_import():
  # The check must see imports inside functions, where cycles hide.
  code = ast.parse('def f():\n  from b import x\n')
  graph = {'a': _imported('a', code, {'a', 'b'}), 'b': {'a'}}
  assert graph['a'] == {'b'}
  assert find_cycle(graph) == ['a', 'b', 'a']


def _defined_names(tree: ast.Module) -> set[str]:
  """Public classes and functions a module defines at its top level."""
  return {
    node.name
    for node in tree.body
    if isinstance(node, (ast.ClassDef, ast.FunctionDef))
    and not node.name.startswith('_')
  }


# Names several modules define on purpose, each meaning the same thing:
# the optax-shaped verbs of a transformation, a command module's entry.
SHARED_NAMES = {'init', 'update', 'main'}


def test_no_two_modules_define_one_public_name():
  where = collections.defaultdict(list)
  for name, tree in _modules().items():
    for defined in _defined_names(tree):
      where[defined].append(name)
  clashes = {
    k: v for k, v in where.items() if len(v) > 1 and k not in SHARED_NAMES
  }
  assert not clashes, clashes


def _long_functions() -> list[tuple[str, str, int]]:
  out = []
  for name, tree in _modules().items():
    for node in ast.walk(tree):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      lines = node.end_lineno - node.lineno + 1
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(
        getattr(first, 'value', None), ast.Constant
      ):
        lines -= first.end_lineno - first.lineno + 1  # Docstrings aside.
      if lines > MAX_FUNCTION_LINES:
        out.append((name, node.name, lines))
  return out


def test_no_function_is_over_60_lines():
  long = list(_long_functions())
  assert not long, long


@pytest.mark.parametrize('lines', [MAX_FUNCTION_LINES + 1])
def test_the_length_check_counts_code_not_docstrings(lines, tmp_path):
  body = '\n'.join(f'  x{i} = {i}' for i in range(lines - 1))
  tree = ast.parse(f'def f():\n  """Doc.\n\n  More.\n  """\n{body}\n')
  fn = tree.body[0]
  assert fn.end_lineno - fn.lineno + 1 - 4 == lines
