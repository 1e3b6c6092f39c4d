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


def test_a_join_after_claims_alone_waits_for_nothing():
  # A stream claim starts no host step: overlap_scan's join before the
  # loop, scheduled after the buckets' claims, waits for nothing.
  claim = (
    '  %claim = f32[32]{0} custom-call(%s), '
    'custom_call_target="jax_superoffload_stream_claim"\n'
    '  %join.0 = f32[64]{0:S(5)} custom-call(%h, %claim), '
    'custom_call_target="jax_superoffload_stream_join"\n'
  )
  hlo = HLO.replace('  %call.opt = ', claim + '  %call.opt = ')
  calls = hlo_report.summarize(hlo, {})['optimizer_calls']
  assert [(c['target'], c['waits']) for c in calls] == [
    ('jax_superoffload_stream_claim', False),
    ('jax_superoffload_stream_join', False),
    ('jax_superoffload_adam_step_segments', False),
    ('jax_superoffload_stream_join', True),
  ]


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
    'written_over': 0,
    'host_results': 0,
    'fetched': 0,
  }
  assert hlo_report.summarize(RESEED, {})['first_start_at'] is None


HELD_ROW = """HloModule held_row

ENTRY %main (c: s32[], s: f32[9], r: s32[1], m: f32[3,64], u: f32[3,64], v: f32[3,64], g: bf16[3,64]) -> bf16[3,64] {
  %c = s32[] parameter(0)
  %s = f32[9]{0} parameter(1)
  %r = s32[1]{0:S(5)} parameter(2)
  %m = f32[3,64]{1,0:S(5)} parameter(3)
  %u = f32[3,64]{1,0:S(5)} parameter(4)
  %v = f32[3,64]{1,0:S(5)} parameter(5)
  %g = bf16[3,64]{1,0} parameter(6)
  ROOT %row = bf16[3,64]{1,0} custom-call(%c, %s, %r, %m, %u, %v, %g), custom_call_target="jax_superoffload_adam_step_row", output_to_operand_aliasing={{}: (6, {})}, backend_config={hold_inputs = true, num_leaves = 1 : i64, reseed = false, staging_bytes = 2048 : i64}
}
"""


def test_a_row_step_of_stacked_gradients_fetches_one_row_and_writes_no_weights():
  # The count and scalars (256-byte aligned; the row cursor is in host
  # memory), and one row of the stacked bf16 gradient (128 bytes,
  # aligned), which its worker fetches: not the stack's 384 bytes, nor
  # twice for the aliased result, which is the gradient passed on, held,
  # not new weights. It holds its inputs.
  (call,) = hlo_report.stream_staging(HELD_ROW)
  assert (call['staged'], call['fetched'], call['on_demand']) == (768, 256, 0)
  facts = hlo_report.call_facts(HELD_ROW)['row']
  assert facts['hold_inputs'] and not facts['weights_alias_grads'], facts


# The buffer a row step writes its weights over must reach its join
# uncopied: a copy in the loop (here, of the call's result) leaves the
# worker writing where nothing reads. Without weights over it, a copy is
# nothing of the kind.
def test_a_copy_of_a_written_over_gradient_is_reported():
  over = HELD_ROW.replace(
    'hold_inputs = true,', 'hold_inputs = true, weights_over_grads = true,'
  )
  copied = over.replace(
    'ROOT %row = bf16[3,64]{1,0} custom-call(',
    '%row = bf16[3,64]{1,0} custom-call(',
  ).replace('\n}\n', '\n  ROOT %cp = bf16[3,64]{1,0} copy(%row)\n}\n')
  assert copied != over
  assert hlo_report.written_copies(over) == []
  assert hlo_report.written_copies(copied) == ['cp']
  plain = copied.replace(' weights_over_grads = true,', '')
  assert hlo_report.written_copies(plain) == []


