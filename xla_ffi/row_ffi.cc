// The row step of stacked fp32 state (row_ffi.h): its XLA FFI handlers, on
// XLA:CPU's pool and started from a CUDA stream (stream_launch.h).

#include "xla_ffi/row_ffi.h"

#include <algorithm>
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

// Leaf j's stacked 16-bit weights (operand run `run`, `total` elements),
// into `b`'s low-precision copy, as row 0's.
ffi::Error GetRowWeights(ffi::RemainingArgs& args, int64_t k, int64_t run,
                         size_t j, int64_t total, AdamBuffers* b) {
  ffi::AnyBuffer weights(nullptr);
  JSO_RETURN_IF_ERROR(GetArg(args, k, run, j, total, &weights));
  if (!ToElementType(weights.element_type(), &b->lowp_type) ||
      b->lowp_type == ElementType::kF32) {
    return LeafError(j, "stacked weights must be bf16 or f16");
  }
  b->lowp_out = weights.untyped_data();
  return ffi::Error::Success();
}

// Leaf j of a row step (see AdamStepRow): its stacked state, `*rows` rows
// of n elements, as row 0's buffers, and with `weights` its stacked 16-bit
// weights. The gradient is the row's (n elements) or, shaped like the
// stacked master, every row's (`*stacked`), read at the step's row, and
// with `over_grads` written there with the new weights.
ffi::Error GetRowLeaf(ffi::RemainingArgs& args, int64_t k, bool reseed,
                      bool weights, bool over_grads, size_t j,
                      SegmentLeaf* leaf, int64_t* rows, bool* stacked) {
  ffi::AnyBuffer grad(nullptr), master(nullptr), mu(nullptr), nu(nullptr);
  JSO_RETURN_IF_ERROR(GetArg(args, k, 3, j, -1, &grad));
  JSO_RETURN_IF_ERROR(GetArg(args, k, 0, j, -1, &master));
  const auto dims = master.dimensions();
  const auto grad_dims = grad.dimensions();
  *stacked =
      dims.size() > 0 && dims[0] > 0 &&
      std::equal(dims.begin(), dims.end(), grad_dims.begin(), grad_dims.end());
  const int64_t total = static_cast<int64_t>(master.element_count());
  const int64_t n =
      *stacked ? total / dims[0] : static_cast<int64_t>(grad.element_count());
  if (n == 0) {
    return LeafError(j,
                     "the row's gradient is empty: a stacked leaf needs "
                     "at least one element per row");
  }
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
  JSO_RETURN_IF_ERROR(GetTyped(args, k, 3, j, *stacked ? total : n, "gradient",
                               &b.grad, &b.grad_type));
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
  if (weights) {
    JSO_RETURN_IF_ERROR(GetRowWeights(args, k, reseed ? 5 : 4, j, total, &b));
  }
  if (over_grads) {
    if (!*stacked || weights) {
      return LeafError(j,
                       "weights_over_grads needs stacked gradients and no "
                       "stacked weights operand");
    }
    b.lowp_out = const_cast<void*>(b.grad);
    b.lowp_type = b.grad_type;
  }
  if (const char* error = ValidateAdamBuffers(b)) return LeafError(j, error);
  *rows = total / n;
  return ffi::Error::Success();
}

// Leaf j's `rows`, checked against leaf 0's (`*all`, which leaf 0 sets).
ffi::Error SameRows(size_t j, int64_t rows, int64_t* all) {
  if (j > 0 && rows != *all) {
    return LeafError(j, "stacked state has " + std::to_string(rows) +
                            " rows, leaf 0's has " + std::to_string(*all));
  }
  *all = rows;
  return ffi::Error::Success();
}

// `b`, row 0's buffers of stacked state, moved to row `row`; its gradient
// too where it is stacked and read in place (`grad_in_place`), and its new
// weights unless they go over the gradient's stand-in (`over_stand_in`: a
// staged row, already the step's).
void AtRow(int64_t row, bool grad_in_place, bool over_stand_in,
           AdamBuffers* b) {
  const int64_t offset = row * b->size;
  if (grad_in_place) {
    b->grad =
        static_cast<const char*>(b->grad) + ElementBytes(b->grad_type, offset);
  }
  b->master_in += offset;
  b->mu_in += offset;
  b->nu_in += offset;
  b->master_out += offset;
  b->mu_out += offset;
  b->nu_out += offset;
  if (b->lowp_out != nullptr && !over_stand_in) {
    b->lowp_out =
        static_cast<char*>(b->lowp_out) + ElementBytes(b->lowp_type, offset);
  }
}

