// The subset of the hipBLASLt and HIP runtime C ABI that jax_mxfp4 uses, declared here so the
// extension builds with no ROCm SDK and loads the libraries with dlopen on first use.
//
// Every value below is taken from the public headers: hipblaslt.h in
// ROCm/rocm-libraries projects/hipblaslt/library/include/hipblaslt/hipblaslt.h and the ROCm
// 7.0.2-7.2.3 release headers; hipblas-common.h from ROCm/hipBLAS-common; hip/library_types.h,
// hip/hip_runtime_api.h and hip/driver_types.h from ROCm/HIP / rocm-systems). Where ROCm is
// installed, configure with -DJAX_MXFP4_CHECK_ROCM_HEADERS=ON to compile check/rocm_abi_check.cc,
// which static_asserts every value, size and offset here against the real headers.
//
// Enum-typed parameters are declared as 4-byte integers: the C enums involved have no negative
// enumerators, so GCC/Clang give them an unsigned int underlying type, passed like uint32_t in
// the System V AMD64 ABI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_mxfp4::abi {

// ---- hip/library_types.h: hipDataType
using hipDataType = uint32_t;
inline constexpr hipDataType HIP_R_32F = 0;
inline constexpr hipDataType HIP_R_16F = 2;
inline constexpr hipDataType HIP_R_16BF = 14;
inline constexpr hipDataType HIP_R_8F_UE8M0 = 30;  // ROCm 7.0+
inline constexpr hipDataType HIP_R_4F_E2M1 = 33;   // ROCm 7.0+ (hipBLASLt: HIP_R_4F_E2M1_EXT)

// ---- hipblas-common.h
using hipblasStatus_t = uint32_t;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_SUCCESS = 0;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_NOT_INITIALIZED = 1;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_ALLOC_FAILED = 2;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_INVALID_VALUE = 3;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_MAPPING_ERROR = 4;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_EXECUTION_FAILED = 5;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_INTERNAL_ERROR = 6;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_NOT_SUPPORTED = 7;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_ARCH_MISMATCH = 8;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_HANDLE_IS_NULLPTR = 9;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_INVALID_ENUM = 10;
inline constexpr hipblasStatus_t HIPBLAS_STATUS_UNKNOWN = 11;

using hipblasOperation_t = uint32_t;
inline constexpr hipblasOperation_t HIPBLAS_OP_N = 111;  // not cuBLAS's 0/1/2
inline constexpr hipblasOperation_t HIPBLAS_OP_T = 112;

using hipblasComputeType_t = uint32_t;
inline constexpr hipblasComputeType_t HIPBLAS_COMPUTE_32F = 2;

// ---- hipblaslt.h enums
using hipblasLtMatmulDescAttributes_t = uint32_t;
inline constexpr hipblasLtMatmulDescAttributes_t HIPBLASLT_MATMUL_DESC_TRANSA = 0;   // int32_t
inline constexpr hipblasLtMatmulDescAttributes_t HIPBLASLT_MATMUL_DESC_TRANSB = 1;   // int32_t
inline constexpr hipblasLtMatmulDescAttributes_t HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER = 5;  // void*
inline constexpr hipblasLtMatmulDescAttributes_t HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER = 6;  // void*
inline constexpr hipblasLtMatmulDescAttributes_t HIPBLASLT_MATMUL_DESC_A_SCALE_MODE = 31;  // 7.0+
inline constexpr hipblasLtMatmulDescAttributes_t HIPBLASLT_MATMUL_DESC_B_SCALE_MODE = 32;  // 7.0+

using hipblasLtMatmulMatrixScale_t = uint32_t;
inline constexpr hipblasLtMatmulMatrixScale_t HIPBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 = 2;
// Pre-swizzled 32x8 scales. Absent from the ROCm 7.0-7.2 headers (present in rocm-libraries
// develop, CHANGELOG 1.2.0/1.3.0): gated at run time on hipblasLtGetVersion >= 1.3.0.
inline constexpr hipblasLtMatmulMatrixScale_t HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT = 1001;

