#include "xla_ffi/stv_kernel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla_ffi/float_convert.h"

namespace jax_superoffload {
namespace {

void KeepGradient(const PairBuffers& p, int64_t begin, int64_t end) {
  switch (p.grad_type) {
    case ElementType::kBF16: {
      const uint16_t* g = static_cast<const uint16_t*>(p.grad);
      for (int64_t i = begin; i < end; ++i) {
        p.kept_grad[i] = Bf16BitsToFloat(g[i]);
      }
      break;
    }
    case ElementType::kF16: {
      const uint16_t* g = static_cast<const uint16_t*>(p.grad);
      for (int64_t i = begin; i < end; ++i) {
        p.kept_grad[i] = F16BitsToFloat(g[i]);
      }
      break;
    }
    default:
      std::memcpy(p.kept_grad + begin,
                  static_cast<const float*>(p.grad) + begin,
                  static_cast<size_t>(end - begin) * sizeof(float));
  }
}

// The speculative step over [begin, end) of `b`, the gradient kept block
// by block with plain stores (when `b` does not stream it itself).
double StepThenKeep(const AdamConstants& constants, const PairBuffers& pair,
                    const AdamBuffers& b, int64_t begin, int64_t end, Isa isa) {
  if (pair.kept_grad == nullptr || b.grad_copy != nullptr) {
    return AdamStepSumSquaresRange(constants, b, begin, end, isa);
  }
  double sum = 0.0;
  for (int64_t i = begin; i < end; i += kKeepGradBlock) {
    const int64_t stop = std::min(end, i + kKeepGradBlock);
    sum += AdamStepSumSquaresRange(constants, b, i, stop, isa);
    KeepGradient(pair, i, stop);
  }
  return sum;
}

}  // namespace

AdamBuffers RowStep(const PairBuffers& p, int from, const void* grad,
                    ElementType grad_type) {
  const int64_t in = from == 0 ? 0 : p.row_stride;
  const int64_t out = from == 0 ? p.row_stride : 0;
  AdamBuffers b;
  b.size = p.size;
  b.master_in = p.master + in;
  b.mu_in = p.mu + in;
  b.nu_in = p.nu + in;
  b.master_out = p.master + out;
  b.mu_out = p.mu + out;
  b.nu_out = p.nu + out;
  b.grad = grad;
  b.grad_type = grad_type;
  b.lowp_out = p.lowp_out;
  b.lowp_type = p.lowp_type;
  b.prefetch = p.prefetch;
  return b;
}

double SpeculativeStepRange(const AdamConstants& constants,
                            const PairBuffers& pair, int from, int64_t begin,
                            int64_t end, Isa isa) {
  AdamBuffers b = RowStep(pair, from, pair.grad, pair.grad_type);
  const int64_t head = IsaStreams(isa) ? StreamableHead(b, begin, end) : -1;
  if (head < 0) return StepThenKeep(constants, pair, b, begin, end, isa);
  // The elements before the rows' 64-byte boundary one by one (plain
  // stores; the scalar path computes the same bits), then the rest
  // streamed, the kept gradient too where it shares their alignment.
  double sum =
      StepThenKeep(constants, pair, b, begin, begin + head, Isa::kScalar);
  b.stream_state = true;
  b.grad_copy = pair.kept_grad;
  if (StreamableHead(b, begin + head, end) != 0) b.grad_copy = nullptr;
  return sum + StepThenKeep(constants, pair, b, begin + head, end, isa);
}

void RedoStepRange(const AdamConstants& constants, const PairBuffers& pair,
                   int from, int64_t begin, int64_t end, Isa isa) {
  AdamStepRange(constants,
                RowStep(pair, from, pair.kept_grad, ElementType::kF32), begin,
                end, isa);
}

}  // namespace jax_superoffload
