// The row step of stacked fp32 state (row_ffi.h): its XLA FFI handlers, on
// XLA:CPU's pool and started from a CUDA stream (stream_launch.h).

#include "xla_ffi/row_ffi.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/adam_ffi.h"
#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/launch.h"
#include "xla_ffi/stream_launch.h"

namespace ffi = xla::ffi;

namespace jax_superoffload {
namespace {

// Leaf j of a row step (see AdamStepRow): its stacked state, `*rows` rows
// of the gradient's n elements, as row 0's buffers.
ffi::Error GetRowLeaf(ffi::RemainingArgs& args, int64_t k, bool reseed,
                      size_t j, SegmentLeaf* leaf, int64_t* rows) {
  ffi::AnyBuffer grad(nullptr), master(nullptr), mu(nullptr), nu(nullptr);
  JSO_RETURN_IF_ERROR(GetArg(args, k, 3, j, -1, &grad));
  const int64_t n = static_cast<int64_t>(grad.element_count());
  if (n == 0) {
    return LeafError(j,
                     "the row's gradient is empty: a stacked leaf needs "
                     "at least one element per row");
  }
  JSO_RETURN_IF_ERROR(GetArg(args, k, 0, j, -1, &master));
  const int64_t total = static_cast<int64_t>(master.element_count());
  if (total % n != 0) {
    return LeafError(j, "stacked state of " + std::to_string(total) +
                            " elements is not a whole number of rows of the "
                            "row's " +
                            std::to_string(n) + " gradient elements");
  }
  JSO_RETURN_IF_ERROR(GetArg(args, k, 1, j, total, &mu));
  JSO_RETURN_IF_ERROR(GetArg(args, k, 2, j, total, &nu));
  for (const ffi::AnyBuffer* x : {&master, &mu, &nu}) {
    JSO_RETURN_IF_ERROR(F32(*x, j, "stacked state"));
  }
  AdamBuffers& b = leaf->b;
  b.size = n;
  JSO_RETURN_IF_ERROR(
      GetTyped(args, k, 3, j, n, "gradient", &b.grad, &b.grad_type));
  b.master_out = static_cast<float*>(master.untyped_data());
  b.mu_out = static_cast<float*>(mu.untyped_data());
  b.nu_out = static_cast<float*>(nu.untyped_data());
  b.master_in = b.master_out;
  b.mu_in = b.mu_out;
  b.nu_in = b.nu_out;
  if (reseed) {
    JSO_RETURN_IF_ERROR(GetTyped(args, k, 4, j, n, "parameter", &leaf->params,
                                 &leaf->param_type));
  }
  if (const char* error = ValidateAdamBuffers(b)) return LeafError(j, error);
  *rows = total / n;
  return ffi::Error::Success();
}

// `b`, row 0's buffers of stacked state, moved to row `row`.
void AtRow(int64_t row, AdamBuffers* b) {
  const int64_t offset = row * b->size;
  b->master_in += offset;
  b->mu_in += offset;
  b->nu_in += offset;
  b->master_out += offset;
  b->mu_out += offset;
  b->nu_out += offset;
}

// The row's step, once its operands hold their values.
ffi::Error StepRow(const RowStep& step, Workers workers) {
  const int64_t row = *step.row;
  if (row < 0 || row >= step.rows) {
    return InvalidArgument(
        "row " + std::to_string(row) + " is outside [0, " +
        std::to_string(step.rows) +
        "): the stacked state has L = " + std::to_string(step.rows) + " rows");
  }
  const AdamConstants constants = step.set.Read(0);
  std::vector<SegmentLeaf> leaves = step.leaves;
  std::vector<int64_t> sizes;
  for (SegmentLeaf& leaf : leaves) {
    AtRow(row, &leaf.b);
    sizes.push_back(leaf.b.size);
  }
  const Isa isa = BestIsa();
  ForEachPiece(workers, Starts(sizes),
               [&](size_t j, int64_t begin, int64_t end, int64_t) {
                 StepSegmentPiece(constants, leaves[j], begin, end, isa,
                                  nullptr);
               });
  return ffi::Error::Success();
}

// One row of k stacked leaves. Operands after the count, the scalars and
// `row` (s32, one element): k masters, k mu, k nu (f32, L rows of n_j
// elements each, stepped in place: the call has no results), k gradients
// of the row (n_j elements of f32, bf16 or f16) and, with `reseed`, the k
// parameters of the row the step starts from (see ReseedRange).
ffi::Error AdamStepRow(Launch& launch, Counts count, Scalars scalars, Flag row,
                       ffi::RemainingArgs args, ffi::RemainingRets rets,
                       BucketAttrs attrs) {
  const LeafRuns runs(attrs.num_leaves, args.size(), rets.size());
  JSO_RETURN_IF_ERROR(runs.Expect(attrs.reseed ? 5 : 4, 0));
  if (runs.k() < 1) return InvalidArgument("a row step needs a leaf");
  if (attrs.compute_sumsq) {
    return InvalidArgument("a row step has no sum of squares");
  }
  if (row.element_count() != 1) {
    return InvalidArgument("row must be one s32 scalar, got " +
                           std::to_string(row.element_count()) + " elements");
  }
  Prefetch prefetch;
  JSO_RETURN_IF_ERROR(ReadPrefetch(attrs.prefetch, &prefetch));
  RowStep step;
  step.leaves.resize(runs.k());
  for (int64_t j = 0; j < runs.k(); ++j) {
    int64_t rows = 0;
    JSO_RETURN_IF_ERROR(
        GetRowLeaf(args, runs.k(), attrs.reseed, j, &step.leaves[j], &rows));
    step.leaves[j].b.prefetch = prefetch;
    if (j > 0 && rows != step.rows) {
      return LeafError(j, "stacked state has " + std::to_string(rows) +
                              " rows, leaf 0's has " +
                              std::to_string(step.rows));
    }
    step.rows = rows;
  }
  JSO_RETURN_IF_ERROR(CheckScalarSets(count, scalars, attrs, -1, &step.set));
  step.row = row.typed_data();
  return StartRowStep(launch, std::move(step), attrs);
}

}  // namespace

ffi::Error StartRowStep(Launch& launch, RowStep step,
                        const BucketAttrs& attrs) {
  using Role = Touched::Role;
  std::vector<Touched> touched = TouchScalars(step.set);
  touched.push_back(Touch(step.row, 4, Role::kInput));
  for (SegmentLeaf& leaf : step.leaves) {
    AdamBuffers& b = leaf.b;
    const int64_t stacked = 4 * step.rows * b.size;  // Every row.
    for (const float** x : {&b.master_in, &b.mu_in, &b.nu_in}) {
      touched.push_back(Touch(*x, stacked, Role::kState));
    }
    for (float** x : {&b.master_out, &b.mu_out, &b.nu_out}) {
      touched.push_back(Touch(*x, stacked, Role::kState));
    }
    touched.push_back(
        Touch(b.grad, ElementBytes(b.grad_type, b.size), Role::kInput));
    touched.push_back(Touch(leaf.params, ElementBytes(leaf.param_type, b.size),
                            Role::kInput));
  }
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  return RunWith(launch, attrs, [step = std::move(step)](Workers workers) {
    return StepRow(step, workers);
  });
}

}  // namespace jax_superoffload

JSO_DEFINE_BUCKET_HANDLERS(JsoAdamStepRow, JsoAdamStepRowStream,
                           ::jax_superoffload::AdamStepRow, false,
                           ::jax_superoffload::Flag);
