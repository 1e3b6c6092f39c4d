// The portable path: one lane at a time, the reference for the others.

#include "xla_ffi/adam_kernel_impl.h"
#include "xla_ffi/adam_kernel_isa.h"
#include "xla_ffi/lowp_moments_impl.h"

JSO_DEFINE_FIXED_WIDTH_ISA(Scalar, ScalarOps)
JSO_DEFINE_LOWP_ISA(Scalar, ScalarOps)
