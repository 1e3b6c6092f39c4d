"""The deviceless harness's HLO reader, on a module written by hand.

The expected numbers are worked out from the text below, not from the
reader: a forward GEMM of 2*8*4*16 FLOPs and a backward one of 2*4*16*8 in
the body of a loop of two trips (so executed twice); a copy of 32 floats to
host memory, one of 64 from host to host and one of 64 back to the device;
an optimizer call before the backward GEMMs and a join after them.
"""

# The HLO below is as XLA prints it, one instruction a line.
# ruff: noqa: E501

from experiments.device import hlo_report

HLO = """\
HloModule jit_step, is_scheduled=true

%gemm.fwd (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/dot_general"}
}

%gemm.bwd (q0: f32[4,8], q1: f32[8,16]) -> f32[4,16] {
  %q0 = f32[4,8]{1,0} parameter(0)
  %q1 = f32[8,16]{1,0} parameter(1)
  ROOT %dot.2 = f32[4,16]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
}

%body (b: (f32[4,8], f32[8,16])) -> (f32[4,8], f32[8,16]) {
  %b = (f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %g0 = f32[4,8]{1,0} get-tuple-element(%b), index=0
  %g1 = f32[8,16]{1,0} get-tuple-element(%b), index=1
  %gemm_fusion.2 = f32[4,16]{1,0} fusion(%g0, %g1), kind=kCustom, calls=%gemm.bwd
  ROOT %t = (f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%g0, %g1)
}

%cond (c: (f32[4,8], f32[8,16])) -> pred[] {
  %c = (f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (a: f32[8,16], w: f32[16,4], h: f32[64], s: f32[32]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} parameter(1)
  %h = f32[64]{0:S(5)} parameter(2)
  %s = f32[32]{0} parameter(3)
  %gemm_fusion.1 = f32[8,4]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm.fwd
  %copy-start.1 = (f32[32]{0:S(5)}, f32[32]{0}, u32[]) copy-start(%s)
  %copy-done.1 = f32[32]{0:S(5)} copy-done(%copy-start.1)
  %call.opt = f32[64]{0:S(5)} custom-call(%h), custom_call_target="jax_superoffload_adam_step_segments", backend_config={"operation_queue_id":"0"}
  %init = (f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%gemm_fusion.1, %a)
  %while.1 = (f32[4,8]{1,0}, f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"2"}}
  %copy.2 = f32[64]{0:S(5)} copy(%call.opt)
  %copy-start.3 = (f32[64]{0}, f32[64]{0:S(5)}, u32[]) copy-start(%copy.2)
  %copy-done.3 = f32[64]{0} copy-done(%copy-start.3)
  %join = f32[64]{0} custom-call(%copy-done.3), custom_call_target="jax_superoffload_stream_join"
  ROOT %r = f32[8,4]{1,0} copy(%gemm_fusion.1)
}
"""


def test_timeline_counts_gemms_per_trip_and_tells_backward():
  events = hlo_report.timeline(HLO)
  gemms = [e for e in events if e.kind == 'gemm']
  assert [(e.flops, e.backward) for e in gemms] == [
    (2 * 8 * 4 * 16, False),
    (2 * 4 * 16 * 8, True),
    (2 * 4 * 16 * 8, True),
  ]


def test_copies_by_direction_and_bytes():
  copies = hlo_report.copies(hlo_report.timeline(HLO))
  got = {k: (v['count'], v['bytes']) for k, v in copies.items()}
  assert got == {'D2H': (1, 32 * 4), 'H2H': (1, 64 * 4), 'H2D': (1, 64 * 4)}


def test_optimizer_calls_placed_against_the_backward():
  summary = hlo_report.summarize(HLO, {})
  calls = summary['optimizer_calls']
  assert [c['target'] for c in calls] == [
    'jax_superoffload_adam_step_segments',
    'jax_superoffload_stream_join',
  ]
  # The start comes before any backward GEMM and does not wait (a join
  # exists); the join waits after both.
  assert calls[0]['backward_flops_before'] == 0.0 and not calls[0]['waits']
  assert calls[1]['backward_flops_before'] == 1.0 and calls[1]['waits']
  assert summary['first_start_at'] == 0.0
  assert summary['first_wait_at'] == 1.0
  assert summary['backward_gemms'] == 2


def test_results_of_a_joined_call_reach_only_their_join():
  # Through a copy to the host and one back, the call's result reaches its
  # join: allowed. Read by anything else first, it would be read before the
  # host step wrote it.
  assert hlo_report.reads_before_join(HLO) == []
  early = '  %early = f32[64]{0:S(5)} negate(%copy.2)\n'
  racy = HLO.replace('  %copy-start.3', early + '  %copy-start.3')
  assert hlo_report.reads_before_join(racy) == ['early']
  # After its join (STV's validated step reads the speculative one's state
  # once the norm, which the join passes, is known): allowed.
  late = '  %late = f32[64]{0} add(%copy-done.3, %join)\n'
  after = HLO.replace('  ROOT %r', late + '  ROOT %r')
  assert hlo_report.reads_before_join(after) == []


