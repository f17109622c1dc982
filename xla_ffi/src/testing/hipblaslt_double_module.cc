// Test-only nanobind module _hipblaslt_double: runs the hipBLASLt call path of hipblaslt_gemm.cc
// against the recording double (fake_hipblaslt.cc). Built by the same CMake project (option
// JAX_MXFP4_BUILD_TEST_DOUBLE) but never installed into the wheel, so a user's process never
// contains the double; tests load it from the build directory (tests/hipblaslt_double.py).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "fake_hipblaslt.h"
#include "jax_mxfp4/hipblaslt_gemm.h"

namespace nb = nanobind;
using namespace jax_mxfp4;

namespace {


using U8Array = nb::ndarray<nb::numpy, const uint8_t, nb::c_contig, nb::device::cpu>;

ElemType OutType(const std::string& name) {
  if (name == "float32") return ElemType::kF32;
  if (name == "bfloat16") return ElemType::kBF16;
  if (name == "float16") return ElemType::kF16;
  throw nb::value_error(("out_dtype must be float32, bfloat16 or float16, got " + name).c_str());
}

TensorView ViewOf(const U8Array& a, ElemType t = ElemType::kU8) {
  TensorView v;
  v.type = t;
  for (size_t i = 0; i < a.ndim(); ++i) v.dims.push_back(static_cast<int64_t>(a.shape(i)));
  v.data = const_cast<uint8_t*>(a.data());
  return v;
}

const char* CodeName(StatusCode c) {
  switch (c) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    default: return "INTERNAL";
  }
}

class HostWorkspace : public WorkspaceAllocator {
 public:
  void* Allocate(size_t bytes, size_t alignment) override {
    void* p = nullptr;
    if (posix_memalign(&p, alignment < sizeof(void*) ? sizeof(void*) : alignment, bytes) != 0) return nullptr;
    blocks_.emplace_back(p, &std::free);
    fake::RegisterMemory(p, bytes);
    sizes_.push_back({bytes, alignment});
    return p;
  }
  std::vector<std::unique_ptr<void, void (*)(void*)>> blocks_;
  std::vector<std::pair<size_t, size_t>> sizes_;
};

nb::object ToPython(const fake::Value& v) {
  if (auto* i = std::get_if<int64_t>(&v)) return nb::int_(*i);
  if (auto* d = std::get_if<double>(&v)) return nb::float_(*d);
  return nb::str(std::get<std::string>(v).c_str());
}

nb::list LogToPython() {
  nb::list log;
  for (const auto& r : fake::Log()) {
    nb::dict d;
    d["fn"] = r.fn;
    for (const auto& [k, v] : r.args) d[k.c_str()] = ToPython(v);
    log.append(d);
  }
  return log;
}

fake::Config ConfigFrom(const nb::dict& c) {
  fake::Config cfg;
  for (auto [key, value] : c) {
    const std::string k = nb::cast<std::string>(key);
    if (k == "arch") cfg.arch = nb::cast<std::string>(value);
    else if (k == "major") cfg.major = nb::cast<int>(value);
    else if (k == "minor") cfg.minor = nb::cast<int>(value);
    else if (k == "hipblaslt_version") cfg.hipblaslt_version = nb::cast<int>(value);
    else if (k == "hip_runtime_version") cfg.hip_runtime_version = nb::cast<int>(value);
    else if (k == "device_count") cfg.device_count = nb::cast<int>(value);
    else if (k == "current_device") cfg.current_device = nb::cast<int>(value);
    else if (k == "heuristic_count") cfg.heuristic_count = nb::cast<int>(value);
    else if (k == "workspace_size") cfg.workspace_size = nb::cast<uint64_t>(value);
    else if (k == "fail_fn") cfg.fail_fn = nb::cast<std::string>(value);
    else if (k == "fail_nth") cfg.fail_nth = nb::cast<int>(value);
    else if (k == "fail_status") cfg.fail_status = nb::cast<int>(value);
    else if (k == "rocroller_library") cfg.rocroller_library = nb::cast<bool>(value);
    else if (k == "model_heuristic") cfg.model_heuristic = nb::cast<bool>(value);
    else if (k == "model_tensilelite_scales") cfg.model_tensilelite_scales = nb::cast<bool>(value);
    else if (k == "model_rocroller_dense") cfg.model_rocroller_dense = nb::cast<bool>(value);
    else if (k == "model_route_at_create") cfg.model_route_at_create = nb::cast<bool>(value);
    else if (k == "model_mode_version") cfg.model_mode_version = nb::cast<bool>(value);
    else if (k == "model_workspace_per_solution") cfg.model_workspace_per_solution = nb::cast<bool>(value);
    else if (k == "model_c_read") cfg.model_c_read = nb::cast<bool>(value);
    else if (k == "model_kernel_per_handle") cfg.model_kernel_per_handle = nb::cast<bool>(value);
    else if (k == "out_fill") continue;  // read by FakeGemm
    else throw nb::value_error(("unknown fake config key " + k).c_str());
  }
  return cfg;
}

