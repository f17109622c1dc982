// hipBLASLt MXFP4 GEMM call path (see hipblaslt_gemm.h). Never throws across the FFI boundary:
// every HIP / hipBLASLt status becomes a Status naming the call and the status.
#include "jax_mxfp4/hipblaslt_gemm.h"

#include <cstdlib>
#include <cstring>

#include "jax_mxfp4/str_cat.h"

namespace jax_mxfp4 {
namespace {

using namespace abi;  // NOLINT: the declared ABI names read best unqualified here

Status BlasError(const char* call, hipblasStatus_t s, const std::string& context = "") {
  std::string m = StrCat(call, " failed with ", HipblasStatusName(s), " (", s, ")");
  if (!context.empty()) m += StrCat(" [", context, "]");
  return Status::Internal(m);
}

Status HipError(const HipblasltApi* api, const char* call, hipError_t e) {
  const char* text = api->hipGetErrorString ? api->hipGetErrorString(e) : nullptr;
  return Status::Internal(
      StrCat(call, " failed with hipError_t ", e, " (", text ? text : "no description", ")"));
}

hipDataType OutDataType(ElemType t) {
  switch (t) {
    case ElemType::kBF16: return HIP_R_16BF;
    case ElemType::kF16: return HIP_R_16F;
    default: return HIP_R_32F;
  }
}

hipblasLtMatmulMatrixScale_t ScaleMode(ScaleLayout l) {
  return l == ScaleLayout::kPlain ? HIPBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
                                  : HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT;
}

std::string Shape(int64_t m, int64_t n, int64_t k, ElemType out, ScaleLayout l) {
  return StrCat("M=", m, " N=", n, " K=", k, " out=", ElemTypeName(out),
                " scales=", l == ScaleLayout::kPlain ? "plain" : "swizzled");
}

std::string VersionString(int v) {
  return StrCat(v / 100000, ".", (v / 100) % 1000, ".", v % 100);
}

// Never dereferenced: hipBLASLt only needs non-null scale pointers to select MX kernels.
alignas(256) const uint8_t kDummyScales[256] = {};

}  // namespace

Status ReadEnvelope(Envelope* envelope) {
  const char* v = std::getenv(kEnvelopeEnv);
  return ParseEnvelope(v ? v : "", envelope);
}

Status ParseEnvelope(const std::string& value, Envelope* envelope) {
  if (value.empty() || value == "validated") {
    *envelope = Envelope::kValidated;
  } else if (value == "documented") {
    *envelope = Envelope::kDocumented;
  } else {
    return Status::Invalid(std::string(kEnvelopeEnv) + " must be \"validated\" (default) or \"documented\", got \"" +
                           value + "\"");
  }
  return Status::Ok();
}

Status CheckHipblasltShape(int64_t m, int64_t n, int64_t k, ElemType out, Envelope envelope) {
  if (envelope == Envelope::kValidated) {
    if (m % 32 != 0 || n % 32 != 0 || k % 256 != 0 || k <= 0) {
      return Status::Invalid(StrCat(
          "hipBLASLt MXFP4 (validated envelope: the gfx950-tested gate of ROCm TransformerEngine) "
          "needs M % 32 == 0, N % 32 == 0 and K % 256 == 0 with K > 0; got M=",
          m, " N=", n, " K=", k, " (", kEnvelopeEnv,
          "=documented opts into the wider, unverified M % 16, N % 16, K % 128)"));
    }
    if (out != ElemType::kF32 && out != ElemType::kBF16) {
      return Status::Invalid(std::string("hipBLASLt MXFP4 (validated envelope) writes float32 or bfloat16, not ") +
                             ElemTypeName(out) + " (" + kEnvelopeEnv + "=documented opts into unverified float16)");
    }
    return Status::Ok();
  }
  if (m % 16 != 0 || n % 16 != 0 || k % 128 != 0 || k <= 0) {
    return Status::Invalid(StrCat(
        "hipBLASLt MXFP4 needs M % 16 == 0, N % 16 == 0 and K % 128 == 0 with K > 0 "
        "(hipBLASLt api-reference, VEC32_UE8M0; documented envelope); got M=",
        m, " N=", n, " K=", k));
  }
  if (out != ElemType::kF32 && out != ElemType::kBF16 && out != ElemType::kF16) {
    return Status::Invalid(std::string("hipBLASLt MXFP4 writes float32, bfloat16 or float16, not ") +
                           ElemTypeName(out));
  }
  return Status::Ok();
}

bool KernelReadsC(ScaleLayout layout, const Route& route) {
  return layout == ScaleLayout::kPlain && !route.tensilelite;
}

Route HipblasltRoute(bool rocroller_library) {
  Route r;
  const char* v = std::getenv(kRocrollerEnv);
  if (v != nullptr && std::strncmp(v, "1", 1) != 0) {  // the library's own test
    r.tensilelite = true;
    r.why = std::string("TensileLite (") + kRocrollerEnv + "=\"" + v + "\" turns rocRoller off)";
  } else if (!rocroller_library) {
    r.tensilelite = true;
    r.why = "TensileLite (assumed: no librocroller loaded with hipBLASLt)";
  } else {
    r.why = std::string("rocRoller (") + (v ? std::string(kRocrollerEnv) + "=\"" + v + "\"" : kRocrollerEnv + std::string(" unset")) +
            ", librocroller loaded)";
  }
  return r;
}

Status CheckHipblasltRoute(int64_t m, int64_t n, int64_t k, ScaleLayout layout, int hipblaslt_version,
                           const Route& route) {
  const std::string s = StrCat("M=", m, " N=", n, " K=", k);
  if (layout == ScaleLayout::kPlain && route.tensilelite) {
    return Status::Unimplemented(
        "plain scales (VEC32_UE8M0) are refused on hipBLASLt's " + route.why +
        ": TensileLite is not told the scale mode and its gfx950 FP4 kernels read pre-swizzled scales, so plain "
        "ones could be read permuted (silently wrong) for every shape; use scale_layout=\"swizzled\" "
        "(BLK32_UE8M0_32_8_EXT, TensileLite's own FP4 x FP4 path); got " + s);
  }
  const bool unpadded = m % 32 == 0 && n % 32 == 0 && k % 256 == 0;
  if (!unpadded && layout == ScaleLayout::kSwizzled && hipblaslt_version < kHipblasltVersionPaddedSwizzle) {
    return Status::Unimplemented(
        "swizzled scales (BLK32_UE8M0_32_8_EXT) on hipBLASLt " + VersionString(hipblaslt_version) +
        " < 1.5.0 need M % 32 == 0, N % 32 == 0 and K % 256 == 0 (padded buffers are only fixed in 1.5.0); got " +
        s);
  }
  return Status::Ok();
}

// One GEMM's resources: a borrowed handle, the four layouts, the matmul descriptor and the
// preference. The destructor releases everything; the first release failure is stored in
// *cleanup (reported when the call itself succeeded).
class HipblasltRuntime::Call {
 public:
  Call(HipblasltRuntime* rt, int device, abi::hipStream_t stream, Status* cleanup)
      : rt_(rt), api_(rt->api_), device_(device), stream_(stream), cleanup_(cleanup) {}
  ~Call() {
    if (pref_) Release("hipblasLtMatmulPreferenceDestroy", api_->hipblasLtMatmulPreferenceDestroy(pref_));
    if (desc_) Release("hipblasLtMatmulDescDestroy", api_->hipblasLtMatmulDescDestroy(desc_));
    for (hipblasLtMatrixLayout_t l : {a_, b_, c_, d_}) {
      if (l) Release("hipblasLtMatrixLayoutDestroy", api_->hipblasLtMatrixLayoutDestroy(l));
    }
    if (handle_) rt_->ReturnHandle({device_, stream_}, handle_);
    if (switched_) {
      hipError_t e = api_->hipSetDevice(previous_device_);
      if (e != hipSuccess && cleanup_->ok()) *cleanup_ = HipError(api_, "hipSetDevice (restore)", e);
    }
  }