// Stacked gradients come back as the call's results, each aliased to its
// operand, and only they: the step reads a row of them when it runs, so
// XLA must keep them where they are until the join.
ffi::Error CheckStackedGrads(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                             int64_t k, const RowStep& step) {
  if (!step.stacked_grads) {
    if (rets.size() == 0) return ffi::Error::Success();
    return InvalidArgument(
        "a row step of the row's gradients has no results; only stacked "
        "gradients come back (aliased)");
  }
  if (rets.size() != static_cast<size_t>(k)) {
    return InvalidArgument(
        "stacked gradients must come back as the results, one per leaf");
  }
  for (int64_t j = 0; j < k; ++j) {
    ffi::AnyBuffer grad(nullptr);
    void* out = nullptr;
    ElementType out_type = ElementType::kNone;
    JSO_RETURN_IF_ERROR(GetArg(args, k, 3, j, -1, &grad));
    JSO_RETURN_IF_ERROR(GetRet(rets, k, 0, j,
                               static_cast<int64_t>(grad.element_count()), &out,
                               &out_type));
    if (out != grad.untyped_data()) {
      return LeafError(j,
                       "the stacked gradient's result must alias its operand "
                       "(input_output_aliases)");
    }
  }
  return ffi::Error::Success();
}

// The row's step, once its operands hold their values. With stacked
// gradients the row is the cursor's next, counting down, and the cursor
// moves to it once the row has stepped.
ffi::Error StepRow(const RowStep& step, Workers workers) {
  const int64_t row = step.stacked_grads ? *step.row - 1 : *step.row;
  if (row < 0 || row >= step.rows) {
    return InvalidArgument(
        "row " + std::to_string(row) + " is outside [0, " +
        std::to_string(step.rows) +
        "): the stacked state has L = " + std::to_string(step.rows) + " rows" +
        (step.stacked_grads ? " (more row steps than rows since the cursor "
                              "was set to L)"
                            : ""));
  }
  // A stacked gradient's row: fetched now into its stand-in, if it has one.
  if (step.stacked_grads) JSO_RETURN_IF_ERROR(workers.Fetch(row));
  const AdamConstants constants = step.set.Read(0);
  std::vector<SegmentLeaf> leaves = step.leaves;
  std::vector<int64_t> sizes;
  for (SegmentLeaf& leaf : leaves) {
    AtRow(row, step.stacked_grads && !step.grads_staged,
          step.over_grads && step.grads_staged, &leaf.b);
    sizes.push_back(leaf.b.size);
  }
  const Isa isa = BestIsa();
  ForEachPiece(workers, Starts(sizes),
               [&](size_t j, int64_t begin, int64_t end, int64_t) {
                 StepSegmentPiece(constants, leaves[j], begin, end, isa,
                                  nullptr);
               });
  if (step.stacked_grads) *step.row = static_cast<int32_t>(row);
  return ffi::Error::Success();
}

// One row of k stacked leaves. Operands after the count, the scalars and
// `row` (s32, one element; with stacked gradients a cursor in host memory,
// see StepRow): k masters, k mu, k nu (f32, L rows of n_j elements each,
// stepped in place), k gradients of the row (n_j elements of f32, bf16 or
// f16) or k stacked gradients (shaped like the masters), with `reseed` the
// k parameters of the row the step starts from (see ReseedRange) and
// optionally k stacked weights (bf16 or f16, L rows of n_j elements, in
// place), whose row receives the new master rounded to nearest even. With
// BucketAttrs::weights_over_grads (stacked gradients, no stacked weights)
// the new weights, in the gradients' dtype, go over the step's row of the
// gradients instead, once it is read: on a GPU the worker copies them back
// there after the step, so the join's results hold them.
// Results: none, or with stacked gradients the k gradients, aliased to
// their operands (XLA keeps them alive where they are: the step reads its
// row when it runs, StepRow).
ffi::Error AdamStepRow(Launch& launch, Counts count, Scalars scalars, Flag row,
                       ffi::RemainingArgs args, ffi::RemainingRets rets,
                       BucketAttrs attrs) {
  const LeafRuns runs(attrs.num_leaves, args.size(), rets.size());
  const int64_t leaf_args = attrs.reseed ? 5 : 4;
  const bool weights = runs.k() > 0 && static_cast<int64_t>(args.size()) ==
                                           (leaf_args + 1) * runs.k();
  const int64_t results = runs.k() > 0 ? rets.size() / runs.k() : 0;
  JSO_RETURN_IF_ERROR(runs.Expect(leaf_args + (weights ? 1 : 0), results));
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
    bool stacked = false;
    JSO_RETURN_IF_ERROR(GetRowLeaf(args, runs.k(), attrs.reseed, weights,
                                   attrs.weights_over_grads, j, &step.leaves[j],
                                   &rows, &stacked));
    step.leaves[j].b.prefetch = prefetch;
    JSO_RETURN_IF_ERROR(SameRows(j, rows, &step.rows));
    if (j > 0 && stacked != step.stacked_grads) {
      return LeafError(j, "gradients must all be the row's or all stacked");
    }
    step.stacked_grads = stacked;
  }
  JSO_RETURN_IF_ERROR(CheckStackedGrads(args, rets, runs.k(), step));
  JSO_RETURN_IF_ERROR(CheckScalarSets(count, scalars, attrs, -1, &step.set));
  step.row = row.typed_data();
  step.over_grads = attrs.weights_over_grads;
  return StartRowStep(launch, std::move(step), attrs);
}

