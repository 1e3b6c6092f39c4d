// Entry points of the per-instruction-set translation units.
//
// Every unit is compiled on every platform; a unit built without its target
// flags reports `...Compiled() == false` and is never called.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_ISA_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_ISA_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/lowp_moments.h"

namespace jax_superoffload::internal {

#define JSO_DECLARE_ISA(Name)                                                 \
  bool Name##Compiled();                                                      \
  /* Returns the sum of squared scaled gradients if sum_squares, else 0. */   \
  double AdamStepRange##Name(const AdamConstants& constants,                  \
                             const AdamBuffers& buffers, int64_t begin,       \
                             int64_t end, bool sum_squares);                  \
  void RooflineRange##Name(const AdamBuffers& buffers, int64_t begin,         \
                           int64_t end);                                      \
  void ReseedBf16Range##Name(float* master, const uint16_t* params,           \
                             float tolerance, int64_t begin, int64_t end);    \
  double LowpStepRange##Name(const AdamConstants& constants,                  \
                             const LowpMomentBuffers& buffers, int64_t begin, \
                             int64_t end, bool sum_squares);

JSO_DECLARE_ISA(Scalar)
JSO_DECLARE_ISA(Avx2)
JSO_DECLARE_ISA(Avx512)
JSO_DECLARE_ISA(Neon)
JSO_DECLARE_ISA(Sve)

#undef JSO_DECLARE_ISA

// names[value], or `otherwise` for a value past the end of `names` (the
// names of an enum's values 0, 1, ...).
template <class Enum, size_t kSize>
const char* EnumName(const char* const (&names)[kSize], Enum value,
                     const char* otherwise) {
  const size_t i = static_cast<size_t>(value);
  return i < kSize ? names[i] : otherwise;
}

// The entry points of one instruction set's unit.
struct IsaEntries {
  bool (*compiled)();
  double (*step)(const AdamConstants&, const AdamBuffers&, int64_t, int64_t,
                 bool);
  void (*roofline)(const AdamBuffers&, int64_t, int64_t);
  void (*reseed_bf16)(float*, const uint16_t*, float, int64_t, int64_t);
  double (*lowp_step)(const AdamConstants&, const LowpMomentBuffers&, int64_t,
                      int64_t, bool);
};

// Those of `isa`, which need not be available.
const IsaEntries& Entries(Isa isa);

}  // namespace jax_superoffload::internal

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_ISA_H_