  Status SelectDevice() {
    hipError_t e = api_->hipGetDevice(&previous_device_);
    if (e != hipSuccess) return HipError(api_, "hipGetDevice", e);
    if (previous_device_ != device_) {
      e = api_->hipSetDevice(device_);
      if (e != hipSuccess) return HipError(api_, "hipSetDevice", e);
      switched_ = true;
    }
    return Status::Ok();
  }

  Status Prepare(int64_t m, int64_t n, int64_t k, ElemType out, ScaleLayout layout) {
    Status st = rt_->BorrowHandle({device_, stream_}, &handle_);
    if (!st.ok()) return st;
    const std::string ctx = Shape(m, n, k, out, layout);
    hipblasStatus_t s;
    // hipBLASLt m = N (rows of op(A) = W), n = M, contraction K; leading dims in FP4 elements.
    if ((s = api_->hipblasLtMatrixLayoutCreate(&a_, HIP_R_4F_E2M1, k, n, k)))
      return BlasError("hipblasLtMatrixLayoutCreate(A)", s, ctx);
    if ((s = api_->hipblasLtMatrixLayoutCreate(&b_, HIP_R_4F_E2M1, k, m, k)))
      return BlasError("hipblasLtMatrixLayoutCreate(B)", s, ctx);
    if ((s = api_->hipblasLtMatrixLayoutCreate(&c_, OutDataType(out), n, m, n)))
      return BlasError("hipblasLtMatrixLayoutCreate(C)", s, ctx);
    if ((s = api_->hipblasLtMatrixLayoutCreate(&d_, OutDataType(out), n, m, n)))
      return BlasError("hipblasLtMatrixLayoutCreate(D)", s, ctx);
    if ((s = api_->hipblasLtMatmulDescCreate(&desc_, HIPBLAS_COMPUTE_32F, HIP_R_32F)))
      return BlasError("hipblasLtMatmulDescCreate", s, ctx);
    const int32_t op_t = HIPBLAS_OP_T, op_n = HIPBLAS_OP_N;
    if ((s = api_->hipblasLtMatmulDescSetAttribute(desc_, HIPBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t))))
      return BlasError("hipblasLtMatmulDescSetAttribute(TRANSA)", s, ctx);
    if ((s = api_->hipblasLtMatmulDescSetAttribute(desc_, HIPBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n))))
      return BlasError("hipblasLtMatmulDescSetAttribute(TRANSB)", s, ctx);
    const uint32_t mode = ScaleMode(layout);
    if ((s = api_->hipblasLtMatmulDescSetAttribute(desc_, HIPBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode))))
      return BlasError("hipblasLtMatmulDescSetAttribute(A_SCALE_MODE)", s, ctx);
    if ((s = api_->hipblasLtMatmulDescSetAttribute(desc_, HIPBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode))))
      return BlasError("hipblasLtMatmulDescSetAttribute(B_SCALE_MODE)", s, ctx);
    return Status::Ok();
  }

  Status SetScalePointers(const void* a_scales, const void* b_scales, const char* what) {
    hipblasStatus_t s;
    if ((s = api_->hipblasLtMatmulDescSetAttribute(desc_, HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scales, sizeof(void*))))
      return BlasError((std::string("hipblasLtMatmulDescSetAttribute(A_SCALE_POINTER, ") + what + ")").c_str(), s);
    if ((s = api_->hipblasLtMatmulDescSetAttribute(desc_, HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scales, sizeof(void*))))
      return BlasError((std::string("hipblasLtMatmulDescSetAttribute(B_SCALE_POINTER, ") + what + ")").c_str(), s);
    return Status::Ok();
  }

  Status Heuristic(const std::string& ctx, CachedAlgo* found) {
    Status st = SetScalePointers(kDummyScales, kDummyScales, "dummy");
    if (!st.ok()) return st;
    hipblasStatus_t s;
    if ((s = api_->hipblasLtMatmulPreferenceCreate(&pref_)))
      return BlasError("hipblasLtMatmulPreferenceCreate", s, ctx);
    const uint64_t max_ws = kMaxWorkspaceBytes;
    if ((s = api_->hipblasLtMatmulPreferenceSetAttribute(pref_, HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws))))
      return BlasError("hipblasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)", s, ctx);
    hipblasLtMatmulHeuristicResult_t results[kRequestedAlgos] = {};
    int returned = 0;
    if ((s = api_->hipblasLtMatmulAlgoGetHeuristic(handle_, desc_, a_, b_, c_, d_, pref_, kRequestedAlgos, results, &returned)))
      return BlasError("hipblasLtMatmulAlgoGetHeuristic", s, ctx);
    for (int i = 0; i < returned && i < kRequestedAlgos; ++i) {
      if (results[i].state == HIPBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kMaxWorkspaceBytes) {
        found->algo = results[i].algo;
        found->workspace_size = results[i].workspaceSize;
        return Status::Ok();
      }
    }
    return Status::Unimplemented("hipblasLtMatmulAlgoGetHeuristic returned no usable algorithm (" +
                                 std::to_string(returned) + " returned) for " + ctx +
                                 "; route this GEMM to another backend");
  }

  hipblasLtHandle_t handle() const { return handle_; }

  Status Matmul(const CachedAlgo& algo, const void* w, const void* x, void* y, void* workspace) {
    const float alpha = 1.0f, beta = 0.0f;
    // C = D = y, zeroed on this stream before the first matmul (see Gemm).
    hipblasStatus_t s = api_->hipblasLtMatmul(handle_, desc_, &alpha, w, a_, x, b_, &beta, y, c_,
                                              y, d_, &algo.algo, workspace, algo.workspace_size, stream_);
    if (s) return BlasError("hipblasLtMatmul", s);
    return Status::Ok();
  }

 private:
  void Release(const char* call, hipblasStatus_t s) {
    if (s != HIPBLAS_STATUS_SUCCESS && cleanup_->ok()) *cleanup_ = BlasError(call, s);
  }

  HipblasltRuntime* rt_;
  const HipblasltApi* api_;
  int device_;
  abi::hipStream_t stream_;
  Status* cleanup_;
  int previous_device_ = 0;
  bool switched_ = false;
  hipblasLtHandle_t handle_ = nullptr;
  hipblasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr, d_ = nullptr;
  hipblasLtMatmulDesc_t desc_ = nullptr;
  hipblasLtMatmulPreference_t pref_ = nullptr;
};