// Leaf j of a re-seed (see AdamReseedRows), its row 0, and its rows.
ffi::Error GetReseedLeaf(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                         int64_t k, size_t j, ReseedLeaf* leaf, int64_t* rows) {
  ffi::AnyBuffer master(nullptr);
  JSO_RETURN_IF_ERROR(GetArg(args, k, 0, j, -1, &master));
  JSO_RETURN_IF_ERROR(F32(master, j, "stacked master"));
  const auto dims = master.dimensions();
  const int64_t total = static_cast<int64_t>(master.element_count());
  if (dims.size() < 1 || dims[0] < 1 || total == 0) {
    return LeafError(j,
                     "the stacked master must be f32[L, ...] with L >= 1 "
                     "rows of at least one element");
  }
  void* out = nullptr;
  ElementType out_type = ElementType::kNone;
  JSO_RETURN_IF_ERROR(GetRet(rets, k, 0, j, total, &out, &out_type));
  if (out != master.untyped_data()) {
    return LeafError(j,
                     "the re-seeded master must alias its operand "
                     "(input_output_aliases)");
  }
  JSO_RETURN_IF_ERROR(GetTyped(args, k, 1, j, total, "parameter", &leaf->params,
                               &leaf->param_type));
  *rows = dims[0];
  leaf->size = total / dims[0];
  leaf->master = static_cast<float*>(out);
  return ffi::Error::Success();
}

// The re-seed, once its operands hold their values: row by row, each
// row's parameters fetched (or read in place) and re-seeded from.
ffi::Error ReseedRows(const StackReseed& reseed, Workers workers) {
  if (*reseed.unchanged != 0) return ffi::Error::Success();
  // The tolerance of the row steps that follow, from the same scalars.
  const float tolerance = ReseedTolerance(reseed.set.Read(0));
  std::vector<int64_t> sizes;
  for (const ReseedLeaf& leaf : reseed.leaves) sizes.push_back(leaf.size);
  const std::vector<int64_t> starts = Starts(sizes);
  const Isa isa = BestIsa();
  for (int64_t row = 0; row < reseed.rows; ++row) {
    JSO_RETURN_IF_ERROR(workers.Fetch(row));
    ForEachPiece(workers, starts,
                 [&](size_t j, int64_t begin, int64_t end, int64_t) {
                   const ReseedLeaf& leaf = reseed.leaves[j];
                   const int64_t first = row * leaf.size;
                   // A staged row sits where row 0 was placed.
                   const void* params =
                       static_cast<const char*>(leaf.params) +
                       (leaf.staged ? 0 : ElementBytes(leaf.param_type, first));
                   float* master = leaf.master + first;
                   ReseedRange(master, params, leaf.param_type, tolerance,
                               master, begin, end, isa);
                 });
  }
  return ffi::Error::Success();
}