def test_a_row_step_with_weights_over_its_gradient_writes_back_its_row():
  # The same step writing its new weights over the row it read: its
  # worker copies that row (128 bytes of bf16) back, not the stack.
  over = HELD_ROW.replace(
    'hold_inputs = true,', 'hold_inputs = true, weights_over_grads = true,'
  )
  assert over != HELD_ROW
  facts = hlo_report.call_facts(over)['row']
  assert facts['weights_alias_grads'] and facts['weights_bytes'] == 128, facts


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


START = """HloModule start

ENTRY %main (c: s32[1], s: f32[9], u: s32[1], m: f32[64], g: f32[64], p: f32[64]) -> (f32[1], f32[64], f32[64]) {
  %c = s32[1]{0} parameter(0)
  %s = f32[9]{0} parameter(1)
  %u = s32[1]{0} parameter(2)
  %m = f32[64]{0:S(5)} parameter(3)
  %g = f32[64]{0} parameter(4)
  %p = f32[64]{0} parameter(5)
  ROOT %start = (f32[1]{0:S(5)}, f32[64]{0:S(5)}, f32[64]{0}) custom-call(%c, %s, %u, %m, %g, %p), custom_call_target="jax_superoffload_adam_step_segments", output_to_operand_aliasing={{1}: (3, {}), {2}: (4, {})}, backend_config={hold_inputs = true, num_leaves = 1 : i64, reseed = true, staging_bytes = 4096 : i64}
}
"""


def test_a_start_that_holds_its_inputs_and_writes_weights_into_its_gradients():
  # Result 1 (the state, host memory) aliases operand 3, its host state;
  # result 2 (64 floats in device memory) aliases operand 4, the gradient:
  # the new weights, which the worker copies back after its host step.
  facts = hlo_report.call_facts(START)['start']
  assert facts['hold_inputs'] is True
  assert facts['weights_alias_grads'] is True
  assert facts['weights_bytes'] == 64 * 4
  (call,) = hlo_report.summarize(START, {})['optimizer_calls']
  assert call['hold_inputs'] and call['weights_bytes'] == 256


def test_a_start_as_compiled_today_holds_nothing_and_aliases_only_state():
  today = START.replace('hold_inputs = true, ', '').replace(
    ', {2}: (4, {})', ''
  )
  facts = hlo_report.call_facts(today)['start']
  assert facts['hold_inputs'] is False
  assert facts['weights_alias_grads'] is False
  said_false = START.replace('hold_inputs = true', 'hold_inputs = false')
  assert hlo_report.call_facts(said_false)['start']['hold_inputs'] is False
  # Aliasing a front operand (the count) is not a weight.
  count = START.replace('{2}: (4, {})', '{2}: (0, {})')
  assert hlo_report.call_facts(count)['start']['weights_alias_grads'] is False


# As the library compiles a bucket on a GPU: a stream claim hands the
# gradient's buffer over to the new weights, the start reads it (and says
# weights_over_grads), and a join passes it on after the bucket's join.
CLAIMED = """HloModule claimed

ENTRY %main (c: s32[1], s: f32[9], u: s32[1], m: f32[64], g: bf16[64]) -> (f32[64], bf16[64]) {
  %c = s32[1]{0} parameter(0)
  %s = f32[9]{0} parameter(1)
  %u = s32[1]{0} parameter(2)
  %m = f32[64]{0:S(5)} parameter(3)
  %g = bf16[64]{0} parameter(4)
  %claim = bf16[64]{0} custom-call(%g), custom_call_target="jax_superoffload_stream_claim", custom_call_has_side_effect=true, output_to_operand_aliasing={{}: (0, {})}
  %start = (f32[1]{0:S(5)}, f32[64]{0:S(5)}) custom-call(%c, %s, %u, %m, %claim), custom_call_target="jax_superoffload_adam_step_segments", output_to_operand_aliasing={{1}: (3, {})}, backend_config={hold_inputs = true, num_leaves = 1 : i64, reseed = false, staging_bytes = 4096 : i64, weights_over_grads = true}
  %sum = f32[1]{0:S(5)} get-tuple-element(%start), index=0
  %master = f32[64]{0:S(5)} get-tuple-element(%start), index=1
  %join = f32[1]{0:S(5)} custom-call(%sum, %c), custom_call_target="jax_superoffload_stream_join", custom_call_has_side_effect=true, output_to_operand_aliasing={{}: (0, {})}
  %weights = bf16[64]{0} custom-call(%claim, %join), custom_call_target="jax_superoffload_stream_join", custom_call_has_side_effect=true, output_to_operand_aliasing={{}: (0, {})}
  ROOT %out = (f32[64]{0:S(5)}, bf16[64]{0}) tuple(%master, %weights)
}
"""


