"""Every command-line script of experiments/ prints its --help and exits 0."""

import pathlib
import runpy
import sys

import pytest

_EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / 'experiments'
# Module names (`benchmarks.bench_adam`, `sweeps.sweep`, ...) of every script
# in the experiments/ packages.
_SCRIPTS = sorted(
  '.'.join(p.relative_to(_EXPERIMENTS).with_suffix('').parts)
  for p, text in ((p, p.read_text()) for p in _EXPERIMENTS.rglob('*.py'))
  if 'argparse' in text and "__name__ == '__main__'" in text
)


def test_there_are_scripts():
  assert len(_SCRIPTS) >= 5, _SCRIPTS


@pytest.mark.parametrize('name', _SCRIPTS)
def test_help_prints_and_exits_zero(name, monkeypatch, capsys):
  monkeypatch.setattr(sys, 'argv', [f'{name}.py', '--help'])
  # Run as a fresh __main__ even where another test imported it (runpy
  # warns then that it may behave unpredictably).
  monkeypatch.delitem(sys.modules, f'experiments.{name}', raising=False)
  with pytest.raises(SystemExit) as exit_info:
    runpy.run_module(f'experiments.{name}', run_name='__main__')
  assert exit_info.value.code in (0, None)
  assert 'usage:' in capsys.readouterr().out


@pytest.mark.parametrize('module', ['experiments.trainer', 'experiments.train'])
def test_trainer_help_lists_config_fields(module, monkeypatch, capsys):
  monkeypatch.setattr(sys, 'argv', ['trainer', '--help'])
  with pytest.raises(SystemExit) as exit_info:
    runpy.run_module(module, run_name='__main__')
  assert exit_info.value.code in (0, None)
  out = capsys.readouterr().out
  assert out.startswith('usage: python -m experiments.trainer')
  assert '--config.steps INT' in out and '--config FILE' in out
