// nanobind module jax_mxfp4._native: XLA FFI handler capsules, the hipBLASLt status probe, the
// hipBLASLt envelope check and the declared ABI values. The recording test double is NOT here: it
// lives in the test-only module _hipblaslt_double (src/testing/), which the wheel never ships.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "handlers.h"
#include "jax_mxfp4/hipblaslt_gemm.h"

namespace nb = nanobind;
using namespace jax_mxfp4;

namespace {

ElemType OutType(const std::string& name) {
  if (name == "float32") return ElemType::kF32;
  if (name == "bfloat16") return ElemType::kBF16;
  if (name == "float16") return ElemType::kF16;
  throw nb::value_error(("out_dtype must be float32, bfloat16 or float16, got " + name).c_str());
}

nb::dict HipblasltStatus(bool query_devices) {
  nb::dict d;
  const LoadResult& lib = LoadHipblaslt();
  d["loaded"] = lib.api != nullptr;
  d["error"] = lib.error;
  d["hip_path"] = lib.hip_path;
  d["hipblaslt_path"] = lib.hipblaslt_path;
  d["searched"] = lib.searched;
  d["rocroller_path"] = lib.rocroller_path;
  Envelope envelope;
  Status env_st = ReadEnvelope(&envelope);
  d["envelope"] = env_st.ok() ? (envelope == Envelope::kValidated ? "validated" : "documented") : env_st.message;
  nb::list devices;
  if (lib.api != nullptr && query_devices) {
    HipblasltRuntime& rt = ProcessHipblasltRuntime(lib.api);
    int count = 0;
    Status st = rt.DeviceCount(&count);
    if (!st.ok()) d["error"] = st.message;
    for (int i = 0; st.ok() && i < count; ++i) {
      DeviceInfo info;
      Status s = rt.GetDeviceInfo(i, &info);
      nb::dict dev;
      dev["ordinal"] = i;
      dev["error"] = s.ok() ? std::string() : s.message;
      dev["arch"] = info.arch;
      dev["hipblaslt_version"] = info.hipblaslt_version;
      dev["hip_runtime_version"] = info.hip_runtime_version;
      dev["route"] = rt.CurrentRoute().why;
      devices.append(dev);
    }
  }
  d["devices"] = devices;
  return d;
}

// The envelope value comes from the caller (Python's os.environ, the same value the rest of the
// package reads).
nb::tuple HipblasltCheckShape(int64_t m, int64_t n, int64_t k, const std::string& out_dtype,
                              const std::string& envelope_value) {
  Envelope envelope;
  Status st = ParseEnvelope(envelope_value, &envelope);
  if (st.ok()) st = CheckHipblasltShape(m, n, k, OutType(out_dtype), envelope);
  return nb::make_tuple(st.ok(), st.message);
}

nb::tuple HipblasltFindAlgorithm(int device, int64_t m, int64_t n, int64_t k,
                                 const std::string& out_dtype, const std::string& scale_layout) {
  const LoadResult& lib = LoadHipblaslt();
  if (lib.api == nullptr) return nb::make_tuple(false, lib.error);
  ScaleLayout layout;
  Status st = ParseScaleLayout(scale_layout, &layout);
  if (st.ok()) st = ProcessHipblasltRuntime(lib.api).FindAlgorithm(device, m, n, k, OutType(out_dtype), layout);
  return nb::make_tuple(st.ok(), st.message);
}

// Every value and size declared in hipblaslt_api.h, for the test that compares them with the
// ABI reference file.
nb::dict AbiConstants() {
  nb::dict d;
#define JAX_MXFP4_PUT(name) d[#name] = static_cast<long long>(abi::name);
  JAX_MXFP4_PUT(HIP_R_32F) JAX_MXFP4_PUT(HIP_R_16F) JAX_MXFP4_PUT(HIP_R_16BF)
  JAX_MXFP4_PUT(HIP_R_8F_UE8M0) JAX_MXFP4_PUT(HIP_R_4F_E2M1)
  JAX_MXFP4_PUT(HIPBLAS_STATUS_SUCCESS) JAX_MXFP4_PUT(HIPBLAS_STATUS_NOT_INITIALIZED)
  JAX_MXFP4_PUT(HIPBLAS_STATUS_ALLOC_FAILED) JAX_MXFP4_PUT(HIPBLAS_STATUS_INVALID_VALUE)
  JAX_MXFP4_PUT(HIPBLAS_STATUS_MAPPING_ERROR) JAX_MXFP4_PUT(HIPBLAS_STATUS_EXECUTION_FAILED)
  JAX_MXFP4_PUT(HIPBLAS_STATUS_INTERNAL_ERROR) JAX_MXFP4_PUT(HIPBLAS_STATUS_NOT_SUPPORTED)
  JAX_MXFP4_PUT(HIPBLAS_STATUS_ARCH_MISMATCH) JAX_MXFP4_PUT(HIPBLAS_STATUS_HANDLE_IS_NULLPTR)
  JAX_MXFP4_PUT(HIPBLAS_STATUS_INVALID_ENUM) JAX_MXFP4_PUT(HIPBLAS_STATUS_UNKNOWN)
  JAX_MXFP4_PUT(HIPBLAS_OP_N) JAX_MXFP4_PUT(HIPBLAS_OP_T) JAX_MXFP4_PUT(HIPBLAS_COMPUTE_32F)
  JAX_MXFP4_PUT(HIPBLASLT_MATMUL_DESC_TRANSA) JAX_MXFP4_PUT(HIPBLASLT_MATMUL_DESC_TRANSB)
  JAX_MXFP4_PUT(HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER) JAX_MXFP4_PUT(HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER)
  JAX_MXFP4_PUT(HIPBLASLT_MATMUL_DESC_A_SCALE_MODE) JAX_MXFP4_PUT(HIPBLASLT_MATMUL_DESC_B_SCALE_MODE)
  JAX_MXFP4_PUT(HIPBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0)
  JAX_MXFP4_PUT(HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT)
  JAX_MXFP4_PUT(HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
  JAX_MXFP4_PUT(hipSuccess) JAX_MXFP4_PUT(hipDeviceAttributeComputeCapabilityMajor)
  JAX_MXFP4_PUT(hipDeviceAttributeComputeCapabilityMinor)
#undef JAX_MXFP4_PUT
  d["sizeof(hipblasLtMatmulAlgo_t)"] = sizeof(abi::hipblasLtMatmulAlgo_t);
  d["sizeof(hipblasLtMatmulHeuristicResult_t)"] = sizeof(abi::hipblasLtMatmulHeuristicResult_t);
  d["sizeof(hipDeviceProp_tR0600)"] = abi::kDevicePropR0600Size;
  d["offsetof(hipDeviceProp_tR0600, gcnArchName)"] = abi::kDevicePropGcnArchNameOffset;
  d["offsetof(hipDeviceProp_tR0600, major)"] = abi::kDevicePropMajorOffset;
  d["offsetof(hipDeviceProp_tR0600, minor)"] = abi::kDevicePropMinorOffset;
  d["offsetof(hipblasLtMatmulHeuristicResult_t, workspaceSize)"] = offsetof(abi::hipblasLtMatmulHeuristicResult_t, workspaceSize);
  d["offsetof(hipblasLtMatmulHeuristicResult_t, state)"] = offsetof(abi::hipblasLtMatmulHeuristicResult_t, state);
  nb::list symbols;
#define JAX_MXFP4_SYMBOL(ret, name, params) symbols.append(#name);
  JAX_MXFP4_HIP_FUNCTIONS(JAX_MXFP4_SYMBOL)
  JAX_MXFP4_HIPBLASLT_FUNCTIONS(JAX_MXFP4_SYMBOL)
#undef JAX_MXFP4_SYMBOL
  d["symbols"] = symbols;
  return d;
}

}  // namespace

NB_MODULE(_native, m) {
  m.def("abi_constants", &AbiConstants, "Every value, size and symbol declared in hipblaslt_api.h.");
  m.doc() = "jax-mxfp4 native XLA FFI handlers (CPU reference, hipBLASLt via dlopen)";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_mxfp4_gemm_cpu"] = nb::make_tuple("cpu", nb::capsule(reinterpret_cast<void*>(&JaxMxfp4GemmCpu)));
    d["jax_mxfp4_gemm_hipblaslt"] =
        nb::make_tuple("ROCM", nb::capsule(reinterpret_cast<void*>(&JaxMxfp4GemmHipblaslt)));
    return d;
  }, "{target name: (XLA FFI platform, handler capsule)}");
  m.def("hipblaslt_status", &HipblasltStatus, nb::arg("query_devices") = true,
        "Loads libamdhip64/libhipblaslt (once) and reports paths, errors and per-device arch/version.");
  m.def("hipblaslt_find_algorithm", &HipblasltFindAlgorithm, nb::arg("device"), nb::arg("m"),
        nb::arg("n"), nb::arg("k"), nb::arg("out_dtype"), nb::arg("scale_layout"),
        "Gates + hipBLASLt heuristic for one GEMM shape: (ok, reason).");
  m.def("hipblaslt_check_shape", &HipblasltCheckShape, nb::arg("m"), nb::arg("n"), nb::arg("k"),
        nb::arg("out_dtype"), nb::arg("envelope"),
        "The envelope's shape/dtype rules for the value of $JAX_MXFP4_HIPBLASLT_ENVELOPE given: (ok, reason). "
        "No library needed.");
  m.def("set_wheel_library_dirs", [](const std::vector<std::string>& dirs) { return SetWheelLibraryDirs(dirs); },
        nb::arg("dirs"), "Pip-installed ROCm lib dirs to search (before the first load): True if taken.");
  m.attr("HIPBLASLT_MAX_WORKSPACE_BYTES") = kMaxWorkspaceBytes;
  m.attr("HIPBLASLT_REQUESTED_ALGOS") = kRequestedAlgos;
}