// Runs HipblasltRuntime::Gemm `calls` times over the recording double (fresh runtime, so the
// algorithm cache starts empty), call i on stream streams[i] (default 0x5EA0), then destroys the
// runtime (its handle pool) and returns {out: bytes, error, code, log, buffers, workspace,
// live_objects}. config["out_fill"] (default 0xEE) is the byte the output buffer starts with,
// as XLA hands it over uninitialised.
nb::dict FakeGemm(U8Array lhs, U8Array lhs_scales, U8Array rhs, U8Array rhs_scales,
                  const std::string& out_dtype, const std::string& scale_layout, nb::dict config,
                  int calls, int device, const std::vector<uint64_t>& streams) {
  const fake::Config cfg = ConfigFrom(config);
  const HipblasltApi* api = fake::Reset(cfg);
  const uint8_t fill = config.contains("out_fill") ? nb::cast<uint8_t>(config["out_fill"]) : uint8_t{0xEE};
  ScaleLayout layout;
  Status st = ParseScaleLayout(scale_layout, &layout);
  const ElemType out_type = OutType(out_dtype);
  GemmProblem p;
  std::vector<uint8_t> out;
  TensorView out_view;
  out_view.type = out_type;
  if (st.ok()) {
    // Output shape from the operands, then the shared validation of every buffer.
    const size_t r = lhs.ndim();
    if (r == 3) out_view.dims.push_back(static_cast<int64_t>(lhs.shape(0)));
    out_view.dims.push_back(r >= 2 ? static_cast<int64_t>(lhs.shape(r - 2)) : 0);
    out_view.dims.push_back(rhs.ndim() >= 2 ? static_cast<int64_t>(rhs.shape(rhs.ndim() - 2)) : 0);
    size_t count = ElemTypeBytes(out_type);
    for (int64_t d : out_view.dims) count *= static_cast<size_t>(d);
    out.assign(count + 1, fill);  // unwritten output is visible
    out.back() = 0xEE;            // sentinel byte past the end
    out_view.data = out.data();
    st = ValidateGemm(ViewOf(lhs), ViewOf(lhs_scales, ElemType::kE8M0), ViewOf(rhs),
                      ViewOf(rhs_scales, ElemType::kE8M0), out_view, layout,
                      {ElemType::kF32, ElemType::kBF16, ElemType::kF16}, &p);
  }
  nb::dict buffers;
  HostWorkspace ws;
  int live = 0;
  if (st.ok()) {
    for (const U8Array* a : {&lhs, &lhs_scales, &rhs, &rhs_scales}) fake::RegisterMemory(a->data(), a->size());
    fake::RegisterMemory(out.data(), out.size() - 1);
    buffers["lhs"] = reinterpret_cast<uintptr_t>(lhs.data());
    buffers["lhs_scales"] = reinterpret_cast<uintptr_t>(lhs_scales.data());
    buffers["rhs"] = reinterpret_cast<uintptr_t>(rhs.data());
    buffers["rhs_scales"] = reinterpret_cast<uintptr_t>(rhs_scales.data());
    buffers["out"] = reinterpret_cast<uintptr_t>(out.data());
    GemmBuffers b{lhs.data(), lhs_scales.data(), rhs.data(), rhs_scales.data(), out.data()};
    {
      HipblasltRuntime rt(api, cfg.rocroller_library);
      for (int i = 0; i < calls && st.ok(); ++i) {
        const uint64_t id = i < static_cast<int>(streams.size()) ? streams[i] : uint64_t{0x5EA0};
        st = rt.Gemm(p, b, reinterpret_cast<abi::hipStream_t>(static_cast<uintptr_t>(id)), device, &ws);
      }
      live = fake::LiveObjects();  // handles stay pooled here; descriptors must be gone
    }
  }
  nb::dict result;
  result["out"] = nb::bytes(reinterpret_cast<const char*>(out.data()), out.empty() ? 0 : out.size() - 1);
  result["sentinel_intact"] = out.empty() || out.back() == 0xEE;
  result["error"] = st.ok() ? nb::none() : nb::object(nb::str(st.message.c_str()));
  result["code"] = CodeName(st.code);
  result["log"] = LogToPython();
  result["buffers"] = buffers;
  nb::list wsl;
  for (auto [bytes, align] : ws.sizes_) wsl.append(nb::make_tuple(bytes, align));
  result["workspace"] = wsl;
  result["live_objects_before_teardown"] = live;
  result["live_objects_after_teardown"] = fake::LiveObjects();
  return result;
}

