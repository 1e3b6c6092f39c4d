"""Capacity by compilation: the largest model each optimizer fits on a GPU.

  python -m experiments.device.aot --capacity --gpu h200,gh200,h100

For each optimizer of `SPECS` (optax.adamw with fp32 parameters, the
paper's 16 B/param baseline; superoffload's `stream` executor with bf16
parameters and fp32, bf16 or 8-bit moments) it finds the largest layer
count of the preset's width (scanned layers) whose compiled device bytes
(arguments + outputs - aliased + temporaries, `memory_analysis()`) fit the
GPU's budget (`gpu_targets.TARGETS`), and the largest whose host bytes fit
the host beside it. The memory of a scanned step is affine in the layer
count, so it fits a line through two compiles (`FIT_LAYERS`, on `FIT_GPU`:
far below every budget, where the target's memory size changes nothing),
then confirms the edge on each GPU: n fits and n + 1 does not, moving by
secant steps if a compile leaves the line (XLA rematerializes near a
budget). Where the host caps first, its edge is found and confirmed the
same way on the host bytes (the host step's returned weights grow a little
faster than the line: 1.83 B/param at 16 and 64 layers, 2.0 at 572).

Beside each row: the planner's prediction (`jax_superoffload.plan` on the
trainer's model, `aot_planner`) of the device and host bytes at that layer
count and of the largest layer count that fits. Every compile is kept in
a cache and reused on the next run with the same case fields, the same
JAX and the same library: the cache is a file under `--cache-dir`
(`build/aot_cache/`, ignored by git) named by the JAX version and the
checkout's git commit (with a digest of uncommitted changes to the code),
never the `--json` output nor a committed file. `--fresh` compiles all.
No GPU runs: these are compiled bytes, not a measured step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import pathlib
import subprocess
from typing import Any

from experiments.device import aot
from experiments.device import aot_planner
from experiments.device import aot_steps
from experiments.device import gpu_targets

# Two layer counts far below every budget: the line is fitted through them.
FIT_LAYERS = (16, 64)
FIT_GPU = 'h200'
# Compiles at most per edge search (the line's guess, then secant steps).
MAX_EDGE_COMPILES = 6
DEFAULT_JSON = 'results/tmp/aot_capacity.json'
_ROOT = pathlib.Path(__file__).resolve().parents[2]
# What a compile depends on beside JAX: a change here is another library.
_CODE = ('jax_superoffload', 'xla_ffi', 'experiments', 'configs')


@dataclasses.dataclass(frozen=True)
class Spec:
  """One optimizer of the capacity table."""

  label: str
  optimizer: str  # 'optax' or a superoffload executor.
  param_dtype: str
  moments: str = 'fp32'


SPECS = (
  Spec('optax.adamw, fp32 params', 'optax', 'float32'),
  Spec('stream, bf16 params, fp32 moments', 'stream', 'bfloat16', 'fp32'),
  Spec('stream, bf16 params, bf16 moments', 'stream', 'bfloat16', 'bf16'),
  Spec('stream, bf16 params, 8-bit moments', 'stream', 'bfloat16', '8bit'),
)


def case_fields(spec: Spec, layers: int, gpu: str, args: Any) -> dict[str, Any]:
  """The `aot_steps.Case` fields of `spec` at `layers` on `gpu`."""
  overrides = aot.overrides(args)
  case = aot_steps.Case(
    optimizer=spec.optimizer,
    layout='scan',
    param_dtype=spec.param_dtype,
    moments=spec.moments,
    preset=args.preset,
    layers=layers,
    batch=args.batch,
    gpu=gpu,
    overrides=overrides,
    # The program the planner models: host steps after the backward loop.
    # With overlap_scan, a 16-bit stack's rows return fp32 masters to the
    # device, and the host holds no 16-bit weights (2 B a parameter less
    # than planned, results/gpu_capacity_2026-12-05.md).
    overlap_scan=False,
  )
  return json.loads(json.dumps(dataclasses.asdict(case)))


def memory_bytes(result: dict[str, Any], prefix: str = '') -> int:
  """Arguments + outputs - aliased + temporaries ('' device, 'host_' host)."""
  m = result['memory']
  get = lambda k: m.get(f'{prefix}{k}_size_in_bytes', 0)  # noqa: E731
  return get('argument') + get('output') - get('alias') + get('temp')


def _git(*args: str) -> str | None:
  try:
    done = subprocess.run(
      ['git', *args], cwd=_ROOT, capture_output=True, text=True, check=True
    )
  except (OSError, subprocess.CalledProcessError):
    return None
  return done.stdout


def library_commit() -> str | None:
  """The checkout's commit, `+` a digest of uncommitted code; None: no git.

  The digest covers tracked changes and untracked files under `_CODE`, so
  an edited tree never reads a compile of the committed one.
  """
  head = _git('rev-parse', 'HEAD')
  if head is None:
    return None
  changed = _git('status', '--porcelain', '--untracked-files=all', '--', *_CODE)
  if not changed:
    return head.strip()
  digest = hashlib.sha256((_git('diff', 'HEAD', '--', *_CODE) or '').encode())
  for line in sorted(changed.splitlines()):
    if line.startswith('??'):
      path = _ROOT / line[3:]
      digest.update(
        line.encode() + (path.read_bytes() if path.is_file() else b'')
      )
  return f'{head.strip()}+{digest.hexdigest()[:12]}'


def cache_key() -> dict[str, str | None]:
  """What a cached compile must share with this run."""
  return {'jax': importlib.metadata.version('jax'), 'commit': library_commit()}


def cache_path(cache_dir: str, key: dict[str, str | None]) -> pathlib.Path:
  """The cache file of `key` under `cache_dir` (relative: to the checkout)."""
  commit = (key['commit'] or 'no-git').replace('+', '-')
  return _ROOT / cache_dir / f'capacity_jax-{key["jax"]}_{commit}.json'


def _tracked(path: pathlib.Path) -> bool:
  """Whether git tracks `path` (a committed result is never a cache)."""
  try:
    relative = path.resolve().relative_to(_ROOT)
  except ValueError:
    return False
  return bool(_git('ls-files', '--', str(relative)))


class Compiles:
  """Compiled cases by their fields, kept in (and reused from) a cache file.

  The file is read only when its recorded key is `key` (same JAX, same
  commit) and git does not track it; `key['commit']` None reads nothing.
  """

  def __init__(
    self,
    path: pathlib.Path,
    timeout: float,
    save: Any,
    key: dict[str, str | None],
    fresh: bool = False,
  ):
    self.timeout = timeout
    self.save = save  # Called after each new compile.
    self.key = key
    self.results: dict[str, dict[str, Any]] = {}
    self.cached: set[str] = set()  # Keys read from the cache.
    self.reused: set[str] = set()  # Those used by this run.
    if _tracked(path):
      raise ValueError(f'{path}: a committed file, never a compile cache')
    if fresh or key['commit'] is None or not path.exists():
      return
    cached = json.loads(path.read_text())
    if cached.get('key') != key:
      return
    for result in cached.get('compiles', []):
      self.results[self._key(result['fields'])] = result
    self.cached = set(self.results)

  @staticmethod
  def _key(fields: dict[str, Any]) -> str:
    return json.dumps(fields, sort_keys=True)

  def get(self, fields: dict[str, Any]) -> dict[str, Any]:
    """The compiled case, compiling it (in its own process) if new."""
    key = self._key(fields)
    if key in self.cached:
      self.reused.add(key)
    if key not in self.results:
      result = aot.run_case(fields, self.timeout)
      if not result.get('compiles'):
        raise RuntimeError(
          f'{fields}: does not compile: {result.get("error", "")[-800:]}'
        )
      self.results[key] = result
      print(
        f'  compiled {result["case"]} x{fields["layers"]} on '
        f'{fields["gpu"]}: device {memory_bytes(result) / 1e9:.2f} GB, '
        f'host {memory_bytes(result, "host_") / 1e9:.2f} GB '
        f'({result["compile_s"]:.0f} s)',
        flush=True,
      )
      self.save()
    return self.results[key]


@dataclasses.dataclass(frozen=True)
class Line:
  """bytes = a + b x layers, through two compiled points."""

  a: float
  b: float

  @classmethod
  def through(cls, p: tuple[int, float], q: tuple[int, float]) -> Line:
    """The line through (layers, bytes) points `p` and `q`."""
    b = (q[1] - p[1]) / (q[0] - p[0])
    return cls(p[1] - b * p[0], b)

  def at(self, layers: int) -> float:
    """Bytes at `layers`."""
    return self.a + self.b * layers

  def largest(self, budget: float) -> int | None:
    """The largest layer count within `budget` (None: no limit)."""
    if self.b <= 0:
      return None
    return math.floor((budget - self.a) / self.b)


def _clamp(n: int | None, lo: int | None, hi: int | None) -> int:
  n = 1 if n is None else n
  n = max(n, 1 if lo is None else lo + 1)
  return n if hi is None else min(n, hi - 1)


def device_edge(
  probe: Any, line: Line, anchor: tuple[int, float], budget: float
) -> dict[str, Any]:
  """The largest layer count whose compiled device bytes fit `budget`.

  Args:
    probe: layers -> compiled device bytes on the GPU searched.
    line: The fitted device line; its guess is compiled first.
    anchor: (layers, bytes) of the farther fit point: each secant step
      goes through it and the latest compile.
    budget: Device bytes.

  Returns:
    layers (the largest that fits), confirmed (its n + 1 was compiled and
    does not fit) and probes (layers -> bytes, each one compiled).
  """
  lo = hi = None
  probes: dict[int, float] = {}
  n = _clamp(line.largest(budget), lo, hi)
  for _ in range(MAX_EDGE_COMPILES):
    probes[n] = probe(n)
    if probes[n] <= budget:
      lo = n
    else:
      hi = n
    if lo is not None and hi == lo + 1:
      break
    guess = Line.through(anchor, (n, probes[n])).largest(budget)
    if lo == n and (guess is None or guess <= n):
      guess = n + 1  # The confirmation: n + 1 must not fit.
    n = _clamp(guess, lo, hi)
  return dict(
    layers=lo, confirmed=lo is not None and hi == lo + 1, probes=probes
  )


def _fit(spec: Spec, compiles: Compiles, args: Any) -> dict[str, Any]:
  """The device, host and parameter lines of `spec` from its fit compiles."""
  points = []
  for n in FIT_LAYERS:
    result = compiles.get(case_fields(spec, n, FIT_GPU, args))
    points.append((n, result))
  line = lambda get: Line.through(*((n, get(r)) for n, r in points))  # noqa: E731
  return dict(
    device=line(memory_bytes),
    host=line(lambda r: memory_bytes(r, 'host_')),
    params=line(lambda r: r['num_params']),
    anchor=(points[-1][0], memory_bytes(points[-1][1])),
    host_anchor=(points[-1][0], memory_bytes(points[-1][1], 'host_')),
  )


def _planner_layers(spec: Spec, fit: dict, gpu: str, args: Any) -> int:
  """The largest layer count the planner says fits (bisection)."""

  def fits(n: int) -> bool:
    cfg = aot_planner.trainer_config(case_fields(spec, n, gpu, args))
    return aot_planner.predict(cfg, round(fit['params'].at(n)), gpu)['fits']

  lo, hi = 0, 1
  while fits(hi):
    lo, hi = hi, 2 * hi
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def _edge(
  spec: Spec, gpu: str, fit: dict, compiles: Compiles, args: Any, edges: dict
) -> dict[str, Any]:
  """The device edge of `spec` on `gpu`, or one already found for the same.

  Moments live on the host: where the device lines of two specs are the
  same to the byte, the edge compiled for the first stands for both.
  """
  key = (gpu, spec.optimizer, spec.param_dtype, fit['device'], fit['anchor'])
  if key not in edges:

    def probe(n: int) -> float:
      return memory_bytes(compiles.get(case_fields(spec, n, gpu, args)))

    budget = gpu_targets.TARGETS[gpu].budget_bytes
    edge = device_edge(probe, fit['device'], fit['anchor'], budget)
    edges[key] = {**edge, 'spec': spec}
  return edges[key]


def _host_edge(
  spec: Spec, gpu: str, fit: dict, compiles: Compiles, args: Any
) -> dict[str, Any] | None:
  """The host edge, compiled (as the device one) where it comes first."""
  budget = gpu_targets.TARGETS[gpu].host_bytes
  guess = fit['host'].largest(budget)
  if guess is None or guess >= fit['device'].largest(
    gpu_targets.TARGETS[gpu].budget_bytes
  ):
    return None

  def probe(n: int) -> float:
    result = compiles.get(case_fields(spec, n, gpu, args))
    return memory_bytes(result, 'host_')

  return device_edge(probe, fit['host'], fit['host_anchor'], budget)


def capacity_row(
  spec: Spec, gpu: str, compiles: Compiles, args: Any, edges: dict
) -> dict[str, Any]:
  """One row of the table: compiled edges, host cap, planner beside them."""
  fit = _fit(spec, compiles, args)
  edge = _edge(spec, gpu, fit, compiles, args, edges)
  host = _host_edge(spec, gpu, fit, compiles, args)
  n, confirmed = edge['layers'], edge['confirmed']
  if host is not None and host['layers'] < n:
    n, confirmed = host['layers'], host['confirmed'] and confirmed
  own = {k for k in edge['probes'] if edge['spec'] == spec}
  own |= set(host['probes'] if host else ())
  at_n = compiles.get(case_fields(spec, n, gpu, args)) if n in own else None
  host_bytes = lambda k: memory_bytes(  # noqa: E731
    compiles.get(case_fields(spec, k, gpu, args)), 'host_'
  )
  params = round(fit['params'].at(n))
  cfg = aot_planner.trainer_config(case_fields(spec, n, gpu, args))
  return dict(
    gpu=gpu,
    label=spec.label,
    spec=dataclasses.asdict(spec),
    device_layers=edge['layers'],
    confirmed=confirmed,
    edge_compiled_for=edge['spec'].label,
    probes=edge['probes'],
    device_line=dataclasses.asdict(fit['device']),
    device_line_error=max(
      abs(b - fit['device'].at(k)) for k, b in edge['probes'].items()
    ),
    host_line=dataclasses.asdict(fit['host']),
    host_line_error=max(
      (abs(host_bytes(k) - fit['host'].at(k)) for k in own), default=None
    ),
    host_layers=host['layers']
    if host
    else fit['host'].largest(gpu_targets.TARGETS[gpu].host_bytes),
    host_probes=host['probes'] if host else {},
    capped_by='host' if n != edge['layers'] else 'device',
    layers=n,
    params=params,
    # A shared edge's compile has this spec's device bytes, not its host's.
    device_bytes=memory_bytes(at_n)
    if at_n
    else edge['probes'].get(n, fit['device'].at(n)),
    device_compiled=at_n is not None or n in edge['probes'],
    host_bytes=memory_bytes(at_n, 'host_') if at_n else fit['host'].at(n),
    host_compiled=at_n is not None,
    planner={
      **aot_planner.predict(cfg, params, gpu),
      'layers': _planner_layers(spec, fit, gpu, args),
    },
  )


def _gb(x: float) -> str:
  return f'{x / 1e9:.1f}'


def table(rows: list[dict[str, Any]]) -> str:
  """The capacity table: compiled, with the planner's prediction beside."""
  head = (
    f'{"gpu":6} {"optimizer":36} {"dev n":>6} {"host n":>6} {"cap":>6} '
    f'{"params":>7} {"dev GB":>7} {"plan":>7} {"host GB":>8} {"plan":>7} '
    f'{"plan n":>6}'
  )
  lines = [head]
  for r in rows:
    mark = '' if r['confirmed'] else '?'
    host_n = '-' if r['host_layers'] is None else str(r['host_layers'])
    lines.append(
      f'{r["gpu"]:6} {r["label"]:36} {str(r["device_layers"]) + mark:>6} '
      f'{host_n:>6} {r["capped_by"]:>6} {r["params"] / 1e9:6.2f}B '
      f'{_gb(r["device_bytes"]):>7} {_gb(r["planner"]["device"]):>7} '
      f'{_gb(r["host_bytes"]):>8} {_gb(r["planner"]["host"]):>7} '
      f'{r["planner"]["layers"]:6d}'
    )
  lines.append(
    'dev n: the most layers whose compiled device bytes fit the budget '
    '(n + 1 compiled and over it; ?: not confirmed); host n: the most '
    'whose host bytes fit the host (compiled, n and n + 1, where it caps; '
    'else from the host line); params, dev GB, host GB: at the smaller of '
    'the two (compiled there, or on the line); '
    "plan: the planner's prediction at those layers; plan n: the most "
    'layers the planner says fit. Compiled bytes, not a GPU run.'
  )
  return '\n'.join(lines)


