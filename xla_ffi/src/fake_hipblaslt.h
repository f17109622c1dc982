// Recording test double of the hipBLASLt + HIP functions in HipblasltApi (CI runs the real call
// path against it on the CPU). Built only into the test-only module _hipblaslt_double, never
// into the shipped jax_mxfp4._native. "Device memory" is host memory registered with the double; every
// pointer hipblasLtMatmul receives is checked to lie inside a registered region of the size the
// descriptors imply, and the product is computed from the descriptors and attributes as
// hipBLASLt defines them (column-major, opA/opB, ld in elements, scale mode) with the CPU
// reference arithmetic, so a wrong ld, operand order or scale pointer gives wrong numbers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "jax_mxfp4/hipblaslt_api.h"

namespace jax_mxfp4::fake {

struct Config {
  std::string arch = "gfx950:sramecc+:xnack-";
  int major = 9, minor = 5;
  int hipblaslt_version = 100300;  // 1.3.0
  int hip_runtime_version = 70100000;
  int device_count = 1;
  int current_device = 0;
  int heuristic_count = 1;           // algorithms the heuristic returns (0: empty list)
  uint64_t workspace_size = 4096;    // workspaceSize of every returned algorithm
  std::string fail_fn;               // inject a failure into this function ...
  int fail_nth = 1;                  // ... on its nth call ...
  int fail_status = 0;               // ... returning this status (hipblasStatus_t / hipError_t)
  bool rocroller_library = true;     // what the loader would report (LoadResult::rocroller_path)

  // Models of hipBLASLt behaviour beyond the call contract (reference/hipblaslt-mxfp4.md §7), each
  // off unless a test turns it on. The kernel provider of a matmul is TensileLite when its handle's
  // route is TensileLite or the scales are swizzled (FP4 x FP4 with mode 1001 runs on TensileLite's
  // subtile kernels), rocRoller otherwise. The route comes from HIPBLASLT_USE_ROCROLLER (unset or
  // first char '1': rocRoller; anything else: TensileLite) and rocroller_library.
  bool model_heuristic = false;        // empty list for f16 out, no scale pointers, no dividing tile
  bool model_tensilelite_scales = false;  // TensileLite reads VEC32 scales in the pre-swizzled order
  bool model_rocroller_dense = false;  // rocRoller ignores ld: A and B read as dense (ld = K)
  bool model_route_at_create = false;  // route fixed at hipblasLtCreate (else read at each matmul);
                                       // a rocRoller algorithm on a TensileLite handle: INVALID_VALUE
  bool model_mode_version = false;     // A/B_SCALE_MODE 1001 below 1.3.0: INVALID_VALUE
  bool model_workspace_per_solution = false;  // algorithm i needs workspace_size * (i + 1)
  bool model_c_read = false;           // only rocRoller with plain scales reads C (else always)
  bool model_kernel_per_handle = false;  // rocRoller compiles per handle: a matmul whose algorithm
                                         // was not found on its handle compiles (noted in the log)
};

using Value = std::variant<int64_t, double, std::string>;
struct Record {
  std::string fn;
  std::vector<std::pair<std::string, Value>> args;
};

// Resets the double (config, log, memory map, objects) and returns its API table.
const HipblasltApi* Reset(const Config& config);
void RegisterMemory(const void* p, size_t bytes);
const std::vector<Record>& Log();
int LiveObjects();  // descriptors + handles not yet destroyed

}  // namespace jax_mxfp4::fake