using hipblasLtMatmulPreferenceAttributes_t = uint32_t;
inline constexpr hipblasLtMatmulPreferenceAttributes_t HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1;  // uint64_t

// ---- hipblaslt.h structs (x86-64 layouts from the ABI file, computed there with g++)
struct hipblasLtMatmulAlgo_t {
  uint8_t data[16];
  size_t max_workspace_bytes;
};
static_assert(sizeof(hipblasLtMatmulAlgo_t) == 24, "hipblasLtMatmulAlgo_t must be 24 bytes");
static_assert(offsetof(hipblasLtMatmulAlgo_t, max_workspace_bytes) == 16, "algo layout");

struct hipblasLtMatmulHeuristicResult_t {
  hipblasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  hipblasStatus_t state;
  float wavesCount;
  int reserved[4];
};
static_assert(sizeof(hipblasLtMatmulHeuristicResult_t) == 56, "heuristic result must be 56 bytes");
static_assert(offsetof(hipblasLtMatmulHeuristicResult_t, workspaceSize) == 24, "layout");
static_assert(offsetof(hipblasLtMatmulHeuristicResult_t, state) == 32, "layout");
static_assert(offsetof(hipblasLtMatmulHeuristicResult_t, wavesCount) == 36, "layout");
static_assert(offsetof(hipblasLtMatmulHeuristicResult_t, reserved) == 40, "layout");

// Semi-opaque descriptors: the library allocates them; we only hold pointers.
struct hipblasLtMatmulDescOpaque_t { uint64_t data[4]; };
struct hipblasLtMatrixLayoutOpaque_t { uint64_t data[4]; };
struct hipblasLtMatmulPreferenceOpaque_t { uint64_t data[5]; };
static_assert(sizeof(hipblasLtMatmulDescOpaque_t) == 32 && sizeof(hipblasLtMatrixLayoutOpaque_t) == 32 &&
              sizeof(hipblasLtMatmulPreferenceOpaque_t) == 40, "descriptor sizes");
using hipblasLtHandle_t = void*;
using hipblasLtMatmulDesc_t = hipblasLtMatmulDescOpaque_t*;
using hipblasLtMatrixLayout_t = hipblasLtMatrixLayoutOpaque_t*;
using hipblasLtMatmulPreference_t = hipblasLtMatmulPreferenceOpaque_t*;

// ---- HIP runtime (hip_runtime_api.h, driver_types.h)
using hipError_t = uint32_t;
inline constexpr hipError_t hipSuccess = 0;
struct ihipStream_t;
using hipStream_t = ihipStream_t*;
using hipDeviceAttribute_t = uint32_t;
inline constexpr hipDeviceAttribute_t hipDeviceAttributeComputeCapabilityMajor = 23;
inline constexpr hipDeviceAttribute_t hipDeviceAttributeComputeCapabilityMinor = 61;

// hipDeviceProp_tR0600 (filled by the exported symbol hipGetDevicePropertiesR0600; the plain
// symbol hipGetDeviceProperties is the legacy R0000 layout and is never loaded). We read only
// gcnArchName; the buffer passed is larger than the struct for headroom.
inline constexpr size_t kDevicePropR0600Size = 1472;
inline constexpr size_t kDevicePropGcnArchNameOffset = 1160;
inline constexpr size_t kDevicePropGcnArchNameSize = 256;
inline constexpr size_t kDevicePropMajorOffset = 360;
inline constexpr size_t kDevicePropMinorOffset = 364;
struct alignas(8) DevicePropR0600View {
  char head[kDevicePropMajorOffset];
  int major;
  int minor;
  char middle[kDevicePropGcnArchNameOffset - kDevicePropMinorOffset - sizeof(int)];
  char gcnArchName[kDevicePropGcnArchNameSize];
  char tail[kDevicePropR0600Size - kDevicePropGcnArchNameOffset - kDevicePropGcnArchNameSize];
};
static_assert(sizeof(DevicePropR0600View) == 1472, "hipDeviceProp_tR0600 must be 1472 bytes");
static_assert(offsetof(DevicePropR0600View, gcnArchName) == 1160, "gcnArchName offset");
static_assert(offsetof(DevicePropR0600View, major) == 360 && offsetof(DevicePropR0600View, minor) == 364,
              "major/minor offsets");

