"""The harness's printed table: one row per compiled case."""

from __future__ import annotations

from typing import Any

from experiments.device import predict_step

_HEAD = (
  f'{"case":34} {"ok":>3} {"dev GB":>7} {"goal":>7} {"host GB":>7} '
  f'{"D2H n/GB":>12} {"H2D n/GB":>12} {"H2H n/GB":>12} {"calls":>5} '
  f'{"start":>6} {"wait":>6} {"compile s":>9}'
)


def _copies(result: dict[str, Any], direction: str) -> str:
  row = result.get('copies', {}).get(direction)
  return f'{row["count"]}/{row["GB"]:.2f}' if row else '0'


def _fraction(x: float | None) -> str:
  return '-' if x is None else f'{x:.0%}'


def goal_gb(result: dict[str, Any], results: list[dict[str, Any]]) -> Any:
  """Optax.adamw's device GB minus its optimizer state, for the same step."""
  fields = result.get('fields', {})
  for other in results:
    f = other.get('fields', {})
    if f.get('optimizer') == 'optax' and other.get('compiles'):
      same = all(
        f.get(k) == fields.get(k)
        for k in ('layout', 'param_dtype', 'layers', 'batch', 'devices', 'gpu')
      )
      if same:
        state = other.get('state_bytes', {}).get('device', 0)
        return round(other['device_GB'] - state / 1e9, 3)
  return None


def row(result: dict[str, Any], goal: Any = None) -> str:
  name = result.get('case') or str(result.get('fields', {}))[:34]
  if not result.get('compiles'):
    error = result.get('error', '').strip().splitlines() or ['?']
    return f'{name:34} {"no":>3}  {error[-1][:100]}'
  return (
    f'{name:34} {"yes":>3} {result["device_GB"]:7.2f} '
    f'{"-" if goal is None else f"{goal:.2f}":>7} {result["host_GB"]:7.2f} '
    f'{_copies(result, "D2H"):>12} {_copies(result, "H2D"):>12} '
    f'{_copies(result, "H2H"):>12} {len(result["optimizer_calls"]):5d} '
    f'{_fraction(result["first_start_at"]):>6} '
    f'{_fraction(result["first_wait_at"]):>6} {result["compile_s"]:9.1f}'
  )


def table(results: list[dict[str, Any]]) -> str:
  lines = [_HEAD]
  for result in results:
    goal = None
    if result.get('fields', {}).get('optimizer') != 'optax':
      goal = goal_gb(result, results)
    lines.append(row(result, goal))
  lines.append(
    'dev/host GB: arguments + outputs - aliased + temporaries '
    "(memory_analysis); goal: optax.adamw's device GB minus its state; "
    "start/wait: share of the backward's GEMM FLOPs issued before the "
    'first optimizer call starts / the compute stream first waits for one; '
    "compile s: this machine's compile, not a step time."
  )
  return '\n'.join(lines + predictions(results))


def predictions(results: list[dict[str, Any]]) -> list[str]:
  """Per compiled stream/ffi case, its predicted step (predict_step).

  Only for the 1B model on one H200, whose measured rates the model
  plays; a case whose program lacks the model's inputs says so.
  """
  lines = []
  for result in results:
    if not predict_step.predictable(result):
      continue
    got = [predict_step.predict_case(result, batch) for batch in (4, 8)]
    text = 'no per-call copies in this JSON: compile it again'
    if None not in got:
      text = ', '.join(
        f'batch {p["batch"]} {p["step_s"]:.3f} s ({p["vs_optax"]:.2f}x optax)'
        for p in got
      )
    lines.append(f'{result["case"]:34} predicted: {text}')
  if lines:
    lines.insert(
      0, '\npredicted on the H200 (predict_step; rates measured there):'
    )
  return lines