// TEST ONLY: drives the recording double directly with caller-chosen descriptors, to show that it
// refuses what hipBLASLt refuses and computes from what it is given (so the call-path tests can
// detect a wrong ld, operand order, transpose or scale pointer). Returns (status, out bytes).
nb::tuple FakeRawMatmul(U8Array a, U8Array b, U8Array a_scales, U8Array b_scales, int64_t k, int64_t m,
                        int64_t n, int64_t lda, int64_t ldb, int32_t trans_a, int32_t trans_b,
                        uint32_t mode, uint64_t workspace_given, uint64_t workspace_needed,
                        bool register_scales, nb::dict config) {
  fake::Config cfg = ConfigFrom(config);
  cfg.workspace_size = workspace_needed;
  const HipblasltApi* api = fake::Reset(cfg);
  std::vector<uint8_t> d(static_cast<size_t>(m * n * 4), 0);
  std::vector<uint8_t> ws(workspace_given + 16);
  void* ws_ptr = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 15) & ~uintptr_t{15});
  fake::RegisterMemory(a.data(), a.size());
  fake::RegisterMemory(b.data(), b.size());
  if (register_scales) {
    fake::RegisterMemory(a_scales.data(), a_scales.size());
    fake::RegisterMemory(b_scales.data(), b_scales.size());
  }
  fake::RegisterMemory(d.data(), d.size());
  fake::RegisterMemory(ws_ptr, workspace_given);
  abi::hipblasLtHandle_t h;
  abi::hipblasLtMatmulDesc_t desc;
  abi::hipblasLtMatrixLayout_t la, lb, lc;
  abi::hipblasLtMatmulPreference_t pref;
  api->hipblasLtCreate(&h);
  api->hipblasLtMatrixLayoutCreate(&la, abi::HIP_R_4F_E2M1, k, m, lda);
  api->hipblasLtMatrixLayoutCreate(&lb, abi::HIP_R_4F_E2M1, k, n, ldb);
  api->hipblasLtMatrixLayoutCreate(&lc, abi::HIP_R_32F, m, n, m);
  api->hipblasLtMatmulDescCreate(&desc, abi::HIPBLAS_COMPUTE_32F, abi::HIP_R_32F);
  const void* sa = a_scales.data();
  const void* sb = b_scales.data();
  api->hipblasLtMatmulDescSetAttribute(desc, abi::HIPBLASLT_MATMUL_DESC_TRANSA, &trans_a, 4);
  api->hipblasLtMatmulDescSetAttribute(desc, abi::HIPBLASLT_MATMUL_DESC_TRANSB, &trans_b, 4);
  api->hipblasLtMatmulDescSetAttribute(desc, abi::HIPBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, 4);
  api->hipblasLtMatmulDescSetAttribute(desc, abi::HIPBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, 4);
  api->hipblasLtMatmulDescSetAttribute(desc, abi::HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, 8);
  api->hipblasLtMatmulDescSetAttribute(desc, abi::HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, 8);
  api->hipblasLtMatmulPreferenceCreate(&pref);
  abi::hipblasLtMatmulHeuristicResult_t r[1] = {};
  int got = 0;
  api->hipblasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, r, &got);
  const float alpha = 1.0f, beta = 0.0f;
  abi::hipblasStatus_t st = api->hipblasLtMatmul(h, desc, &alpha, a.data(), la, b.data(), lb, &beta, d.data(), lc,
                                                 d.data(), lc, &r[0].algo, ws_ptr, workspace_given, nullptr);
  return nb::make_tuple(st, nb::bytes(reinterpret_cast<const char*>(d.data()), d.size()));
}


