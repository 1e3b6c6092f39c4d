// Python module `jax_superoffload._grace_adam`: hands the FFI handlers to
// JAX as capsules and reports which instruction set the kernel uses.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "xla_ffi/adam_ffi.h"
#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/host_pool.h"
#include "xla_ffi/stream_launch.h"

namespace nb = nanobind;
using jax_superoffload::FfiHandler;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The environment's settings, read when Python asks (as it traces a call),
// never by a handler: a malformed value is a ValueError naming it.
std::string PrefetchPolicy() {
  jax_superoffload::Prefetch prefetch;
  const char* name = std::getenv("JAX_SUPEROFFLOAD_PREFETCH");
  if (!jax_superoffload::ParsePrefetch(name, &prefetch)) {
    throw nb::value_error(("JAX_SUPEROFFLOAD_PREFETCH must be t0, nta, none "
                           "or unset, not '" +
                           std::string(name) + "'")
                              .c_str());
  }
  return jax_superoffload::PrefetchName(prefetch);
}

int64_t HostThreads() {
  const char* value = std::getenv("JAX_SUPEROFFLOAD_HOST_THREADS");
  const int64_t threads = jax_superoffload::ParseThreads(value);
  if (threads < 0) {
    throw nb::value_error(("JAX_SUPEROFFLOAD_HOST_THREADS must be a whole "
                           "number from 1 to 4096 or unset, not '" +
                           std::string(value) + "'")
                              .c_str());
  }
  return threads;
}

// The handler of each target by name: `stream` picks the stream-ordered
// ones (only the bucket targets have one).
nb::dict Registrations(bool stream) {
  nb::dict handlers;
  for (const jax_superoffload::FfiTarget& target :
       jax_superoffload::kFfiTargets) {
    FfiHandler* handler = stream ? target.stream_handler : target.handler;
    if (handler != nullptr) {
      handlers[target.name] = EncapsulateFfiHandler(handler);
    }
  }
  return handlers;
}

nb::tuple PackedScalars() {
  nb::list names;
  for (const jax_superoffload::PackedScalar& scalar :
       jax_superoffload::kPackedScalars) {
    names.append(scalar.name);
  }
  return nb::tuple(names);
}

// The environment's settings, and what they make of the threads.
void DefineSettings(nb::module_& m) {
  m.def("prefetch_policy", &PrefetchPolicy,
        "The software prefetch JAX_SUPEROFFLOAD_PREFETCH asks for: t0 (the "
        "default), nta or none.");
  m.def("host_threads", &HostThreads,
        "The threads in all JAX_SUPEROFFLOAD_HOST_THREADS asks for, 0 when "
        "it is unset.");
  m.def(
      "own_helper_threads",
      [](int64_t pool_threads) {
        return jax_superoffload::OwnHelperThreads(HostThreads(), pool_threads);
      },
      nb::arg("pool_threads"),
      "Threads a step would start beside the caller given an intra-op "
      "pool of `pool_threads` (-1: it uses the pool), as the environment "
      "now says.");
}

}  // namespace

NB_MODULE(_grace_adam, m) {
  m.doc() = "Grace Adam: XLA FFI handlers of the fused CPU Adam kernel.";
  m.def("registrations", []() { return Registrations(false); });
  m.def(
      "stream_registrations", []() { return Registrations(true); },
      "The handlers ordered on a CUDA stream, by target name.");
  m.def(
      "cuda_driver",
      []() {
        std::string why;
        const bool ok = jax_superoffload::SystemCudaDriver(&why) != nullptr;
        return nb::make_tuple(ok, why);
      },
      "(loaded, why not): whether the CUDA driver a stream step needs loads.");
  m.def(
      "stream_staging_allocations",
      []() {
        return jax_superoffload::StreamLaunches::Process()
            .staging_allocations();
      },
      "Pinned staging allocations the stream launches have made so far.");
  m.def(
      "host_pool_workers",
      []() { return jax_superoffload::HostPool::Process().num_workers(); },
      "Worker threads the process's host pool has started so far.");
  for (const jax_superoffload::FfiTarget& target :
       jax_superoffload::kFfiTargets) {
    m.attr(target.attr) = target.name;
  }
  m.attr("PACKED_SCALARS") = PackedScalars();
  m.def(
      "instruction_set",
      []() { return jax_superoffload::IsaName(jax_superoffload::BestIsa()); },
      "The instruction set the kernel dispatches to on this CPU.");
  DefineSettings(m);
}