def main(args: Any) -> int:
  """`aot --capacity`: every row of `SPECS` on each GPU of `args.gpu`.

  Writes the table's JSON to `args.json` (never read) and every compile to
  the cache of this JAX and commit under `args.cache_dir`.
  """
  path = pathlib.Path(args.json or DEFAULT_JSON)
  path.parent.mkdir(parents=True, exist_ok=True)
  key = cache_key()
  cache = cache_path(args.cache_dir, key)
  rows: list[dict[str, Any]] = []

  def save() -> None:
    compiled = list(compiles.results.values())
    data = dict(
      key=key,
      budgets={
        g: dataclasses.asdict(t) for g, t in gpu_targets.TARGETS.items()
      },
      rows=rows,
      compiles=compiled,
    )
    path.write_text(json.dumps(data, indent=1) + '\n')
    if key['commit'] is not None:
      cache.parent.mkdir(parents=True, exist_ok=True)
      cache.write_text(json.dumps(dict(key=key, compiles=compiled)) + '\n')

  compiles = Compiles(cache, args.timeout, save, key, args.fresh)
  print(
    f'jax {key["jax"]}, commit {key["commit"]}; cache {cache} '
    f'({len(compiles.results)} compiles in it)',
    flush=True,
  )
  edges: dict = {}
  for gpu in args.gpu.split(','):
    if gpu not in gpu_targets.TARGETS:
      raise SystemExit(f'--gpu {gpu}: one of {sorted(gpu_targets.TARGETS)}')
    for spec in SPECS:
      rows.append(capacity_row(spec, gpu, compiles, args, edges))
      print(table(rows[-1:]).splitlines()[1], flush=True)
      save()
  print(table(rows))
  print(f'{len(compiles.reused)} compiles reused from {cache}')
  print(f'wrote {path}')
  return 0 if all(r['confirmed'] for r in rows) else 1