// ---- The function table. X(return type, symbol, parameter list). Symbols are dlsym'd by name.
#define JAX_MXFP4_HIP_FUNCTIONS(X)                                                              \
  X(hipError_t, hipGetDevice, (int* device))                                                   \
  X(hipError_t, hipSetDevice, (int device))                                                    \
  X(hipError_t, hipGetDeviceCount, (int* count))                                               \
  X(hipError_t, hipGetDevicePropertiesR0600, (void* prop, int device))                         \
  X(hipError_t, hipDeviceGetAttribute, (int* value, hipDeviceAttribute_t attr, int device))    \
  X(hipError_t, hipRuntimeGetVersion, (int* version))                                          \
  X(hipError_t, hipMemsetAsync, (void* dst, int value, size_t size_bytes, hipStream_t stream)) \
  X(const char*, hipGetErrorString, (hipError_t error))

#define JAX_MXFP4_HIPBLASLT_FUNCTIONS(X)                                                        \
  X(hipblasStatus_t, hipblasLtCreate, (hipblasLtHandle_t * handle))                            \
  X(hipblasStatus_t, hipblasLtDestroy, (hipblasLtHandle_t handle))                             \
  X(hipblasStatus_t, hipblasLtGetVersion, (hipblasLtHandle_t handle, int* version))            \
  X(hipblasStatus_t, hipblasLtMatmulDescCreate,                                                \
    (hipblasLtMatmulDesc_t * desc, hipblasComputeType_t compute_type, hipDataType scale_type)) \
  X(hipblasStatus_t, hipblasLtMatmulDescDestroy, (hipblasLtMatmulDesc_t desc))                 \
  X(hipblasStatus_t, hipblasLtMatmulDescSetAttribute,                                          \
    (hipblasLtMatmulDesc_t desc, hipblasLtMatmulDescAttributes_t attr, const void* buf,        \
     size_t size_in_bytes))                                                                    \
  X(hipblasStatus_t, hipblasLtMatrixLayoutCreate,                                              \
    (hipblasLtMatrixLayout_t * layout, hipDataType type, uint64_t rows, uint64_t cols,         \
     int64_t ld))                                                                              \
  X(hipblasStatus_t, hipblasLtMatrixLayoutDestroy, (hipblasLtMatrixLayout_t layout))           \
  X(hipblasStatus_t, hipblasLtMatmulPreferenceCreate, (hipblasLtMatmulPreference_t * pref))    \
  X(hipblasStatus_t, hipblasLtMatmulPreferenceDestroy, (hipblasLtMatmulPreference_t pref))     \
  X(hipblasStatus_t, hipblasLtMatmulPreferenceSetAttribute,                                    \
    (hipblasLtMatmulPreference_t pref, hipblasLtMatmulPreferenceAttributes_t attr,             \
     const void* buf, size_t size_in_bytes))                                                   \
  X(hipblasStatus_t, hipblasLtMatmulAlgoGetHeuristic,                                          \
    (hipblasLtHandle_t handle, hipblasLtMatmulDesc_t desc, hipblasLtMatrixLayout_t a_desc,     \
     hipblasLtMatrixLayout_t b_desc, hipblasLtMatrixLayout_t c_desc,                           \
     hipblasLtMatrixLayout_t d_desc, hipblasLtMatmulPreference_t pref, int requested,          \
     hipblasLtMatmulHeuristicResult_t* results, int* returned))                                \
  X(hipblasStatus_t, hipblasLtMatmul,                                                          \
    (hipblasLtHandle_t handle, hipblasLtMatmulDesc_t desc, const void* alpha, const void* a,   \
     hipblasLtMatrixLayout_t a_desc, const void* b, hipblasLtMatrixLayout_t b_desc,            \
     const void* beta, const void* c, hipblasLtMatrixLayout_t c_desc, void* d,                 \
     hipblasLtMatrixLayout_t d_desc, const hipblasLtMatmulAlgo_t* algo, void* workspace,       \
     size_t workspace_size_in_bytes, hipStream_t stream))

