"""Where configs come from: ml_collections config files and their defaults.

A config file is a Python file whose ``get_config()`` returns an
`ml_collections.ConfigDict` (the convention of Flax's examples). It starts
from `defaults`, every `config.Config` field at its default, and sets the
fields it changes::

    from experiments.trainer import config_files

    def get_config():
      cfg = config_files.defaults()
      cfg.d_model = 768
      return cfg

`from_config_dict` turns the ConfigDict, overrides applied, into the typed
`config.Config` the code reads, checking every field's type.
"""

import dataclasses
import importlib.util
import os
import pathlib
from typing import Any

import ml_collections
from ml_collections import config_dict

from experiments.trainer import config as config_lib
from experiments.trainer.config import CONFIG_DIR
from experiments.trainer.config import DEFAULT_PRESET
from experiments.trainer.config import PRESET_ALIASES
from experiments.trainer.config import Config
from experiments.trainer.config import ConfigError


def preset_names() -> list[str]:
  """The names of the configs under `CONFIG_DIR` (their file stems)."""
  return sorted(
    p.stem for p in CONFIG_DIR.glob('*.py') if not p.name.startswith('_')
  )


def defaults() -> ml_collections.ConfigDict:
  """Every field of `Config` (but `preset`) at its default, as a ConfigDict.

  What a config file starts from. A field whose default is None is an
  `ml_collections` placeholder of its type, so ``--config.FIELD=VALUE``
  can set it.
  """
  cd = ml_collections.ConfigDict()
  for field in dataclasses.fields(Config):
    if field.name == 'preset':
      continue
    tp, _ = config_lib.field_type(field.name)
    value = field.default
    cd[field.name] = config_dict.placeholder(tp) if value is None else value
  return cd


def _checked(name: str, value: Any) -> Any:
  """`value` as field `name` holds it; `ConfigError` for a wrong type."""
  tp, optional = config_lib.field_type(name)
  if value is None and optional:
    return None
  if tp is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):
    return value
  none = ' or None' if optional else ''
  raise ConfigError(
    f'{name} must be a {tp.__name__}{none}, got {value!r} '
    f'({type(value).__name__})'
  )


def from_config_dict(
  cd: ml_collections.ConfigDict | dict[str, Any], preset: str
) -> Config:
  """The `Config` of a config file's ConfigDict (fields it lacks: defaults).

  Args:
    cd: The fields' values (a ConfigDict or a plain dict).
    preset: What the config came from (see `Config.preset`).

  Raises:
    ConfigError: For a name that is no field, or a value of the wrong type.
  """
  values = cd.to_dict() if isinstance(cd, ml_collections.ConfigDict) else cd
  names = {f.name for f in dataclasses.fields(Config)} - {'preset'}
  if unknown := sorted(set(values) - names):
    raise ConfigError(
      f'{preset}: no such config field(s): {", ".join(unknown)}'
    )
  return Config(preset=preset, **{k: _checked(k, v) for k, v in values.items()})


def to_config_dict(cfg: Config) -> ml_collections.ConfigDict:
  """`cfg`'s fields (but `preset`) as a ConfigDict like `defaults`'."""
  cd = defaults()
  for name, value in dataclasses.asdict(cfg).items():
    if name != 'preset':
      cd[name] = value
  return cd


def config_path(name_or_path: str) -> pathlib.Path:
  """The file of a config name (``"tiny"``), or the path itself."""
  if name_or_path.endswith('.py') or os.sep in name_or_path:
    return pathlib.Path(name_or_path).expanduser()
  return CONFIG_DIR / f'{PRESET_ALIASES.get(name_or_path, name_or_path)}.py'


def preset_of(path: pathlib.Path) -> str:
  """`Config.preset` for a config file: its stem under `CONFIG_DIR`."""
  return path.stem if path.resolve().parent == CONFIG_DIR else str(path)


def load_config_file(
  path: str | os.PathLike[str],
) -> ml_collections.ConfigDict:
  """Runs a config file and returns the ConfigDict its ``get_config()`` makes.

  Args:
    path: A Python file defining ``get_config()``. A `Config` returned
      instead (the form before ml_collections) is taken too.

  Returns:
    A new ConfigDict, unlocked: `defaults` with the file's fields set.

  Raises:
    ConfigError: No such file, or one that fails or returns something else.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f'--config: no such file: {path}')
  spec = importlib.util.spec_from_file_location(f'_config_{path.stem}', path)
  if spec is None or spec.loader is None:
    raise ConfigError(f'--config: {path} is not a Python file')
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    get = getattr(module, 'get_config', None)
    cd = get() if callable(get) else None
  except Exception as e:  # A config file is user code: report any error.
    message = ' '.join(f'{type(e).__name__}: {e}'.split())
    raise ConfigError(f'config file {path}: {message}') from e
  if isinstance(cd, Config):
    cd = to_config_dict(cd)
  if not isinstance(cd, ml_collections.ConfigDict):
    raise ConfigError(
      f'config file {path}: get_config() must return an '
      f'ml_collections.ConfigDict, got {type(cd).__name__}'
    )
  return _over_defaults(cd, path)


def _over_defaults(
  cd: ml_collections.ConfigDict, path: pathlib.Path
) -> ml_collections.ConfigDict:
  """`defaults` with the fields `cd` sets: its names and types checked."""
  merged = defaults()
  for name, value in cd.items():
    if name not in merged:
      raise ConfigError(f'config file {path}: no such config field: {name}')
    try:
      merged[name] = value
    except TypeError as e:
      raise ConfigError(
        f'config file {path}: {name} = {value!r}: ' + ' '.join(str(e).split())
      ) from e
  from_config_dict(merged, str(path))  # bool/int and None checks.
  return merged


def get_config(preset: str = DEFAULT_PRESET, **overrides: Any) -> Config:
  """Returns a named config, or a config file's, with field overrides.

  Args:
    preset: The name of a file under `CONFIG_DIR` (``"demo"``, ``"1b"``,
      ...; see `preset_names`) or the path of any config file.
    **overrides: Field values that replace the config's.

  Returns:
    The resulting `Config`; its `preset` is the name (for a file under
    `CONFIG_DIR`, also when given as a path) or else the path.

  Raises:
    ConfigError: If there is no such config or its file fails.
  """
  path = config_path(preset)
  if not path.is_file() and path.parent == CONFIG_DIR:
    raise ConfigError(
      f'no config named {preset!r}: one of {preset_names()}, or the path of '
      'a .py config file'
    )
  cfg = from_config_dict(load_config_file(path), preset_of(path))
  # As given, unchecked: code may pass what the command line cannot.
  return dataclasses.replace(cfg, **overrides)
