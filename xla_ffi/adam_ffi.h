// The XLA FFI handler symbols of the Grace Adam kernel (CPU platform).

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_ADAM_FFI_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_ADAM_FFI_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JsoAdamStep(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepLowp(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepLowpInto(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoStreamRoofline(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepSegments(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepLowpSegments(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepSpeculative(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepValidated(XLA_FFI_CallFrame* call_frame);
}

namespace jax_superoffload {

// Every FFI target, declared here only: the nanobind module files each
// handler under `name` and gives Python the name as attribute `attr`.
struct FfiTarget {
  const char* attr;
  const char* name;
  XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*);
};

inline constexpr FfiTarget kFfiTargets[] = {
    {"ADAM_STEP_TARGET", "jax_superoffload_adam_step", JsoAdamStep},
    {"ADAM_STEP_LOWP_TARGET", "jax_superoffload_adam_step_lowp",
     JsoAdamStepLowp},
    {"ADAM_STEP_LOWP_INTO_TARGET", "jax_superoffload_adam_step_lowp_into",
     JsoAdamStepLowpInto},
    {"ADAM_STEP_SEGMENTS_TARGET", "jax_superoffload_adam_step_segments",
     JsoAdamStepSegments},
    {"ADAM_STEP_LOWP_SEGMENTS_TARGET",
     "jax_superoffload_adam_step_lowp_segments", JsoAdamStepLowpSegments},
    {"ADAM_STEP_SPECULATIVE_TARGET", "jax_superoffload_adam_step_speculative",
     JsoAdamStepSpeculative},
    {"ADAM_STEP_VALIDATED_TARGET", "jax_superoffload_adam_step_validated",
     JsoAdamStepValidated},
    {"STREAM_ROOFLINE_TARGET", "jax_superoffload_stream_roofline",
     JsoStreamRoofline},
};

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_ADAM_FFI_H_
