// The XLA FFI handler symbols of the Grace Adam kernel (CPU platform).

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_ADAM_FFI_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_ADAM_FFI_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JsoStreamRoofline(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepSegments(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepLowpSegments(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepSpeculative(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepValidated(XLA_FFI_CallFrame* call_frame);
// The bucket handlers ordered on a CUDA stream (stream_launch.h).
XLA_FFI_Error* JsoAdamStepSegmentsStream(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepLowpSegmentsStream(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepSpeculativeStream(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepValidatedStream(XLA_FFI_CallFrame* call_frame);
// One row of stacked state stepped in place (row_ffi.h), on the CPU and
// from a CUDA stream.
XLA_FFI_Error* JsoAdamStepRow(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepRowStream(XLA_FFI_CallFrame* call_frame);
// Stacked masters re-seeded from stacked parameters a row at a time, before
// a scan's row steps (row_ffi.h), on XLA:CPU and from a CUDA stream.
XLA_FFI_Error* JsoAdamReseedRows(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamReseedRowsStream(XLA_FFI_CallFrame* call_frame);
// The join of a step's stream launches: an identity on the CPU, the wait
// for the launches from a CUDA stream.
XLA_FFI_Error* JsoStreamJoin(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoStreamJoinStream(XLA_FFI_CallFrame* call_frame);
// Gradient buffers handed over to the new weights a joined start writes
// over them: an identity, on the CPU and from a CUDA stream.
XLA_FFI_Error* JsoStreamClaim(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoStreamClaimStream(XLA_FFI_CallFrame* call_frame);
// The joined launches' new weights copied to the device, after the join.
XLA_FFI_Error* JsoStreamToDevice(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoStreamToDeviceStream(XLA_FFI_CallFrame* call_frame);
}

namespace jax_superoffload {

using FfiHandler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// Every FFI target, declared here only: the nanobind module files each
// handler under `name` and gives Python the name as attribute `attr`. The
// bucket handlers also have a `stream_handler`, filed under the same name
// for the CUDA platform, where the program calls them outside host compute.
struct FfiTarget {
  const char* attr;
  const char* name;
  FfiHandler* handler;
  FfiHandler* stream_handler = nullptr;
};

inline constexpr FfiTarget kFfiTargets[] = {
    {"ADAM_STEP_SEGMENTS_TARGET", "jax_superoffload_adam_step_segments",
     JsoAdamStepSegments, JsoAdamStepSegmentsStream},
    {"ADAM_STEP_LOWP_SEGMENTS_TARGET",
     "jax_superoffload_adam_step_lowp_segments", JsoAdamStepLowpSegments,
     JsoAdamStepLowpSegmentsStream},
    {"ADAM_STEP_SPECULATIVE_TARGET", "jax_superoffload_adam_step_speculative",
     JsoAdamStepSpeculative, JsoAdamStepSpeculativeStream},
    {"ADAM_STEP_VALIDATED_TARGET", "jax_superoffload_adam_step_validated",
     JsoAdamStepValidated, JsoAdamStepValidatedStream},
    {"ADAM_STEP_ROW_TARGET", "jax_superoffload_adam_step_row", JsoAdamStepRow,
     JsoAdamStepRowStream},
    {"ADAM_RESEED_ROWS_TARGET", "jax_superoffload_adam_reseed_rows",
     JsoAdamReseedRows, JsoAdamReseedRowsStream},
    {"STREAM_ROOFLINE_TARGET", "jax_superoffload_stream_roofline",
     JsoStreamRoofline},
    {"STREAM_JOIN_TARGET", "jax_superoffload_stream_join", JsoStreamJoin,
     JsoStreamJoinStream},
    {"STREAM_CLAIM_TARGET", "jax_superoffload_stream_claim", JsoStreamClaim,
     JsoStreamClaimStream},
    {"STREAM_TO_DEVICE_TARGET", "jax_superoffload_stream_to_device",
     JsoStreamToDevice, JsoStreamToDeviceStream},
};

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_ADAM_FFI_H_
