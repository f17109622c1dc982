// Recording test double of hipBLASLt + HIP (see fake_hipblaslt.h). Test-only; single-threaded.
#include "fake_hipblaslt.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "jax_mxfp4/cpu_gemm.h"
#include "jax_mxfp4/problem.h"

namespace jax_mxfp4::fake {
namespace {

using namespace abi;  // NOLINT

struct Layout {
  hipDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct Desc {
  hipblasComputeType_t compute;
  hipDataType scale_type;
  std::map<uint32_t, std::vector<uint8_t>> attrs;
};
struct Pref {
  std::map<uint32_t, std::vector<uint8_t>> attrs;
};
struct Handle {
  int device;
  bool tensilelite = false;      // its route, read at creation (model_route_at_create)
  hipStream_t stream = nullptr;  // the stream of its first matmul
  bool used = false;
  std::set<int> kernels;         // rocRoller kernels generated on it (model_kernel_per_handle)
};

struct State {
  Config cfg;
  std::vector<Record> log;
  std::map<std::string, int> calls;
  std::vector<std::pair<uintptr_t, size_t>> memory;
  std::map<void*, std::unique_ptr<Layout>> layouts;
  std::map<void*, std::unique_ptr<Desc>> descs;
  std::map<void*, std::unique_ptr<Pref>> prefs;
  std::map<void*, std::unique_ptr<Handle>> handles;
  HipblasltApi api;
};
State* g = nullptr;

int64_t P(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

// Records the call; returns the injected failure status for it (0 = proceed).
uint32_t Enter(const char* fn, std::vector<std::pair<std::string, Value>> args) {
  g->log.push_back({fn, std::move(args)});
  const int n = ++g->calls[fn];
  if (g->cfg.fail_fn == fn && n == g->cfg.fail_nth) {
    g->log.back().args.push_back({"injected_failure", int64_t{g->cfg.fail_status}});
    return static_cast<uint32_t>(g->cfg.fail_status);
  }
  return 0;
}
void Note(const std::string& key, Value v) { g->log.back().args.push_back({key, std::move(v)}); }

// hipBLASLt's route as the rocblaslt handle constructor reads it (reference §6.1, §7.2).
bool EnvTensileLite() {
  const char* v = std::getenv("HIPBLASLT_USE_ROCROLLER");
  return !g->cfg.rocroller_library || (v != nullptr && std::strncmp(v, "1", 1) != 0);
}
bool HandleTensileLite(const Handle& h) { return g->cfg.model_route_at_create ? h.tensilelite : EnvTensileLite(); }

// rocRoller's MX tile list and its selection rule m % tm == 0, n % tn == 0, k % (2 tk) == 0
// (rocroller_host.cpp, reference §1.4); hipBLASLt m, n, k.
bool RocrollerTileDivides(int64_t m, int64_t n, int64_t k) {
  static const int64_t kTiles[][3] = {{256, 256, 64}, {128, 128, 64}, {64, 64, 64}, {32, 32, 64}, {16, 16, 128}};
  for (const auto& t : kTiles) {
    if (m % t[0] == 0 && n % t[1] == 0 && k % (2 * t[2]) == 0) return true;
  }
  return false;
}

bool Valid(const void* p, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (const auto& [base, size] : g->memory) {
    if (a >= base && a + bytes <= base + size) return true;
  }
  return false;
}

Value Decode(uint32_t attr, const std::vector<uint8_t>& bytes, bool is_pref) {
  if (bytes.size() == 4) {
    int32_t v;
    std::memcpy(&v, bytes.data(), 4);
    return int64_t{v};
  }
  if (bytes.size() == 8) {
    uint64_t v;
    std::memcpy(&v, bytes.data(), 8);
    return static_cast<int64_t>(v);
  }
  (void)attr;
  (void)is_pref;
  return std::string("<") + std::to_string(bytes.size()) + " bytes>";
}

// ---------------------------------------------------------------- HIP runtime
hipError_t FakeGetDevice(int* d) {
  if (auto s = Enter("hipGetDevice", {})) return s;
  *d = g->cfg.current_device;
  Note("result", int64_t{*d});
  return hipSuccess;
}
hipError_t FakeSetDevice(int d) {
  if (auto s = Enter("hipSetDevice", {{"device", int64_t{d}}})) return s;
  if (d < 0 || d >= g->cfg.device_count) return 101;  // hipErrorInvalidDevice
  g->cfg.current_device = d;
  return hipSuccess;
}
hipError_t FakeGetDeviceCount(int* c) {
  if (auto s = Enter("hipGetDeviceCount", {})) return s;
  *c = g->cfg.device_count;
  return hipSuccess;
}
hipError_t FakeGetDeviceProps(void* prop, int d) {
  if (auto s = Enter("hipGetDevicePropertiesR0600", {{"device", int64_t{d}}})) return s;
  if (d < 0 || d >= g->cfg.device_count) return 101;
  auto* bytes = static_cast<unsigned char*>(prop);
  std::memcpy(bytes + kDevicePropMajorOffset, &g->cfg.major, 4);
  std::memcpy(bytes + kDevicePropMinorOffset, &g->cfg.minor, 4);
  std::strncpy(reinterpret_cast<char*>(bytes + kDevicePropGcnArchNameOffset), g->cfg.arch.c_str(),
               kDevicePropGcnArchNameSize - 1);
  return hipSuccess;
}
hipError_t FakeDeviceGetAttribute(int* v, hipDeviceAttribute_t attr, int d) {
  if (auto s = Enter("hipDeviceGetAttribute", {{"attr", int64_t{attr}}, {"device", int64_t{d}}})) return s;
  if (attr == hipDeviceAttributeComputeCapabilityMajor) *v = g->cfg.major;
  else if (attr == hipDeviceAttributeComputeCapabilityMinor) *v = g->cfg.minor;
  else return 1;  // hipErrorInvalidValue
  return hipSuccess;
}
hipError_t FakeRuntimeGetVersion(int* v) {
  if (auto s = Enter("hipRuntimeGetVersion", {})) return s;
  *v = g->cfg.hip_runtime_version;
  return hipSuccess;
}
hipError_t FakeMemsetAsync(void* dst, int value, size_t bytes, hipStream_t stream) {
  if (auto s = Enter("hipMemsetAsync", {{"dst", P(dst)}, {"value", int64_t{value}}, {"bytes", static_cast<int64_t>(bytes)},
                                        {"stream", P(stream)}}))
    return s;
  if (bytes > 0 && !Valid(dst, bytes)) return 1;  // hipErrorInvalidValue
  std::memset(dst, value, bytes);
  return hipSuccess;
}
const char* FakeGetErrorString(hipError_t e) {
  g->log.push_back({"hipGetErrorString", {{"error", int64_t{e}}}});
  return "fake HIP error";
}

// ---------------------------------------------------------------- hipBLASLt
hipblasStatus_t FakeCreate(hipblasLtHandle_t* h) {
  if (auto s = Enter("hipblasLtCreate", {{"current_device", int64_t{g->cfg.current_device}}})) return s;
  auto obj = std::make_unique<Handle>(Handle{g->cfg.current_device});
  obj->tensilelite = EnvTensileLite();
  *h = obj.get();
  g->handles[*h] = std::move(obj);
  Note("handle", P(*h));
  Note("route", std::string(EnvTensileLite() ? "TensileLite" : "rocRoller"));
  return HIPBLAS_STATUS_SUCCESS;
}
hipblasStatus_t FakeDestroy(hipblasLtHandle_t h) {
  if (auto s = Enter("hipblasLtDestroy", {{"handle", P(h)}})) return s;
  return g->handles.erase(h) ? HIPBLAS_STATUS_SUCCESS : HIPBLAS_STATUS_INVALID_VALUE;
}
hipblasStatus_t FakeGetVersion(hipblasLtHandle_t h, int* v) {
  if (auto s = Enter("hipblasLtGetVersion", {{"handle", P(h)}})) return s;
  if (!g->handles.count(h)) return HIPBLAS_STATUS_NOT_INITIALIZED;
  *v = g->cfg.hipblaslt_version;
  return HIPBLAS_STATUS_SUCCESS;
}
hipblasStatus_t FakeDescCreate(hipblasLtMatmulDesc_t* d, hipblasComputeType_t c, hipDataType st) {
  if (auto s = Enter("hipblasLtMatmulDescCreate", {{"compute_type", int64_t{c}}, {"scale_type", int64_t{st}}})) return s;
  auto obj = std::make_unique<Desc>();
  obj->compute = c;
  obj->scale_type = st;
  *d = reinterpret_cast<hipblasLtMatmulDesc_t>(obj.get());
  g->descs[obj.get()] = std::move(obj);
  Note("desc", P(*d));
  return HIPBLAS_STATUS_SUCCESS;
}
hipblasStatus_t FakeDescDestroy(hipblasLtMatmulDesc_t d) {
  if (auto s = Enter("hipblasLtMatmulDescDestroy", {{"desc", P(d)}})) return s;
  return g->descs.erase(d) ? HIPBLAS_STATUS_SUCCESS : HIPBLAS_STATUS_INVALID_VALUE;
}
hipblasStatus_t FakeDescSet(hipblasLtMatmulDesc_t d, hipblasLtMatmulDescAttributes_t a, const void* buf, size_t n) {
  std::vector<uint8_t> bytes(static_cast<const uint8_t*>(buf), static_cast<const uint8_t*>(buf) + n);
  if (auto s = Enter("hipblasLtMatmulDescSetAttribute",
                     {{"desc", P(d)}, {"attr", int64_t{a}}, {"size", static_cast<int64_t>(n)}, {"value", Decode(a, bytes, false)}}))
    return s;
  auto it = g->descs.find(d);
  if (it == g->descs.end()) return HIPBLAS_STATUS_INVALID_VALUE;
  if (g->cfg.model_mode_version && g->cfg.hipblaslt_version < 100300 && n == 4 &&
      (a == HIPBLASLT_MATMUL_DESC_A_SCALE_MODE || a == HIPBLASLT_MATMUL_DESC_B_SCALE_MODE)) {
    uint32_t mode;
    std::memcpy(&mode, buf, 4);
    if (mode == HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT) return HIPBLAS_STATUS_INVALID_VALUE;  // not in <= 1.2.x
  }
  it->second->attrs[a] = bytes;
  return HIPBLAS_STATUS_SUCCESS;
}
hipblasStatus_t FakeLayoutCreate(hipblasLtMatrixLayout_t* l, hipDataType t, uint64_t rows, uint64_t cols, int64_t ld) {
  if (auto s = Enter("hipblasLtMatrixLayoutCreate",
                     {{"type", int64_t{t}}, {"rows", static_cast<int64_t>(rows)}, {"cols", static_cast<int64_t>(cols)}, {"ld", ld}}))
    return s;
  auto obj = std::make_unique<Layout>(Layout{t, rows, cols, ld});
  *l = reinterpret_cast<hipblasLtMatrixLayout_t>(obj.get());
  g->layouts[obj.get()] = std::move(obj);
  Note("layout", P(*l));
  return HIPBLAS_STATUS_SUCCESS;
}
hipblasStatus_t FakeLayoutDestroy(hipblasLtMatrixLayout_t l) {
  if (auto s = Enter("hipblasLtMatrixLayoutDestroy", {{"layout", P(l)}})) return s;
  return g->layouts.erase(l) ? HIPBLAS_STATUS_SUCCESS : HIPBLAS_STATUS_INVALID_VALUE;
}
hipblasStatus_t FakePrefCreate(hipblasLtMatmulPreference_t* p) {
  if (auto s = Enter("hipblasLtMatmulPreferenceCreate", {})) return s;
  auto obj = std::make_unique<Pref>();
  *p = reinterpret_cast<hipblasLtMatmulPreference_t>(obj.get());
  g->prefs[obj.get()] = std::move(obj);
  Note("pref", P(*p));
  return HIPBLAS_STATUS_SUCCESS;
}
hipblasStatus_t FakePrefDestroy(hipblasLtMatmulPreference_t p) {
  if (auto s = Enter("hipblasLtMatmulPreferenceDestroy", {{"pref", P(p)}})) return s;
  return g->prefs.erase(p) ? HIPBLAS_STATUS_SUCCESS : HIPBLAS_STATUS_INVALID_VALUE;
}
hipblasStatus_t FakePrefSet(hipblasLtMatmulPreference_t p, hipblasLtMatmulPreferenceAttributes_t a, const void* buf, size_t n) {
  std::vector<uint8_t> bytes(static_cast<const uint8_t*>(buf), static_cast<const uint8_t*>(buf) + n);
  if (auto s = Enter("hipblasLtMatmulPreferenceSetAttribute",
                     {{"pref", P(p)}, {"attr", int64_t{a}}, {"size", static_cast<int64_t>(n)}, {"value", Decode(a, bytes, true)}}))
    return s;
  auto it = g->prefs.find(p);
  if (it == g->prefs.end()) return HIPBLAS_STATUS_INVALID_VALUE;
  it->second->attrs[a] = bytes;
  return HIPBLAS_STATUS_SUCCESS;
}

bool HasAttr(const Desc& d, uint32_t a) { return d.attrs.count(a) != 0; }
template <typename T>
T Attr(const Desc& d, uint32_t a) {
  T v{};
  auto it = d.attrs.find(a);
  if (it != d.attrs.end() && it->second.size() == sizeof(T)) std::memcpy(&v, it->second.data(), sizeof(T));
  return v;
}

constexpr uint8_t kAlgoTag = 0xA5;

hipblasStatus_t FakeHeuristic(hipblasLtHandle_t h, hipblasLtMatmulDesc_t d, hipblasLtMatrixLayout_t a,
                              hipblasLtMatrixLayout_t b, hipblasLtMatrixLayout_t c, hipblasLtMatrixLayout_t dd,
                              hipblasLtMatmulPreference_t p, int requested, hipblasLtMatmulHeuristicResult_t* results,
                              int* returned) {
  if (auto s = Enter("hipblasLtMatmulAlgoGetHeuristic",
                     {{"handle", P(h)}, {"desc", P(d)}, {"a", P(a)}, {"b", P(b)}, {"c", P(c)}, {"d", P(dd)},
                      {"pref", P(p)}, {"requested", int64_t{requested}}}))
    return s;
  if (!g->handles.count(h) || !g->descs.count(d) || !g->prefs.count(p) || !g->layouts.count(a) ||
      !g->layouts.count(b) || !g->layouts.count(c) || !g->layouts.count(dd))
    return HIPBLAS_STATUS_INVALID_VALUE;
  const Desc& desc = *g->descs[d];
  // What the scale state looked like when the heuristic ran (the §1.5 ordering rule).
  Note("a_scale_mode_set", int64_t{HasAttr(desc, HIPBLASLT_MATMUL_DESC_A_SCALE_MODE)});
  Note("b_scale_mode_set", int64_t{HasAttr(desc, HIPBLASLT_MATMUL_DESC_B_SCALE_MODE)});
  Note("a_scale_pointer", P(Attr<const void*>(desc, HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER)));
  Note("b_scale_pointer", P(Attr<const void*>(desc, HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER)));
  Handle& handle = *g->handles[h];
  const bool swizzled = Attr<uint32_t>(desc, HIPBLASLT_MATMUL_DESC_A_SCALE_MODE) ==
                        HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT;
  const bool tensilelite = HandleTensileLite(handle) || swizzled;
  int n = std::min(requested, g->cfg.heuristic_count);
  if (g->cfg.model_heuristic) {
    const Layout &la = *g->layouts[a], &lb = *g->layouts[b], &ld = *g->layouts[dd];
    const char* none = nullptr;
    if (ld.type == HIP_R_16F) none = "no FP4 kernel writes float16";
    else if (!Attr<const void*>(desc, HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER) ||
             !Attr<const void*>(desc, HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER)) none = "scale pointers not set";
    else if (!tensilelite && !RocrollerTileDivides(static_cast<int64_t>(la.cols), static_cast<int64_t>(lb.cols),
                                                   static_cast<int64_t>(la.rows))) none = "no rocRoller tile divides m, n, k";
    if (none != nullptr) {
      n = 0;
      Note("empty_because", std::string(none));
    }
  }
  for (int i = 0; i < n; ++i) {
    const uint64_t ws = g->cfg.workspace_size * (g->cfg.model_workspace_per_solution ? i + 1 : 1);
    results[i] = hipblasLtMatmulHeuristicResult_t{};
    std::memset(results[i].algo.data, kAlgoTag, sizeof(results[i].algo.data));
    results[i].algo.data[0] = static_cast<uint8_t>(i);
    results[i].algo.data[2] = tensilelite ? 1 : 0;  // the library that owns the solution index
    results[i].algo.max_workspace_bytes = ws;
    results[i].workspaceSize = ws;
    results[i].state = HIPBLAS_STATUS_SUCCESS;
    results[i].wavesCount = 1.0f;
    if (!tensilelite) handle.kernels.insert(i);  // rocRoller generates the kernel on this handle
  }
  *returned = n;
  Note("returned", int64_t{n});
  return HIPBLAS_STATUS_SUCCESS;
}

hipblasStatus_t FakeMatmul(hipblasLtHandle_t h, hipblasLtMatmulDesc_t d, const void* alpha, const void* A,
                           hipblasLtMatrixLayout_t a_desc, const void* B, hipblasLtMatrixLayout_t b_desc,
                           const void* beta, const void* C, hipblasLtMatrixLayout_t c_desc, void* D,
                           hipblasLtMatrixLayout_t d_desc, const hipblasLtMatmulAlgo_t* algo, void* ws,
                           size_t ws_size, hipStream_t stream) {
  const float al = alpha ? *static_cast<const float*>(alpha) : NAN;
  const float be = beta ? *static_cast<const float*>(beta) : NAN;
  if (auto s = Enter("hipblasLtMatmul",
                     {{"handle", P(h)}, {"desc", P(d)}, {"alpha", double{al}}, {"A", P(A)}, {"a_desc", P(a_desc)},
                      {"B", P(B)}, {"b_desc", P(b_desc)}, {"beta", double{be}}, {"C", P(C)}, {"c_desc", P(c_desc)},
                      {"D", P(D)}, {"d_desc", P(d_desc)}, {"algo_index", int64_t{algo ? algo->data[0] : -1}},
                      {"workspace", P(ws)}, {"workspace_size", static_cast<int64_t>(ws_size)}, {"stream", P(stream)}}))
    return s;
  auto reject = [](const char* why, hipblasStatus_t s) {
    Note("rejected", std::string(why));
    return s;
  };
  auto hi = g->handles.find(h);
  if (hi == g->handles.end()) return reject("unknown handle", HIPBLAS_STATUS_NOT_INITIALIZED);
  if (hi->second->device != g->cfg.current_device) return reject("handle used on another device", HIPBLAS_STATUS_INVALID_VALUE);
  // hipblaslt.h: a handle must not serve two streams while work may be in flight. The double
  // cannot see "in flight", so it holds every handle to the stream of its first matmul.
  if (hi->second->used && hi->second->stream != stream) return reject("handle shared by two streams", HIPBLAS_STATUS_INVALID_VALUE);
  hi->second->used = true;
  hi->second->stream = stream;
  if (!g->descs.count(d) || !g->layouts.count(a_desc) || !g->layouts.count(b_desc) || !g->layouts.count(c_desc) ||
      !g->layouts.count(d_desc))
    return reject("unknown descriptor", HIPBLAS_STATUS_INVALID_VALUE);
  const Desc& desc = *g->descs[d];
  const Layout &la = *g->layouts[a_desc], &lb = *g->layouts[b_desc], &lc = *g->layouts[c_desc], &ld = *g->layouts[d_desc];
  if (desc.compute != HIPBLAS_COMPUTE_32F || desc.scale_type != HIP_R_32F) return reject("compute/scale type", HIPBLAS_STATUS_NOT_SUPPORTED);
  if (Attr<int32_t>(desc, HIPBLASLT_MATMUL_DESC_TRANSA) != int32_t(HIPBLAS_OP_T) ||
      Attr<int32_t>(desc, HIPBLASLT_MATMUL_DESC_TRANSB) != int32_t(HIPBLAS_OP_N))
    return reject("MX needs opA = T, opB = N", HIPBLAS_STATUS_NOT_SUPPORTED);
  if (la.type != HIP_R_4F_E2M1 || lb.type != HIP_R_4F_E2M1) return reject("A/B type", HIPBLAS_STATUS_NOT_SUPPORTED);
  if (lc.type != ld.type || lc.rows != ld.rows || lc.cols != ld.cols || lc.ld != ld.ld) return reject("C != D layout", HIPBLAS_STATUS_INVALID_VALUE);
  ElemType out;
  if (ld.type == HIP_R_32F) out = ElemType::kF32;
  else if (ld.type == HIP_R_16BF) out = ElemType::kBF16;
  else if (ld.type == HIP_R_16F) out = ElemType::kF16;
  else return reject("D type", HIPBLAS_STATUS_NOT_SUPPORTED);
  const uint32_t mode_a = Attr<uint32_t>(desc, HIPBLASLT_MATMUL_DESC_A_SCALE_MODE);
  const uint32_t mode_b = Attr<uint32_t>(desc, HIPBLASLT_MATMUL_DESC_B_SCALE_MODE);
  if (mode_a != mode_b || (mode_a != HIPBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 &&
                           mode_a != HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT))
    return reject("scale modes", HIPBLAS_STATUS_NOT_SUPPORTED);
  if (!(al == 1.0f && be == 0.0f)) return reject("the double implements alpha = 1, beta = 0 only", HIPBLAS_STATUS_NOT_SUPPORTED);
  if (C == nullptr) return reject("C is null", HIPBLAS_STATUS_INVALID_VALUE);
  // op(A) = A^T is (m x K): A is stored (K x m) col-major; op(B) = B is (K x n); D is (m x n).
  const int64_t k = static_cast<int64_t>(la.rows), m = static_cast<int64_t>(la.cols), n = static_cast<int64_t>(lb.cols);
  if (static_cast<int64_t>(lb.rows) != k || static_cast<int64_t>(ld.rows) != m || static_cast<int64_t>(ld.cols) != n)
    return reject("inconsistent dims", HIPBLAS_STATUS_INVALID_VALUE);
  if (la.ld < k || lb.ld < k || ld.ld < m || la.ld % 2 || lb.ld % 2 || k % 32)
    return reject("leading dims", HIPBLAS_STATUS_INVALID_VALUE);
  if (algo == nullptr || algo->data[1] != kAlgoTag) return reject("algo not from the heuristic", HIPBLAS_STATUS_INVALID_VALUE);
  const bool handle_tensilelite = HandleTensileLite(*hi->second);
  const bool tensilelite = handle_tensilelite || mode_a == HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT;
  Note("provider", std::string(tensilelite ? "TensileLite" : "rocRoller"));
  // A solution index of rocRoller is not in a TensileLite handle's library (CHANGELOG 1.5.0 fixes a
  // crash on exactly that; earlier releases crash).
  if (g->cfg.model_route_at_create && algo->data[2] == 0 && handle_tensilelite)
    return reject("rocRoller algorithm on a TensileLite handle", HIPBLAS_STATUS_INVALID_VALUE);
  const uint64_t ws_needed = g->cfg.workspace_size * (g->cfg.model_workspace_per_solution ? algo->data[0] + 1 : 1);
  if (ws_size < ws_needed) return reject("workspace smaller than the algorithm needs", HIPBLAS_STATUS_INVALID_VALUE);
  if (g->cfg.model_kernel_per_handle && !tensilelite) {
    const bool compiled = hi->second->kernels.insert(algo->data[0]).second;
    Note("compiled_in_matmul", int64_t{compiled});
  }
  if (ws_size > 0 && (!Valid(ws, ws_size) || reinterpret_cast<uintptr_t>(ws) % 16))
    return reject("workspace not valid 16-byte aligned device memory", HIPBLAS_STATUS_INVALID_VALUE);
  const ScaleLayout given = mode_a == HIPBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 ? ScaleLayout::kPlain : ScaleLayout::kSwizzled;
  // A HostPreSwizzle TensileLite kernel is not told the scale mode: plain scales read as swizzled.
  const ScaleLayout layout = g->cfg.model_tensilelite_scales && tensilelite ? ScaleLayout::kSwizzled : given;
  Note("scales_read_as", std::string(layout == ScaleLayout::kPlain ? "plain" : "swizzled"));
  // rocRoller's descriptors are dense: it reads A and B with ld = K whatever ld says.
  const bool dense = g->cfg.model_rocroller_dense && !tensilelite;
  const int64_t lda = dense ? k : la.ld, ldb = dense ? k : lb.ld;
  const bool reads_c = !g->cfg.model_c_read || (!tensilelite && given == ScaleLayout::kPlain);
  GemmProblem p;
  p.batch = 1;
  p.m = n;  // ReferenceGemm computes out[n_idx][m_idx] = sum_k B(k, n_idx) A(k, m_idx)
  p.n = m;
  p.k = k;
  p.layout = layout;
  p.out_type = out;
  p.lhs_scale_rows = layout == ScaleLayout::kPlain ? n : RoundUp(n, 32);
  p.rhs_scale_rows = layout == ScaleLayout::kPlain ? m : RoundUp(m, 32);
  p.scale_cols = layout == ScaleLayout::kPlain ? k / 32 : RoundUp(k / 32, 8);
  const void* sa = Attr<const void*>(desc, HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER);
  const void* sb = Attr<const void*>(desc, HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER);
  const size_t elem = ElemTypeBytes(out);
  if (!Valid(A, (lda * (m - 1) + k) / 2)) return reject("A outside device memory", HIPBLAS_STATUS_INVALID_VALUE);
  if (!Valid(B, (ldb * (n - 1) + k) / 2)) return reject("B outside device memory", HIPBLAS_STATUS_INVALID_VALUE);
  if (!Valid(sa, p.rhs_scale_rows * p.scale_cols)) return reject("A scales outside device memory", HIPBLAS_STATUS_INVALID_VALUE);
  if (!Valid(sb, p.lhs_scale_rows * p.scale_cols)) return reject("B scales outside device memory", HIPBLAS_STATUS_INVALID_VALUE);
  if (!Valid(D, (ld.ld * (n - 1) + m) * elem)) return reject("D outside device memory", HIPBLAS_STATUS_INVALID_VALUE);
  if (!Valid(C, (lc.ld * (n - 1) + m) * elem)) return reject("C outside device memory", HIPBLAS_STATUS_INVALID_VALUE);
  // Like rocRoller's kernels, form beta * C even for beta = 0: a NaN/Inf in C makes D NaN there.
  std::vector<bool> c_poison(static_cast<size_t>(m * n), false);
  int64_t poisoned = 0;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      const uint8_t* e = static_cast<const uint8_t*>(C) + (j * lc.ld + i) * elem;
      bool bad = false;
      if (out == ElemType::kF32) {
        uint32_t v;
        std::memcpy(&v, e, 4);
        bad = (v & 0x7F800000u) == 0x7F800000u;
      } else {
        uint16_t v;
        std::memcpy(&v, e, 2);
        bad = out == ElemType::kBF16 ? (v & 0x7F80u) == 0x7F80u : (v & 0x7C00u) == 0x7C00u;
      }
      bad = bad && reads_c;
      c_poison[static_cast<size_t>(j * m + i)] = bad;
      poisoned += bad;
    }
  }
  Note("c_nonfinite", poisoned);
  Note("c_read", int64_t{reads_c});
  // Gather the strided columns into dense rows, compute, scatter into D with its ld.
  std::vector<uint8_t> a_dense(m * k / 2), b_dense(n * k / 2), d_dense(m * n * elem);
  for (int64_t i = 0; i < m; ++i) std::memcpy(&a_dense[i * k / 2], static_cast<const uint8_t*>(A) + i * lda / 2, k / 2);
  for (int64_t j = 0; j < n; ++j) std::memcpy(&b_dense[j * k / 2], static_cast<const uint8_t*>(B) + j * ldb / 2, k / 2);
  ReferenceGemm(p, b_dense.data(), static_cast<const uint8_t*>(sb), a_dense.data(), static_cast<const uint8_t*>(sa), d_dense.data());
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      uint8_t* e = &d_dense[(j * m + i) * elem];
      if (!c_poison[static_cast<size_t>(j * m + i)]) continue;
      const uint32_t nan32 = 0x7FC00000u;
      const uint16_t nan16 = out == ElemType::kBF16 ? 0x7FC0u : 0x7E00u;
      if (out == ElemType::kF32) std::memcpy(e, &nan32, 4);
      else std::memcpy(e, &nan16, 2);
    }
  }
  for (int64_t j = 0; j < n; ++j) std::memcpy(static_cast<uint8_t*>(D) + j * ld.ld * elem, &d_dense[j * m * elem], m * elem);
  return HIPBLAS_STATUS_SUCCESS;
}

}  // namespace