def test_a_start_that_writes_its_weights_over_claimed_gradients():
  # Its weights: the claimed gradient's 128 bytes, staged twice (read at
  # the start, written back by the worker); the claim starts no step and
  # its result, read by the start, is not a start's result read early.
  facts = hlo_report.call_facts(CLAIMED)
  assert facts['start']['weights_alias_grads'] is True
  assert facts['start']['weights_bytes'] == 128
  assert facts['start']['hold_inputs'] is True
  assert not facts.get('claim', {}).get('weights_alias_grads')
  (staged,) = hlo_report.stream_staging(CLAIMED)
  assert staged['written_over'] == 256  # Aligned.
  summary = hlo_report.summarize(CLAIMED, {})
  assert summary['reads_before_join'] == []
  starts = [c for c in summary['optimizer_calls'] if 'segments' in c['target']]
  assert len(starts) == 1
  # Without the attribute the claimed operand is only read.
  plain = CLAIMED.replace(', weights_over_grads = true', '')
  assert hlo_report.call_facts(plain)['start']['weights_alias_grads'] is False


HOST_COMPUTE = """HloModule host

ENTRY %main (g: f32[64], m: f32[64]) -> (f32[64], f32[64]) {
  %g = f32[64]{0} parameter(0)
  %m = f32[64]{0:S(5)} parameter(1)
  %copy-start = (f32[64]{0:S(5)}, f32[64]{0}, u32[]) copy-start(%g)
  %copy-done = f32[64]{0:S(5)} copy-done(%copy-start)
  %hc.start = ((f32[64]{0:S(5)}, f32[64]{0:S(5)}), (f32[64]{0:S(5)}, f32[32]{0}), u32[]) custom-call-start(%copy-done, %m), async_execution_thread="host", custom_call_target="HostExecute"
  %hc.done = (f32[64]{0:S(5)}, f32[32]{0}) custom-call-done(%hc.start)
  %gte0 = f32[64]{0:S(5)} get-tuple-element(%hc.done), index=0
  %copy.h = f32[64]{0:S(5)} copy(%gte0)
  %gte1 = f32[32]{0} get-tuple-element(%hc.done), index=1
  ROOT %t = (f32[64]{0:S(5)}, f32[32]{0}) tuple(%copy.h, %gte1)
}
"""


def test_host_computes_copies_and_what_waits_for_them():
  # Its gradient copied to the host (the compute stream waits at once:
  # nothing runs between the copy's start and done), its state copied
  # host to host after it (on the compute stream), and 32 floats its
  # done writes to device memory.
  facts = hlo_report.call_facts(HOST_COMPUTE)['hc.start']
  assert facts['copies_in'] == [
    {'direction': 'D2H', 'waited_by': 'compute', 'count': 1, 'bytes': 256}
  ]
  assert facts['copies_out'] == [
    {'direction': 'H2H', 'waited_by': 'compute', 'count': 1, 'bytes': 256}
  ]
  assert facts['device_result_bytes'] == 32 * 4
  # Work between the copy's start and done: the copy overlaps it.
  work = '  %w = f32[64]{0} negate(%g)\n'
  busy = HOST_COMPUTE.replace('  %copy-done =', work + '  %copy-done =')
  (copied,) = hlo_report.call_facts(busy)['hc.start']['copies_in']
  assert copied['waited_by'] == 'copy'