#define JAX_MXFP4_DECLARE_PFN(ret, name, params) using PFN_##name = ret(*) params;
JAX_MXFP4_HIP_FUNCTIONS(JAX_MXFP4_DECLARE_PFN)
JAX_MXFP4_HIPBLASLT_FUNCTIONS(JAX_MXFP4_DECLARE_PFN)
#undef JAX_MXFP4_DECLARE_PFN

}  // namespace jax_mxfp4::abi

namespace jax_mxfp4 {

// The loaded API: one function pointer per symbol above. The GEMM call path takes this table as
// a parameter, so tests pass a recording double instead of the real libraries.
struct HipblasltApi {
#define JAX_MXFP4_API_FIELD(ret, name, params) abi::PFN_##name name = nullptr;
  JAX_MXFP4_HIP_FUNCTIONS(JAX_MXFP4_API_FIELD)
  JAX_MXFP4_HIPBLASLT_FUNCTIONS(JAX_MXFP4_API_FIELD)
#undef JAX_MXFP4_API_FIELD
};

// Name of a hipblasStatus_t value ("HIPBLAS_STATUS_INVALID_VALUE"), or "UNKNOWN_STATUS".
const char* HipblasStatusName(abi::hipblasStatus_t s);

// Result of loading the real libraries (once per process; thread-safe).
struct LoadResult {
  const HipblasltApi* api = nullptr;  // null when loading failed
  std::string error;                  // why, when api is null
  std::string hip_path;               // the files actually loaded (from dladdr)
  std::string hipblaslt_path;
  std::string searched;               // every candidate tried, in order
  // librocroller* among libhipblaslt's own DT_NEEDED entries (hipBLASLt builds with rocRoller
  // link it): its loaded path, else that name; empty if it needs none. Tells the internal MX route.
  std::string rocroller_path;
};

// Loads libamdhip64 and libhipblaslt with dlopen. Search order, for each library:
//   1. $JAX_MXFP4_ROCM_LIB_DIR only, if set (no other location is tried);
//   2. a copy already loaded in the process (e.g. by the JAX ROCm plugin), versioned soname;
//   3. for libhipblaslt, when libamdhip64 did not come from a step-4 directory: the directory
//      libamdhip64 was loaded from (one ROCm installation for both);
//   4. the pip-installed ROCm directories given to SetWheelLibraryDirs (TheRock wheels:
//      _rocm_sdk_core/lib holds libamdhip64, _rocm_sdk_libraries*/lib holds libhipblaslt);
//   5. the dynamic linker's search (LD_LIBRARY_PATH, RUNPATH, ld.so.cache) by soname;
//   6. $ROCM_PATH/lib, then /opt/rocm/lib.
// In each location the versioned sonames (libamdhip64.so.7, libhipblaslt.so.1) are tried before
// the unversioned names. Never fails the process: errors are returned in LoadResult::error.
const LoadResult& LoadHipblaslt();

// The directories of step 3 above (found by the Python side through importlib.metadata). Takes
// effect only before the first LoadHipblaslt(); returns false (and changes nothing) after it.
bool SetWheelLibraryDirs(const std::vector<std::string>& dirs);

}  // namespace jax_mxfp4
