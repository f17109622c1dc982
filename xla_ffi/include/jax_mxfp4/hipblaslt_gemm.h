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
// Where rocRoller runs the GEMM (plain scales on its route) the output is zeroed on the stream
// first, because C = D and its kernels read C even with beta = 0 (reference §6.4, §7.4).
//
// Envelopes (which GEMMs the handler accepts; reference/hipblaslt-mxfp4.md §2 and §6):
//   validated (default): the project's policy, modelled on the MXFP4 gate reported for ROCm
//     TransformerEngine (not found in its sources, reference §7.8): hipBLASLt >= 1.3,
//     K % 256 == 0, M % 32 == N % 32 == 0, bf16 or f32 out, beta = 0, plus the route gates
//     (plain scales only on the rocRoller route).
//   documented (opt-in, JAX_MXFP4_HIPBLASLT_ENVELOPE=documented; UNVERIFIED on hardware): the
//     hipBLASLt api-reference rules M % 16, N % 16, K % 128, f16 out too, hipBLASLt >= 1.0 for
//     plain scales, plus the route gates of CheckHipblasltRoute.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "jax_mxfp4/hipblaslt_api.h"
#include "jax_mxfp4/problem.h"

namespace jax_mxfp4 {

inline constexpr uint64_t kMaxWorkspaceBytes = uint64_t{64} << 20;
inline constexpr int kRequestedAlgos = 8;
inline constexpr size_t kWorkspaceAlignment = 256;  // hipBLASLt needs >= 16
inline constexpr int kMinHipblasltVersion = 100000;         // 1.0.0 (ROCm 7.0): FP4 + VEC32_UE8M0
inline constexpr int kMinHipblasltVersionSwizzled = 100300; // 1.3.0: BLK32_UE8M0_32_8_EXT
inline constexpr int kMinHipblasltVersionValidated = 100300; // 1.3.0: TE-ROCm's hardware gate
inline constexpr int kHipblasltVersionPaddedSwizzle = 100500; // 1.5.0: padded swizzled buffers
inline constexpr const char* kEnvelopeEnv = "JAX_MXFP4_HIPBLASLT_ENVELOPE";
inline constexpr const char* kRocrollerEnv = "HIPBLASLT_USE_ROCROLLER";
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

enum class Envelope { kValidated, kDocumented };

// The envelope in force: $JAX_MXFP4_HIPBLASLT_ENVELOPE, "validated" (default, also when unset
// or empty) or "documented"; InvalidArgument for any other value.
Status ReadEnvelope(Envelope* envelope);

// The same rule for a value the caller read: "" and "validated" give kValidated, "documented"
// kDocumented, anything else InvalidArgument naming the variable.
Status ParseEnvelope(const std::string& value, Envelope* envelope);

// Shape and dtype rules of the envelope (header comment); InvalidArgument naming the rule, or Ok.
Status CheckHipblasltShape(int64_t m, int64_t n, int64_t k, ElemType out, Envelope envelope);

// hipBLASLt's internal route for block-scaled GEMMs. The library reads HIPBLASLT_USE_ROCROLLER
// when a handle is created (rocblaslt handle constructor): unset -> rocRoller for eligible MX
// problems; set with first character '1' -> rocRoller; set to anything else (even "") -> off,
// i.e. TensileLite. A build without rocRoller always takes TensileLite.
struct Route {
  bool tensilelite = false;
  std::string why;  // one line for error messages and the selftest
};
// `rocroller_library`: a librocroller* object is loaded in the process (LoadResult).
Route HipblasltRoute(bool rocroller_library);

// Layout rules that depend on the route and the library version (reference §6.1, §6.2, §7.1):
//  - plain scales on the TensileLite route: refused for every shape. TensileLite maps both scale
//    modes to one call and is not told the layout; its gfx950 FP4 kernels expect pre-swizzled
//    scales, so plain ones could be read permuted. Swizzled scales are that route's own path;
//  - swizzled scales on hipBLASLt < 1.5.0: M % 32 == N % 32 == 0 and K % 256 == 0 (no padding).
// Unimplemented naming the rule, or Ok.
Status CheckHipblasltRoute(int64_t m, int64_t n, int64_t k, ScaleLayout layout, int hipblaslt_version,
                           const Route& route);

// Whether the kernel reads C although beta = 0: rocRoller (route rocRoller, plain scales) always
// forms beta * C; TensileLite (its route, and every swizzled FP4 x FP4 GEMM) selects by beta.
bool KernelReadsC(ScaleLayout layout, const Route& route);

// Per-process state over one API table: handle pools keyed by (device, stream), device info,
// algorithm cache keyed by (device, M, N, K, out dtype, scale mode, route). Thread-safe.
//
// Route: hipBLASLt reads HIPBLASLT_USE_ROCROLLER in each handle's constructor. The runtime reads
// it next to its first hipblasLtCreate and keeps that snapshot for every gate; a later handle
// whose route would differ (the variable changed) is refused with FailedPrecondition, so a gate
// and the handle that runs the GEMM never disagree.
//
// Kernels per handle: rocRoller generates its kernels per handle, so each (handle, problem) runs
// the heuristic once on its own handle before its first matmul (the JIT cost lands there, not
// inside an enqueued hipblasLtMatmul); later calls on that handle reuse the answer.
//
// Handles: hipblaslt.h forbids using one handle from two streams while work may be in flight
// (the 1.5.0 CHANGELOG fixes a Stream-K deadlock caused by that), so a handle returned after
// a GEMM on stream S is only ever handed out again for stream S on the same device, where the
// stream orders the work. Calls that enqueue nothing (version query, heuristic) use the
// stream-less pool (key stream = nullptr).
class HipblasltRuntime {
 public:
  explicit HipblasltRuntime(const HipblasltApi* api, bool rocroller_library = true)
      : api_(api), rocroller_library_(rocroller_library) {}
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
  // The route snapshot (taken at the first handle), or the environment's answer before it.
  Route CurrentRoute();

 private:
  struct CachedAlgo {
    abi::hipblasLtMatmulAlgo_t algo;
    size_t workspace_size;
  };
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int, int, bool>;  // ..., tensilelite
  class Call;

  using PoolKey = std::pair<int, abi::hipStream_t>;
  Status BorrowHandle(const PoolKey& key, abi::hipblasLtHandle_t* handle);
  void ReturnHandle(const PoolKey& key, abi::hipblasLtHandle_t handle);
  Status Gates(int device, int64_t m, int64_t n, int64_t k, ElemType out, ScaleLayout layout);
  Key KeyOf(int device, int64_t m, int64_t n, int64_t k, ElemType out, ScaleLayout layout);

  const HipblasltApi* api_;
  bool rocroller_library_;
  std::mutex mu_;
  std::map<PoolKey, std::vector<abi::hipblasLtHandle_t>> pool_;
  std::map<int, DeviceInfo> info_;
  std::map<Key, CachedAlgo> cache_;
  std::map<std::pair<abi::hipblasLtHandle_t, Key>, CachedAlgo> handle_algos_;
  std::optional<Route> route_;  // guarded by mu_; set at the first hipblasLtCreate
};

// The process-wide runtime over the real libraries (created on first use, never destroyed:
// destroying handles after the HIP runtime shut down at exit could crash).
HipblasltRuntime& ProcessHipblasltRuntime(const HipblasltApi* api);

}  // namespace jax_mxfp4