HipblasltRuntime::~HipblasltRuntime() {
  for (auto& [device, handles] : pool_) {
    for (hipblasLtHandle_t h : handles) api_->hipblasLtDestroy(h);  // best effort at teardown
  }
}

Status HipblasltRuntime::BorrowHandle(const PoolKey& key, hipblasLtHandle_t* handle) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& free_list = pool_[key];
    if (!free_list.empty()) {
      *handle = free_list.back();
      free_list.pop_back();
      return Status::Ok();
    }
  }
  // The caller made `device` current; a handle belongs to the device current at creation. The
  // library reads its route in the handle constructor, so it is read here, next to the call.
  const Route route = HipblasltRoute(rocroller_library_);
  hipblasStatus_t s = api_->hipblasLtCreate(handle);
  if (s != HIPBLAS_STATUS_SUCCESS) {
    *handle = nullptr;
    return BlasError("hipblasLtCreate", s, "device " + std::to_string(key.first));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!route_) route_ = route;  // the snapshot every gate uses from now on
  if (route_->tensilelite != route.tensilelite) {
    api_->hipblasLtDestroy(*handle);  // best effort: the refusal below is the error to report
    *handle = nullptr;
    return Status::Precondition(
        std::string(kRocrollerEnv) + " changed after this process created its first hipBLASLt handle: "
        "hipBLASLt fixes the route per handle, and this process runs on " + route_->why +
        ", but a new handle would take " + route.why + "; restore the variable or restart the process");
  }
  return Status::Ok();
}

