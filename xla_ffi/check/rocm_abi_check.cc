// Compile-time check of include/jax_mxfp4/hipblaslt_api.h against the real ROCm headers.
// Built only with -DJAX_MXFP4_CHECK_ROCM_HEADERS=ON (needs ROCm >= 7.0 installed); compiling this
// file is the check: every static_assert compares one declared value, size, offset or function
// signature (arity and per-parameter size) with the installed headers' definition.
#include <hip/hip_runtime_api.h>
#include <hip/library_types.h>
#include <hipblaslt/hipblaslt.h>

#include <cstddef>
#include <type_traits>

#include "jax_mxfp4/hipblaslt_api.h"

namespace abi = jax_mxfp4::abi;

#define JAX_MXFP4_SAME_VALUE(name)                                                        \
  static_assert(static_cast<long long>(::name) == static_cast<long long>(abi::name),      \
                #name " differs from the installed ROCm headers")

// hipDataType
JAX_MXFP4_SAME_VALUE(HIP_R_32F);
JAX_MXFP4_SAME_VALUE(HIP_R_16F);
JAX_MXFP4_SAME_VALUE(HIP_R_16BF);
JAX_MXFP4_SAME_VALUE(HIP_R_8F_UE8M0);
JAX_MXFP4_SAME_VALUE(HIP_R_4F_E2M1);
// hipblas-common.h
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_SUCCESS);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_NOT_INITIALIZED);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_ALLOC_FAILED);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_INVALID_VALUE);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_MAPPING_ERROR);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_EXECUTION_FAILED);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_INTERNAL_ERROR);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_NOT_SUPPORTED);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_ARCH_MISMATCH);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_HANDLE_IS_NULLPTR);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_INVALID_ENUM);
JAX_MXFP4_SAME_VALUE(HIPBLAS_STATUS_UNKNOWN);
JAX_MXFP4_SAME_VALUE(HIPBLAS_OP_N);
JAX_MXFP4_SAME_VALUE(HIPBLAS_OP_T);
JAX_MXFP4_SAME_VALUE(HIPBLAS_COMPUTE_32F);
// hipblaslt.h
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_DESC_TRANSA);
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_DESC_TRANSB);
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER);
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER);
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_DESC_A_SCALE_MODE);
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_DESC_B_SCALE_MODE);
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0);
#if (HIPBLASLT_VERSION_MAJOR * 100 + HIPBLASLT_VERSION_MINOR) >= 103
// Absent from the ROCm 7.0-7.2 headers (hipblaslt-abi.md §7); the run-time gate is >= 1.3.0.
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT);
#endif
JAX_MXFP4_SAME_VALUE(HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
// HIP runtime
JAX_MXFP4_SAME_VALUE(hipSuccess);
JAX_MXFP4_SAME_VALUE(hipDeviceAttributeComputeCapabilityMajor);
JAX_MXFP4_SAME_VALUE(hipDeviceAttributeComputeCapabilityMinor);

// Enum types are passed as 4-byte unsigned integers.
template <typename E>
constexpr bool FourByteUnsigned() {
  if constexpr (std::is_enum_v<E>) {
    return sizeof(E) == 4 && std::is_unsigned_v<std::underlying_type_t<E>>;
  } else {
    return sizeof(E) == 4;
  }
}
static_assert(FourByteUnsigned<::hipDataType>(), "hipDataType");
static_assert(FourByteUnsigned<::hipblasStatus_t>(), "hipblasStatus_t");
static_assert(FourByteUnsigned<::hipblasOperation_t>(), "hipblasOperation_t");
static_assert(FourByteUnsigned<::hipblasComputeType_t>(), "hipblasComputeType_t");
static_assert(FourByteUnsigned<::hipblasLtMatmulDescAttributes_t>(), "hipblasLtMatmulDescAttributes_t");
static_assert(FourByteUnsigned<::hipblasLtMatmulMatrixScale_t>(), "hipblasLtMatmulMatrixScale_t");
static_assert(FourByteUnsigned<::hipblasLtMatmulPreferenceAttributes_t>(), "hipblasLtMatmulPreferenceAttributes_t");
static_assert(sizeof(::hipError_t) == 4 && sizeof(::hipDeviceAttribute_t) == 4, "HIP enums");

// Structs.
static_assert(sizeof(::hipblasLtMatmulAlgo_t) == sizeof(abi::hipblasLtMatmulAlgo_t), "algo size");
static_assert(offsetof(::hipblasLtMatmulAlgo_t, max_workspace_bytes) ==
              offsetof(abi::hipblasLtMatmulAlgo_t, max_workspace_bytes), "algo layout");
static_assert(sizeof(::hipblasLtMatmulHeuristicResult_t) == sizeof(abi::hipblasLtMatmulHeuristicResult_t), "result size");
static_assert(offsetof(::hipblasLtMatmulHeuristicResult_t, workspaceSize) ==
              offsetof(abi::hipblasLtMatmulHeuristicResult_t, workspaceSize), "result.workspaceSize");
static_assert(offsetof(::hipblasLtMatmulHeuristicResult_t, state) ==
              offsetof(abi::hipblasLtMatmulHeuristicResult_t, state), "result.state");
static_assert(offsetof(::hipblasLtMatmulHeuristicResult_t, wavesCount) ==
              offsetof(abi::hipblasLtMatmulHeuristicResult_t, wavesCount), "result.wavesCount");
static_assert(sizeof(::hipblasLtMatmulDescOpaque_t) == sizeof(abi::hipblasLtMatmulDescOpaque_t), "desc");
static_assert(sizeof(::hipblasLtMatrixLayoutOpaque_t) == sizeof(abi::hipblasLtMatrixLayoutOpaque_t), "layout");
static_assert(sizeof(::hipblasLtMatmulPreferenceOpaque_t) == sizeof(abi::hipblasLtMatmulPreferenceOpaque_t), "pref");
static_assert(sizeof(::hipblasLtHandle_t) == sizeof(abi::hipblasLtHandle_t), "handle");
static_assert(sizeof(::hipDeviceProp_tR0600) == abi::kDevicePropR0600Size, "hipDeviceProp_tR0600 size");
static_assert(offsetof(::hipDeviceProp_tR0600, gcnArchName) == abi::kDevicePropGcnArchNameOffset, "gcnArchName");
static_assert(sizeof(::hipDeviceProp_tR0600::gcnArchName) == abi::kDevicePropGcnArchNameSize, "gcnArchName size");
static_assert(offsetof(::hipDeviceProp_tR0600, major) == abi::kDevicePropMajorOffset, "major");
static_assert(offsetof(::hipDeviceProp_tR0600, minor) == abi::kDevicePropMinorOffset, "minor");

// Function signatures: same arity, same size of the result and of every parameter.
template <typename R1, typename... A1, typename R2, typename... A2>
constexpr bool SameAbi(R1 (*)(A1...), R2 (*)(A2...)) {
  if constexpr (sizeof...(A1) != sizeof...(A2)) {
    return false;
  } else {
    return sizeof(R1) == sizeof(R2) && ((sizeof(A1) == sizeof(A2)) && ...);
  }
}
#define JAX_MXFP4_SAME_SIGNATURE(ret, name, params)                                  \
  static_assert(SameAbi(&::name, static_cast<abi::PFN_##name>(nullptr)),             \
                #name ": declared signature differs from the installed headers");
JAX_MXFP4_HIP_FUNCTIONS(JAX_MXFP4_SAME_SIGNATURE)
JAX_MXFP4_HIPBLASLT_FUNCTIONS(JAX_MXFP4_SAME_SIGNATURE)
