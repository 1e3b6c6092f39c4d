"""What every result line of `run.sh` must hold, dry run or on the GPU.

Reads `$OUT/parts.jsonl` (one `PART_RESULT` object per line) and names each
result that is missing a field the run will be read for, or whose weights
left optax.adamw's by more than their dtype's rounding. The test suite and
CI's device-image stage (`.ci/device_image.sh`, on the GPU image's JAX)
both judge a dry run by it; on a GPU it says whether the run is usable.

  python -m experiments.device.check_parts OUT/parts.jsonl [--dry-run]

prints one line per problem and a count, and exits 1 if there is any (or
no result at all).
"""

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

# The same steps as optax.adamw, run beside them in the part: fp32 rounding for
# fp32 weights, bf16's half unit in the last place (2**-8) for bf16 ones,
# with room for the few steps the part takes.
MAX_REL_VS_OPTAX = {'float32': 1e-5, 'bfloat16': 2**-6}


def _opt(r: dict[str, Any]) -> list[str]:
  bad = []
  if not (r.get('median_s') or 0) > 0 or not (r.get('num_params') or 0) > 0:
    bad.append('no step time or parameter count')
  case = str(r.get('case'))
  calls = r.get('hlo', {}).get('custom_calls')
  if r.get('resolved') in ('stream', 'ffi') and not calls:
    bad.append('no custom call in the compiled step')
  rel = r.get('max_rel_vs_optax')
  if case.startswith('optax') or case.endswith('+clip'):
    if rel is not None:  # optax itself, or clipped against unclipped optax.
      bad.append(f'max_rel_vs_optax {rel}: nothing to compare with')
  elif rel is None or rel >= MAX_REL_VS_OPTAX.get(r.get('dtype'), 0):
    bad.append(f'max_rel_vs_optax {rel} for {r.get("dtype")}')
  return bad


def _train(r: dict[str, Any]) -> list[str]:
  bad = []
  if len(r.get('losses') or []) < 2:
    bad.append('fewer than 2 losses')
  case, got = r.get('case'), r.get('executor') or r.get('optimizer')
  case = (case or '').partition('+')[0]  # "stream+after-loop": stream.
  if case != 'optax' and got != case:
    bad.append(f'trained with {got}, not {case}')
  if r.get('layout') not in ('scan', 'noscan'):
    bad.append(f'layout {r.get("layout")}')
  return bad


def _link(r: dict[str, Any]) -> list[str]:
  if (r.get('d2h_gib_s') or 0) > 0 and (r.get('h2d_gib_s') or 0) > 0:
    return []
  return ['no link rate']


def _profile(r: dict[str, Any]) -> list[str]:
  top = r.get('top') or []
  if top and all(len(row) == 4 for row in top):
    return []
  return ['no profile rows of (thread, event, count, seconds)']


def _capacity(r: dict[str, Any]) -> list[str]:
  if (r.get('search') or {}).get('largest', 0) >= 1 and r.get('trained'):
    return []
  return ['no fitting model found and trained']


CHECKS = {
  'opt': _opt,
  'train': _train,
  'link': _link,
  'profile': _profile,
  'capacity': _capacity,
}


def problems(rows: Sequence[dict[str, Any]], dry_run: bool) -> list[str]:
  """One line per problem of the results `rows` (empty: all usable)."""
  out = []
  for r in rows:
    name = f'{r.get("part")} {r.get("case", "")} {r.get("dtype", "")}'.strip()
    found = []
    if 'error' in r:
      found.append(f'error {str(r["error"])[:200]}')
    elif r.get('part') not in CHECKS:
      found.append('unknown part')
    else:
      found += CHECKS[r['part']](r)
    if bool(r.get('dry_run')) != dry_run:
      found.append(f'dry_run is {r.get("dry_run")}')
    out += [f'{name}: {f}' for f in found]
  return out


def main(argv: Sequence[str] | None = None) -> int:
  """Prints the problems of a parts.jsonl; 1 if there is any."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('parts', type=pathlib.Path)
  parser.add_argument('--dry-run', action='store_true')
  args = parser.parse_args(argv)
  lines = args.parts.read_text().splitlines()
  rows = [json.loads(line) for line in lines if line.strip()]
  bad = problems(rows, args.dry_run)
  for line in bad:
    print(line)
  print(f'{len(rows)} results, {len(bad)} problems')
  return 1 if bad or not rows else 0


if __name__ == '__main__':
  sys.exit(main())
