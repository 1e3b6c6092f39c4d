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
XLA_FFI_Error* JsoAdamStepSpeculative(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JsoAdamStepValidated(XLA_FFI_CallFrame* call_frame);
}

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_ADAM_FFI_H_