Route HipblasltRuntime::CurrentRoute() {
  std::lock_guard<std::mutex> lock(mu_);
  return route_ ? *route_ : HipblasltRoute(rocroller_library_);
}

void HipblasltRuntime::ReturnHandle(const PoolKey& key, hipblasLtHandle_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_[key].push_back(handle);
}

Status HipblasltRuntime::DeviceCount(int* count) {
  hipError_t e = api_->hipGetDeviceCount(count);
  if (e != hipSuccess) return HipError(api_, "hipGetDeviceCount", e);
  return Status::Ok();
}

Status HipblasltRuntime::GetDeviceInfo(int device, DeviceInfo* info) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = info_.find(device);
    if (it != info_.end()) {
      *info = it->second;
      return Status::Ok();
    }
  }
  Status cleanup;
  DeviceInfo d;
  Status st = [&]() -> Status {
    Call call(this, device, nullptr, &cleanup);
    Status s = call.SelectDevice();
    if (!s.ok()) return s;
    hipError_t e = api_->hipRuntimeGetVersion(&d.hip_runtime_version);
    if (e != hipSuccess) return HipError(api_, "hipRuntimeGetVersion", e);
    // hipDeviceProp_tR0600 is 1472 bytes; a larger zeroed buffer gives headroom.
    alignas(8) static thread_local unsigned char props[4096];
    std::memset(props, 0, sizeof(props));
    e = api_->hipGetDevicePropertiesR0600(props, device);
    if (e != hipSuccess) return HipError(api_, "hipGetDevicePropertiesR0600", e);
    const char* name = reinterpret_cast<const char*>(props + kDevicePropGcnArchNameOffset);
    std::string arch(name, strnlen(name, kDevicePropGcnArchNameSize - 1));
    d.arch = arch.substr(0, arch.find(':'));
    if ((e = api_->hipDeviceGetAttribute(&d.major, hipDeviceAttributeComputeCapabilityMajor, device)))
      return HipError(api_, "hipDeviceGetAttribute(ComputeCapabilityMajor)", e);
    if ((e = api_->hipDeviceGetAttribute(&d.minor, hipDeviceAttributeComputeCapabilityMinor, device)))
      return HipError(api_, "hipDeviceGetAttribute(ComputeCapabilityMinor)", e);
    hipblasLtHandle_t h = nullptr;
    s = BorrowHandle({device, nullptr}, &h);
    if (!s.ok()) return s;
    hipblasStatus_t bs = api_->hipblasLtGetVersion(h, &d.hipblaslt_version);
    ReturnHandle({device, nullptr}, h);
    if (bs != HIPBLAS_STATUS_SUCCESS) return BlasError("hipblasLtGetVersion", bs);
    return Status::Ok();
  }();
  if (!st.ok()) return st;
  if (!cleanup.ok()) return cleanup;
  if (d.arch.rfind("gfx", 0) == 0 && d.arch.size() >= 5) {
    // Cross-check of the struct offset: gfx9XY has compute capability 9.X for gfx9 parts.
    if (d.arch[3] == '9' && d.major != 9) {
      return Status::Internal("device " + std::to_string(device) + " reports arch " + d.arch +
                              " but compute capability major " + std::to_string(d.major) +
                              ": hipDeviceProp_tR0600 layout mismatch?");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  info_[device] = d;
  *info = d;
  return Status::Ok();
}

Status HipblasltRuntime::Gates(int device, int64_t m, int64_t n, int64_t k, ElemType out,
                               ScaleLayout layout) {
  Envelope envelope;
  Status st = ReadEnvelope(&envelope);
  if (!st.ok()) return st;
  st = CheckHipblasltShape(m, n, k, out, envelope);
  if (!st.ok()) return st;
  DeviceInfo d;
  st = GetDeviceInfo(device, &d);
  if (!st.ok()) return st;
  if (d.hip_runtime_version < kMinHipRuntimeVersion) {
    return Status::Precondition("HIP runtime version " + std::to_string(d.hip_runtime_version) +
                                " < 7.0: MXFP4 needs ROCm >= 7.0");
  }
  if (d.arch != kRequiredArch) {
    return Status::Precondition("hipBLASLt MXFP4 GEMM needs a gfx950 GPU (MI350/MI355); device " +
                                std::to_string(device) + " is " + d.arch);
  }
  if (d.hipblaslt_version < kMinHipblasltVersion) {
    return Status::Precondition("hipBLASLt " + VersionString(d.hipblaslt_version) +
                                " has no FP4/VEC32_UE8M0 support; need >= 1.0.0 (ROCm 7.0)");
  }
  if (envelope == Envelope::kValidated && d.hipblaslt_version < kMinHipblasltVersionValidated) {
    return Status::Unimplemented("hipBLASLt " + VersionString(d.hipblaslt_version) +
                                 " is below the validated envelope's 1.3.0 (" + kEnvelopeEnv +
                                 "=documented opts into unverified >= 1.0.0 with plain scales)");
  }
  if (layout == ScaleLayout::kSwizzled && d.hipblaslt_version < kMinHipblasltVersionSwizzled) {
    return Status::Unimplemented("swizzled scales (BLK32_UE8M0_32_8_EXT) need hipBLASLt >= 1.3.0, found " +
                                 VersionString(d.hipblaslt_version) + "; use scale_layout=\"plain\"");
  }
  return CheckHipblasltRoute(m, n, k, layout, d.hipblaslt_version, CurrentRoute());
}

HipblasltRuntime::Key HipblasltRuntime::KeyOf(int device, int64_t m, int64_t n, int64_t k, ElemType out,
                                              ScaleLayout layout) {
  return Key{device, m, n, k, static_cast<int>(out), static_cast<int>(layout), CurrentRoute().tensilelite};
}

Status HipblasltRuntime::FindAlgorithm(int device, int64_t m, int64_t n, int64_t k, ElemType out,
                                       ScaleLayout layout) {
  Status st = Gates(device, m, n, k, out, layout);
  if (!st.ok()) return st;
  const Key key = KeyOf(device, m, n, k, out, layout);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cache_.count(key)) return Status::Ok();
  }
  Status cleanup;
  CachedAlgo found{};
  st = [&]() -> Status {
    Call call(this, device, nullptr, &cleanup);  // the heuristic enqueues no work
    Status s = call.SelectDevice();
    if (s.ok()) s = call.Prepare(m, n, k, out, layout);
    if (s.ok()) s = call.Heuristic(Shape(m, n, k, out, layout), &found);
    return s;
  }();
  if (!st.ok()) return st;
  if (!cleanup.ok()) return cleanup;
  std::lock_guard<std::mutex> lock(mu_);
  cache_.emplace(key, found);
  return Status::Ok();
}