const HipblasltApi* Reset(const Config& config) {
  delete g;
  g = new State();
  g->cfg = config;
  HipblasltApi& api = g->api;
  api.hipGetDevice = FakeGetDevice;
  api.hipSetDevice = FakeSetDevice;
  api.hipGetDeviceCount = FakeGetDeviceCount;
  api.hipGetDevicePropertiesR0600 = FakeGetDeviceProps;
  api.hipDeviceGetAttribute = FakeDeviceGetAttribute;
  api.hipRuntimeGetVersion = FakeRuntimeGetVersion;
  api.hipMemsetAsync = FakeMemsetAsync;
  api.hipGetErrorString = FakeGetErrorString;
  api.hipblasLtCreate = FakeCreate;
  api.hipblasLtDestroy = FakeDestroy;
  api.hipblasLtGetVersion = FakeGetVersion;
  api.hipblasLtMatmulDescCreate = FakeDescCreate;
  api.hipblasLtMatmulDescDestroy = FakeDescDestroy;
  api.hipblasLtMatmulDescSetAttribute = FakeDescSet;
  api.hipblasLtMatrixLayoutCreate = FakeLayoutCreate;
  api.hipblasLtMatrixLayoutDestroy = FakeLayoutDestroy;
  api.hipblasLtMatmulPreferenceCreate = FakePrefCreate;
  api.hipblasLtMatmulPreferenceDestroy = FakePrefDestroy;
  api.hipblasLtMatmulPreferenceSetAttribute = FakePrefSet;
  api.hipblasLtMatmulAlgoGetHeuristic = FakeHeuristic;
  api.hipblasLtMatmul = FakeMatmul;
  return &g->api;
}

void RegisterMemory(const void* p, size_t bytes) {
  g->memory.push_back({reinterpret_cast<uintptr_t>(p), bytes});
}

const std::vector<Record>& Log() { return g->log; }

int LiveObjects() {
  return static_cast<int>(g->layouts.size() + g->descs.size() + g->prefs.size() + g->handles.size());
}

}  // namespace jax_mxfp4::fake