// k stacked leaves' masters re-seeded from their stacked parameters, row
// by row, as the row steps would re-seed each row (see ReseedRange), so
// that they step without parameters. Operands after the count and the
// scalars (those of the row steps): `unchanged` (s32, read when the
// re-seed runs: nonzero, the parameters are the weights the last step
// produced, and nothing is read or written), k masters (f32[L, ...], host
// memory) and k parameters (f32, bf16 or f16, as many elements, read a row
// at a time). Results: the k masters, aliased to their operands.
ffi::Error AdamReseedRows(Launch& launch, Counts count, Scalars scalars,
                          Flag unchanged, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, BucketAttrs attrs) {
  const LeafRuns runs(attrs.num_leaves, args.size(), rets.size());
  JSO_RETURN_IF_ERROR(runs.Expect(2, 1));
  if (runs.k() < 1) return InvalidArgument("a re-seed needs a leaf");
  StackReseed reseed;
  JSO_RETURN_IF_ERROR(CheckUnchanged(unchanged, &reseed.unchanged));
  reseed.leaves.resize(runs.k());
  for (int64_t j = 0; j < runs.k(); ++j) {
    int64_t rows = 0;
    JSO_RETURN_IF_ERROR(
        GetReseedLeaf(args, rets, runs.k(), j, &reseed.leaves[j], &rows));
    JSO_RETURN_IF_ERROR(SameRows(j, rows, &reseed.rows));
  }
  JSO_RETURN_IF_ERROR(CheckScalarSets(count, scalars, attrs, -1, &reseed.set));
  return StartReseedRows(launch, std::move(reseed), attrs);
}

}  // namespace

ffi::Error StartRowStep(Launch& launch, RowStep step,
                        const BucketAttrs& attrs) {
  using Role = Touched::Role;
  std::vector<Touched> touched = TouchScalars(step.set);
  // A cursor (stacked gradients) is state, in host memory (where a start
  // staged it, a later start would read it before this one wrote it back).
  touched.push_back(
      Touch(step.row, 4, step.stacked_grads ? Role::kState : Role::kInput));
  for (SegmentLeaf& leaf : step.leaves) {
    AdamBuffers& b = leaf.b;
    const int64_t stacked = 4 * step.rows * b.size;  // Every row.
    for (const float** x : {&b.master_in, &b.mu_in, &b.nu_in}) {
      touched.push_back(Touch(*x, stacked, Role::kState));
    }
    for (float** x : {&b.master_out, &b.mu_out, &b.nu_out}) {
      touched.push_back(Touch(*x, stacked, Role::kState));
    }
    if (step.stacked_grads) {
      // Row 0 on demand: its stand-in takes the step's row (StepRow) and,
      // with the new weights over it, goes back there.
      const bool over = step.over_grads;
      touched.push_back(Touched{b.grad, ElementBytes(b.grad_type, b.size),
                                over ? Role::kOnDemandInOut : Role::kOnDemand,
                                [&b, &step, over](void* to) {
                                  b.grad = to;
                                  if (over) b.lowp_out = to;
                                  step.grads_staged = true;
                                }});
    } else {
      touched.push_back(
          Touch(b.grad, ElementBytes(b.grad_type, b.size), Role::kInput));
    }
    touched.push_back(Touch(leaf.params, ElementBytes(leaf.param_type, b.size),
                            Role::kInput));
    // Every row, as the state: only the step's row is written.
    if (!step.over_grads) {
      touched.push_back(Touch(b.lowp_out,
                              ElementBytes(b.lowp_type, step.rows * b.size),
                              Role::kState));
    }
  }
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  return RunWith(launch, attrs, [step = std::move(step)](Workers workers) {
    return StepRow(step, workers);
  });
}

ffi::Error StartReseedRows(Launch& launch, StackReseed reseed,
                           const BucketAttrs& attrs) {
  using Role = Touched::Role;
  std::vector<Touched> touched = TouchScalars(reseed.set);
  touched.push_back(Touch(reseed.unchanged, 4, Role::kInput));
  for (ReseedLeaf& leaf : reseed.leaves) {
    touched.push_back(
        Touch(leaf.master, 4 * reseed.rows * leaf.size, Role::kState));
    // Row 0 on demand: its stand-in takes each row in turn.
    touched.push_back(Touched{leaf.params,
                              ElementBytes(leaf.param_type, leaf.size),
                              Role::kOnDemand, [&leaf](void* to) {
                                leaf.params = to;
                                leaf.staged = true;
                              }});
  }
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  return RunWith(launch, attrs, [reseed = std::move(reseed)](Workers workers) {
    return ReseedRows(reseed, workers);
  });
}

}  // namespace jax_superoffload

JSO_DEFINE_BUCKET_HANDLERS(JsoAdamReseedRows, JsoAdamReseedRowsStream,
                           ::jax_superoffload::AdamReseedRows, false,
                           ::jax_superoffload::Flag);
JSO_DEFINE_BUCKET_HANDLERS(JsoAdamStepRow, JsoAdamStepRowStream,
                           ::jax_superoffload::AdamStepRow, false,
                           ::jax_superoffload::Flag);