Status HipblasltRuntime::Gemm(const GemmProblem& p, const GemmBuffers& b, abi::hipStream_t stream,
                              int device, WorkspaceAllocator* workspace) {
  if (p.batch == 0 || p.m == 0 || p.n == 0) return Status::Ok();  // nothing to write
  Status st = Gates(device, p.m, p.n, p.k, p.out_type, p.layout);
  if (!st.ok()) return st;
  const Key key = KeyOf(device, p.m, p.n, p.k, p.out_type, p.layout);
  Status cleanup;
  st = [&]() -> Status {
    Call call(this, device, stream, &cleanup);
    Status s = call.SelectDevice();
    if (!s.ok()) return s;
    s = call.Prepare(p.m, p.n, p.k, p.out_type, p.layout);
    if (!s.ok()) return s;
    // rocRoller generates a kernel per handle: an algorithm found on another handle (the
    // stream-less one at trace time) would be compiled again inside this stream's first
    // hipblasLtMatmul. So each (handle, problem) runs the heuristic once, on its own handle.
    CachedAlgo algo{};
    bool warmed = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = handle_algos_.find({call.handle(), key});
      if (it != handle_algos_.end()) {
        algo = it->second;
        warmed = true;
      }
    }
    if (!warmed) {
      s = call.Heuristic(Shape(p.m, p.n, p.k, p.out_type, p.layout), &algo);
      if (!s.ok()) return s;
      std::lock_guard<std::mutex> lock(mu_);
      cache_.emplace(key, algo);
      handle_algos_.emplace(std::make_pair(call.handle(), key), algo);
    }
    void* ws = nullptr;
    if (algo.workspace_size > 0) {
      ws = workspace->Allocate(algo.workspace_size, kWorkspaceAlignment);
      if (ws == nullptr) {
        return Status{StatusCode::kResourceExhausted,
                      "could not allocate the " + std::to_string(algo.workspace_size) +
                          "-byte hipBLASLt workspace from the XLA scratch allocator"};
      }
    }
    // beta = 0 does not keep rocRoller from reading C: its generated kernels always form beta * C,
    // and C aliases the output, which XLA hands over uninitialised; NaN/Inf bit patterns there
    // would give 0 * NaN = NaN. So there the output is zeroed on the same stream first (one
    // memset, ordered before the matmuls by the stream). TensileLite, which serves the TensileLite
    // route and every swizzled FP4 x FP4 GEMM, picks a kernel without C for beta = 0.
    if (KernelReadsC(p.layout, CurrentRoute())) {
      const size_t out_bytes = static_cast<size_t>(p.batch) * p.out_stride_bytes();
      if (hipError_t e = api_->hipMemsetAsync(b.out, 0, out_bytes, stream)) {
        return HipError(api_, "hipMemsetAsync (zero C = D before beta = 0)", e);
      }
    }
    for (int64_t i = 0; i < p.batch; ++i) {
      const uint8_t* ls = static_cast<const uint8_t*>(b.lhs_scales) + i * p.lhs_scale_stride();
      const uint8_t* rs = static_cast<const uint8_t*>(b.rhs_scales) + i * p.rhs_scale_stride();
      s = call.SetScalePointers(rs, ls, "real");  // A = W = rhs, B = X = lhs
      if (!s.ok()) return s;
      s = call.Matmul(algo, static_cast<const uint8_t*>(b.rhs) + i * p.rhs_data_stride(),
                      static_cast<const uint8_t*>(b.lhs) + i * p.lhs_data_stride(),
                      static_cast<uint8_t*>(b.out) + i * p.out_stride_bytes(), ws);
      if (!s.ok()) {
        s.message += " [" + Shape(p.m, p.n, p.k, p.out_type, p.layout) + ", batch element " +
                     std::to_string(i) + "]";
        return s;
      }
    }
    return Status::Ok();
  }();
  if (!st.ok()) return st;
  return cleanup;
}

HipblasltRuntime& ProcessHipblasltRuntime(const HipblasltApi* api) {
  // Intentionally leaked. rocRoller presence as seen by the loader (LoadResult::rocroller_path).
  static HipblasltRuntime* rt = new HipblasltRuntime(api, !LoadHipblaslt().rocroller_path.empty());
  return *rt;
}

}  // namespace jax_mxfp4
