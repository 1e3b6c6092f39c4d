"""The trainer's command line: a config file and ``--config.FIELD`` overrides.

The convention of `ml_collections` config files (Flax's examples, NanoDO,
big_vision)::

    python -m experiments.trainer --config configs/demo.py --config.steps=50

``--config FILE`` names the file (a name of ``configs/``, such as ``tiny``,
works too; default: ``configs/demo.py``), and each ``--config.FIELD=VALUE``
overrides one field, parsed by `ml_collections.config_flags` as the field's
type (booleans also as ``--config.FIELD`` and ``--noconfig.FIELD``). An
optional field is set to None with ``--config.FIELD=none``. ``--help``
lists every field, by group, with its help and the file's value.

The older spellings, ``--preset NAME`` and one flag per field
(``--steps 50``, ``--no-tie-embeddings``), are still accepted in this
release and translated to the above (`old_flags` names those used); the
next release drops them. Errors raise `config.ConfigError` (one line).
"""

import argparse
import re
import sys
from collections.abc import Sequence

from absl import flags
from ml_collections import config_flags

from experiments.trainer import config as config_lib
from experiments.trainer import config_files
from experiments.trainer.config import ConfigError

PROG = 'python -m experiments.trainer'
_OVERRIDE = re.compile(r'^--(no)?config\.([A-Za-z_][\w]*)(=(.*))?$', re.DOTALL)


def _fields() -> list[str]:
  return [n for ns in config_lib.field_groups().values() for n in ns]


def _take_value(argv: list[str], i: int, flag: str) -> tuple[str, int]:
  """The value of ``argv[i]`` (``--flag=V`` or ``--flag V``), next index."""
  if '=' in argv[i]:
    return argv[i].split('=', 1)[1], i + 1
  if i + 1 >= len(argv) or argv[i + 1].startswith('--'):
    raise ConfigError(f'{flag} needs a value')
  return argv[i + 1], i + 2


def _old_flag(arg: str) -> tuple[str, str | None] | None:
  """``--steps``/``--no-tie-embeddings`` as ``(field, value or None)``."""
  name = arg[2:].split('=', 1)[0].replace('-', '_')
  fields = set(_fields())
  if name in fields:
    return name, None
  negated = name.removeprefix('no_')
  if negated in fields and config_lib.field_type(negated)[0] is bool:
    return negated, 'false'
  return None


def _normalize(argv: Sequence[str]) -> tuple[str | None, list[str], list[str]]:
  """Splits argv into the config file, ``--config.F=V`` overrides, old flags.

  Returns:
    ``(file, overrides, old)``: the ``--config`` (or ``--preset``) value or
    None, every override as one ``--config.FIELD=VALUE`` (or
    ``--[no]config.FIELD``) token, and the old-style flags used.
  """
  argv, start, overrides, old = list(argv), None, [], []
  i = 0
  while i < len(argv):
    arg = argv[i]
    head = arg.split('=', 1)[0]
    if head in ('--config', '--preset'):
      if start is not None:
        raise ConfigError(
          f'{head} given after {start[0]}: name one config file'
        )
      value, i = _take_value(argv, i, head)
      start = (head, value)
      if head == '--preset':
        old.append('--preset')
      continue
    if m := _OVERRIDE.match(arg):
      no, name = m.group(1), m.group(2)
      bool_field = name in _fields() and config_lib.field_type(name)[0] is bool
      if m.group(3) is None and not no and not bool_field:
        value, i = _take_value(argv, i, head)
        overrides.append(f'--config.{name}={value}')
        continue
      overrides.append(arg)
    elif arg.startswith('--') and (found := _old_flag(arg)):
      name, value = found
      if value is None and config_lib.field_type(name)[0] is bool:
        value = arg.split('=', 1)[1] if '=' in arg else 'true'
      elif value is None:
        value, i = _take_value(argv, i, head)
        i -= 1
      overrides.append(f'--config.{name}={value}')
      old.append(head)
    elif arg in ('-h', '--help'):
      pass  # Handled by `config_from_args`.
    else:
      raise ConfigError(
        f'unrecognized argument {arg!r}; fields are set with '
        '--config.FIELD=VALUE (see --help)'
      )
    i += 1
  return start[1] if start else None, overrides, old


def _split_nones(overrides: list[str]) -> tuple[list[str], list[str]]:
  """Takes ``--config.F=none`` of optional fields out of `overrides`."""
  kept, nones = [], []
  for arg in overrides:
    m = _OVERRIDE.match(arg)
    name, value = m.group(2), m.group(4)
    optional = name in _fields() and config_lib.field_type(name)[1]
    if optional and value is not None and value.lower() == 'none':
      nones.append(name)
    else:
      kept.append(arg)
  return kept, nones


