// hipBLASLt MXFP4 GEMM call path over an injected API table (reference/hipblaslt-mxfp4.md §1.5).
//
// Row-major caller buffers X = lhs [M, K/2], W = rhs [N, K/2], Y = out [M, N] are handed to
// hipBLASLt's column-major, TN-only FP4 path as Y^T = W^T' . X:
//   A = W as (K x N) col-major, ld = K elements, opA = T;  A scales = rhs scales
//   B = X as (K x M) col-major, ld = K elements, opB = N;  B scales = lhs scales
//   C = D = Y as (N x M) col-major, ld = N (hipBLASLt m = N, n = M), beta = 0, alpha = 1
// Compute type 32F, scale type 32F; scale mode VEC32_UE8M0 (plain) or BLK32_UE8M0_32_8_EXT
// (swizzled). Scale pointers get a dummy before the heuristic and the real ones before
// hipblasLtMatmul. A leading batch dim runs one hipblasLtMatmul per element (MX needs batch 1).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "jax_mxfp4/hipblaslt_api.h"
#include "jax_mxfp4/problem.h"

namespace jax_mxfp4 {

inline constexpr uint64_t kMaxWorkspaceBytes = uint64_t{64} << 20;
inline constexpr int kRequestedAlgos = 8;
inline constexpr size_t kWorkspaceAlignment = 256;  // hipBLASLt needs >= 16
inline constexpr int kMinHipblasltVersion = 100000;         // 1.0.0 (ROCm 7.0): FP4 + VEC32_UE8M0
inline constexpr int kMinHipblasltVersionSwizzled = 100300; // 1.3.0: BLK32_UE8M0_32_8_EXT
inline constexpr int kMinHipRuntimeVersion = 70000000;      // HIP 7.0
inline constexpr const char* kRequiredArch = "gfx950";

class WorkspaceAllocator {
 public:
  virtual ~WorkspaceAllocator() = default;
  // Device memory of at least `bytes`, aligned to `alignment`, valid until the call returns;
  // nullptr on failure.
  virtual void* Allocate(size_t bytes, size_t alignment) = 0;
};

struct GemmBuffers {
  const void* lhs = nullptr;
  const void* lhs_scales = nullptr;
  const void* rhs = nullptr;
  const void* rhs_scales = nullptr;
  void* out = nullptr;
};

struct DeviceInfo {
  std::string arch;        // gcnArchName up to the first ':' ("gfx950")
  int major = 0, minor = 0;
  int hip_runtime_version = 0;
  int hipblaslt_version = 0;  // MAJOR*100000 + MINOR*100 + PATCH
};

// Shape and dtype rules of hipBLASLt's MX path (hipBLASLt api-reference "Supported data types":
// m%16, n%16, K%128, TN only); InvalidArgument naming the rule, or Ok.
Status CheckHipblasltShape(int64_t m, int64_t n, int64_t k, ElemType out);

// Per-process state over one API table: per-device handle pools, device info, algorithm cache
// keyed by (device, M, N, K, out dtype, scale mode). Thread-safe.
class HipblasltRuntime {
 public:
  explicit HipblasltRuntime(const HipblasltApi* api) : api_(api) {}
  ~HipblasltRuntime();  // destroys pooled handles (the process-wide instance is never destroyed)
  HipblasltRuntime(const HipblasltRuntime&) = delete;
  HipblasltRuntime& operator=(const HipblasltRuntime&) = delete;

  // out = lhs . rhs^T on `device` / `stream`. Checks every gate and every status.
  Status Gemm(const GemmProblem& p, const GemmBuffers& b, abi::hipStream_t stream, int device,
              WorkspaceAllocator* workspace);
  // Gates + heuristic only (dummy scale pointers, no buffers); caches the algorithm found.
  Status FindAlgorithm(int device, int64_t m, int64_t n, int64_t k, ElemType out,
                       ScaleLayout layout);
  Status GetDeviceInfo(int device, DeviceInfo* info);
  Status DeviceCount(int* count);

 private:
  struct CachedAlgo {
    abi::hipblasLtMatmulAlgo_t algo;
    size_t workspace_size;
  };
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int, int>;
  class Call;

  Status BorrowHandle(int device, abi::hipblasLtHandle_t* handle);
  void ReturnHandle(int device, abi::hipblasLtHandle_t handle);
  Status Gates(int device, int64_t m, int64_t n, int64_t k, ElemType out, ScaleLayout layout);

  const HipblasltApi* api_;
  std::mutex mu_;
  std::map<int, std::vector<abi::hipblasLtHandle_t>> pool_;
  std::map<int, DeviceInfo> info_;
  std::map<Key, CachedAlgo> cache_;
};

// The process-wide runtime over the real libraries (created on first use, never destroyed:
// destroying handles after the HIP runtime shut down at exit could crash).
HipblasltRuntime& ProcessHipblasltRuntime(const HipblasltApi* api);

}  // namespace jax_mxfp4