// A runtime kept across calls (FakeGemm makes a fresh one per call): the tests change
// HIPBLASLT_USE_ROCROLLER between GEMMs, as a user's process may. Only one double exists per
// process, so a LongRuntime is valid until the next LongRuntime, gemm or raw_matmul resets it.
class LongRuntime {
 public:
  explicit LongRuntime(nb::dict config) : cfg_(ConfigFrom(config)), api_(fake::Reset(cfg_)) {
    rt_ = std::make_unique<HipblasltRuntime>(api_, cfg_.rocroller_library);
  }
  // {array bytes, error, code}: out = lhs . rhs^T on `stream`, output starting as `out_fill` bytes.
  nb::dict Gemm(U8Array lhs, U8Array lhs_scales, U8Array rhs, U8Array rhs_scales, const std::string& out_dtype,
                const std::string& scale_layout, uint64_t stream, int device, uint8_t out_fill) {
    if (!rt_) throw nb::value_error("the runtime is closed");
    ScaleLayout layout;
    Status st = ParseScaleLayout(scale_layout, &layout);
    const ElemType out_type = OutType(out_dtype);
    TensorView out_view;
    out_view.type = out_type;
    out_view.dims = {static_cast<int64_t>(lhs.shape(0)), static_cast<int64_t>(rhs.shape(0))};
    auto out = std::make_shared<std::vector<uint8_t>>(
        static_cast<size_t>(out_view.dims[0] * out_view.dims[1]) * ElemTypeBytes(out_type), out_fill);
    out_view.data = out->data();
    GemmProblem p;
    if (st.ok()) {
      st = ValidateGemm(ViewOf(lhs), ViewOf(lhs_scales, ElemType::kE8M0), ViewOf(rhs),
                        ViewOf(rhs_scales, ElemType::kE8M0), out_view, layout,
                        {ElemType::kF32, ElemType::kBF16, ElemType::kF16}, &p);
    }
    if (st.ok()) {
      for (const U8Array* a : {&lhs, &lhs_scales, &rhs, &rhs_scales}) fake::RegisterMemory(a->data(), a->size());
      fake::RegisterMemory(out->data(), out->size());
      outputs_.push_back(out);  // registered memory stays valid while the runtime lives
      GemmBuffers b{lhs.data(), lhs_scales.data(), rhs.data(), rhs_scales.data(), out->data()};
      st = rt_->Gemm(p, b, reinterpret_cast<abi::hipStream_t>(static_cast<uintptr_t>(stream)), device, &ws_);
    }
    nb::dict r;
    r["out"] = nb::bytes(reinterpret_cast<const char*>(out->data()), out->size());
    r["error"] = st.ok() ? nb::none() : nb::object(nb::str(st.message.c_str()));
    r["code"] = CodeName(st.code);
    return r;
  }
  void Close() { rt_.reset(); }

 private:
  fake::Config cfg_;
  const HipblasltApi* api_;
  std::unique_ptr<HipblasltRuntime> rt_;
  HostWorkspace ws_;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> outputs_;
};

}  // namespace

NB_MODULE(_hipblaslt_double, m) {
  m.doc() = "TEST ONLY: the hipBLASLt call path against a recording double (never shipped)";
  m.def("raw_matmul", &FakeRawMatmul, nb::arg("a"), nb::arg("b"), nb::arg("a_scales"), nb::arg("b_scales"),
        nb::arg("k"), nb::arg("m"), nb::arg("n"), nb::arg("lda"), nb::arg("ldb"), nb::arg("trans_a"),
        nb::arg("trans_b"), nb::arg("mode"), nb::arg("workspace_given"), nb::arg("workspace_needed"),
        nb::arg("register_scales"), nb::arg("config") = nb::dict(), "The recording double driven directly.");
  nb::class_<LongRuntime>(m, "LongRuntime", "One HipblasltRuntime over the double across several GEMMs; the "
                                    "test changes the environment between them.")
      .def(nb::init<nb::dict>(), nb::arg("config"))
      .def("gemm", &LongRuntime::Gemm, nb::arg("lhs"), nb::arg("lhs_scales"), nb::arg("rhs"), nb::arg("rhs_scales"),
           nb::arg("out_dtype"), nb::arg("scale_layout"), nb::arg("stream") = uint64_t{0x5EA0},
           nb::arg("device") = 0, nb::arg("out_fill") = uint8_t{0xEE})
      .def("log", [](LongRuntime&) { return LogToPython(); })
      .def("close", &LongRuntime::Close);
  m.def("gemm", &FakeGemm, nb::arg("lhs"), nb::arg("lhs_scales"), nb::arg("rhs"), nb::arg("rhs_scales"),
        nb::arg("out_dtype"), nb::arg("scale_layout"), nb::arg("config"), nb::arg("calls") = 1,
        nb::arg("device") = 0, nb::arg("streams") = std::vector<uint64_t>{},
        "HipblasltRuntime::Gemm over the recording double.");
  m.def("route", [](bool rocroller_library) {
    Route r = HipblasltRoute(rocroller_library);
    return nb::make_tuple(r.tensilelite, r.why);
  }, nb::arg("rocroller_library"), "HipblasltRoute as the handler computes it.");
}