def _one_line(error: Exception) -> str:
  """An absl or ml_collections error as one line."""
  text = ' '.join(str(error).replace('\\n', ' ').split())
  missing = re.match(r'\W*([\w.]+)\W*(Did you mean "(\w+)")?', text)
  if isinstance(error, KeyError | AttributeError) and missing:
    hint = missing.group(3)
    hint = f' (did you mean --config.{hint}?)' if hint else ''
    return f'no such config field: {missing.group(1)}{hint}'
  return text.split(' Other fields present:')[0]


def _load(start: str | None):
  """The ConfigDict of the start config, and its `Config.preset` name."""
  path = (
    config_lib.DEFAULT_CONFIG_FILE
    if start is None
    else config_files.config_path(start)
  )
  if (
    start is not None
    and not path.is_file()
    and path.parent == (config_lib.CONFIG_DIR)
  ):
    raise ConfigError(
      f'--config {start}: no such file, and no config of that name in '
      f'configs/ ({", ".join(config_files.preset_names())})'
    )
  return config_files.load_config_file(path), config_files.preset_of(path)


def parse(argv: Sequence[str]) -> tuple[config_lib.Config, list[str]]:
  """Parses the trainer's flags (no ``--help``) into a `Config`.

  Returns:
    The config, and the old-style flags among `argv` (see the module).

  Raises:
    ConfigError: For a missing or failing file, an unknown field, a value
      of the wrong type or an unrecognized argument.
  """
  start, overrides, old = _normalize(argv)
  cd, preset = _load(start)
  overrides, nones = _split_nones(overrides)
  cd.lock()
  argv_ = [PROG, *overrides]
  values = flags.FlagValues()
  try:
    config_flags.DEFINE_config_dict(
      'config', cd, flag_values=values, sys_argv=argv_, lock_config=True
    )
    values(argv_)
  except (flags.Error, KeyError, AttributeError, TypeError, ValueError) as e:
    raise ConfigError(_one_line(e)) from e
  for name in nones:
    cd[name] = None
  return config_files.from_config_dict(cd, preset), old


def format_help(argv: Sequence[str] = ()) -> str:
  """``--help``: every field by group, its help and the start file's value."""
  start, _, _ = _normalize([a for a in argv if a not in ('-h', '--help')])
  cd, preset = _load(start)
  parser = argparse.ArgumentParser(
    prog=PROG,
    usage=f'{PROG} [--config FILE] [--config.FIELD=VALUE ...]',
    description=(
      'Trains a byte-level decoder-only LM. The run starts from a config '
      'file whose get_config() returns an ml_collections.ConfigDict, and '
      '--config.FIELD=VALUE overrides one of its fields (booleans also '
      '--config.FIELD / --noconfig.FIELD; optional fields take "none").'
    ),
    epilog=(
      'Older spellings, kept for this release only: --preset NAME, and one '
      'flag per field (--steps 50, --learning-rate 1e-3, '
      '--no-tie-embeddings).'
    ),
    add_help=False,
  )
  parser.add_argument(
    '--config',
    metavar='FILE',
    help=f'Config file (or a name of configs/: '
    f'{", ".join(config_files.preset_names())}); default: configs/demo.py.',
  )
  parser.add_argument('-h', '--help', action='store_true', help='This help.')
  for group_name, names in config_lib.field_groups().items():
    group = parser.add_argument_group(group_name)
    for name in names:
      tp, optional = config_lib.field_type(name)
      kind = tp.__name__.upper() + (' or none' if optional else '')
      if choices := config_lib.CHOICES.get(name):
        kind = '{' + ','.join(choices) + '}'
      text = f'{config_lib.field_help(name)} ({preset}: {cd[name]})'
      group.add_argument(
        f'--config.{name}', metavar=kind, help=text.replace('%', '%%')
      )
  return parser.format_help()


def config_from_args(argv: Sequence[str] | None = None) -> config_lib.Config:
  """Parses command-line flags into a `Config`; ``--help`` prints and exits.

  Args:
    argv: The flags, without the program name; None reads `sys.argv`.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  if '-h' in argv or '--help' in argv:
    print(format_help(argv))
    raise SystemExit(0)
  return parse(argv)[0]


def old_flags(argv: Sequence[str]) -> list[str]:
  """The old-style flags among `argv` (``--preset``, ``--steps``, ...)."""
  try:
    return _normalize(argv)[2]
  except ConfigError:
    return []