def test_copies_to_the_device_read_host_and_write_device_memory():
  # A copy to the device after the join reads the joined (host) result:
  # not a read before the join, and from host to device memory.
  to_device = (
    '  %new = f32[64]{0} custom-call(%join), '
    'custom_call_target="jax_superoffload_stream_to_device"\n'
  )
  joined_on_host = HLO.replace(
    '%join = f32[64]{0} custom-call', '%join = f32[64]{0:S(5)} custom-call'
  )
  good = joined_on_host.replace('  ROOT %r', to_device + '  ROOT %r')
  assert hlo_report.reads_before_join(good) == []
  assert hlo_report.to_device_calls(good) == [
    {'name': 'new', 'from_host': True, 'to_device': True, 'bytes': 256}
  ]
  # Placed in host memory (as XLA places every result of a call that
  # aliases host memory), or reading device memory: the handler refuses.
  wrong = good.replace('%new = f32[64]{0}', '%new = f32[64]{0:S(5)}')
  assert hlo_report.to_device_calls(wrong)[0]['to_device'] is False
  from_device = HLO.replace('  ROOT %r', to_device + '  ROOT %r')
  assert hlo_report.to_device_calls(from_device)[0]['from_host'] is False


def test_a_later_start_may_read_a_host_result_before_the_join():
  # A stack's re-seeded masters (host memory) read by the next start: its
  # worker runs after the first's, in side-stream order. In device memory
  # the later start's copy to staging could run before the first's worker
  # wrote it.
  later = (
    '  %next = f32[64]{0:S(5)} custom-call(%call.opt), '
    'custom_call_target="jax_superoffload_adam_reseed_rows"\n'
  )
  hlo = HLO.replace('  %init =', later + '  %init =')
  assert hlo_report.reads_before_join(hlo) == []
  on_device = hlo.replace(
    '%call.opt = f32[64]{0:S(5)}', '%call.opt = f32[64]{0}'
  )
  assert hlo_report.reads_before_join(on_device) == ['next']


RESEED = """HloModule reseed

ENTRY %main (c: s32[], s: f32[8], u: s32[1], m: f32[3,64], p: bf16[192]) -> f32[3,64] {
  %c = s32[] parameter(0)
  %s = f32[8]{0} parameter(1)
  %u = s32[1]{0} parameter(2)
  %m = f32[3,64]{1,0:S(5)} parameter(3)
  %p = bf16[192]{0} parameter(4)
  ROOT %r = f32[3,64]{1,0:S(5)} custom-call(%c, %s, %u, %m, %p), custom_call_target="jax_superoffload_adam_reseed_rows", output_to_operand_aliasing={{}: (3, {})}, backend_config={num_leaves = 1 : i64, reseed = true, staging_bytes = 2048 : i64}
}
"""


def test_a_stacks_reseed_stages_one_row_of_its_parameters():
  # Three 256-byte-aligned scalars and a row's 64 bf16 parameters (128
  # bytes, aligned), not the stack's 384: the rows are read on demand, in
  # turn, through one row of staging. It starts no host step.
  (call,) = hlo_report.stream_staging(RESEED)
  assert call == {
    'name': 'r',
    'target': 'jax_superoffload_adam_reseed_rows',
    'bound': 2048,
    'staged': 1024,
    'on_demand': 256,
    'host_results': 0,
  }
  assert hlo_report.summarize(RESEED, {})['first_start_at'] is None


SPECULATIVE = """HloModule speculative

ENTRY %main (c: s32[], m: f32[2,64], g: f32[64]) -> (f32[1], f32[2,64], f32[64]) {
  %c = s32[] parameter(0)
  %m = f32[2,64]{1,0:S(5)} parameter(1)
  %g = f32[64]{0} parameter(2)
  ROOT %r = (f32[1]{0}, f32[2,64]{1,0:S(5)}, f32[64]{0:S(5)}) custom-call(%c, %m, %g), custom_call_target="jax_superoffload_adam_step_speculative", output_to_operand_aliasing={{1}: (1, {})}, backend_config={num_leaves = 1 : i64, reseed = false, staging_bytes = 4096 : i64}
}
"""


def test_results_left_in_host_memory_are_counted_apart_from_the_staged():
  # The weights copy (result 2) aliases no operand and is in host memory:
  # written there, not staged. The state (result 1) aliases its host
  # operand; the sum of squares (result 0) is in device memory: staged,
  # with the count and the gradient.
  (call,) = hlo_report.stream_staging(SPECULATIVE)
  assert call['staged'] == 3 * 256
  assert call['host_results'] == 256
