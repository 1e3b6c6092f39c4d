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

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_grace_adam, m) {
  m.doc() = "Grace Adam: XLA FFI handlers of the fused CPU Adam kernel.";
  m.def("registrations", []() {
    nb::dict handlers;
    for (const jax_superoffload::FfiTarget& target :
         jax_superoffload::kFfiTargets) {
      handlers[target.name] = EncapsulateFfiHandler(target.handler);
    }
    return handlers;
  });
  m.def(
      "stream_registrations",
      []() {
        nb::dict handlers;
        for (const jax_superoffload::FfiTarget& target :
             jax_superoffload::kFfiTargets) {
          if (target.stream_handler == nullptr) continue;
          handlers[target.name] = EncapsulateFfiHandler(target.stream_handler);
        }
        return handlers;
      },
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
      "host_pool_workers",
      []() { return jax_superoffload::HostPool::Process().num_workers(); },
      "Worker threads the process's host pool has started so far.");
  for (const jax_superoffload::FfiTarget& target :
       jax_superoffload::kFfiTargets) {
    m.attr(target.attr) = target.name;
  }
  m.def("instruction_set",
        []() { return jax_superoffload::IsaName(jax_superoffload::BestIsa()); },
        "The instruction set the kernel dispatches to on this CPU.");
  m.def(
      "prefetch_policy",
      []() {
        jax_superoffload::Prefetch prefetch;
        const char* name = std::getenv("JAX_SUPEROFFLOAD_PREFETCH");
        if (!jax_superoffload::ParsePrefetch(name, &prefetch)) {
          throw nb::value_error(
              "JAX_SUPEROFFLOAD_PREFETCH must be t0, nta, none or unset");
        }
        return jax_superoffload::PrefetchName(prefetch);
      },
      "The software prefetch the kernel's handlers use now: t0, nta or none.");
  m.def("own_helper_threads", &jax_superoffload::OwnHelperThreads,
        nb::arg("pool_threads"),
        "Threads a step would start beside the caller given an intra-op "
        "pool of `pool_threads` (-1: it uses the pool), as the environment "
        "now says.");
}
