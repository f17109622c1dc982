// XLA FFI handler "jax_mxfp4_gemm_cpu" (platform "cpu"): validation + CPU reference GEMM.
#include <exception>

#include "ffi_common.h"
#include "handlers.h"
#include "jax_mxfp4/cpu_gemm.h"

namespace jax_mxfp4 {
namespace {

ffi::Error CpuGemmImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, ffi::AnyBuffer rhs,
                       ffi::AnyBuffer rhs_scales, ffi::Result<ffi::AnyBuffer> out,
                       std::string_view scale_layout) {
  constexpr const char* kWhere = "jax_mxfp4_gemm_cpu";
  GemmProblem p;
  Status st = DescribeGemm(lhs, lhs_scales, rhs, rhs_scales, *out, scale_layout, &p);
  if (!st.ok()) return ToFfi(st, kWhere);
  try {
    ReferenceGemm(p, static_cast<const uint8_t*>(lhs.untyped_data()),
                  static_cast<const uint8_t*>(lhs_scales.untyped_data()),
                  static_cast<const uint8_t*>(rhs.untyped_data()),
                  static_cast<const uint8_t*>(rhs_scales.untyped_data()), out->untyped_data());
  } catch (const std::exception& e) {  // e.g. std::bad_alloc; never let it cross the C ABI
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(kWhere) + ": " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_mxfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMxfp4GemmCpu, jax_mxfp4::CpuGemmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs data
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs scales
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs data
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs scales
                                  .Ret<xla::ffi::AnyBuffer>()  // out
                                  .Attr<std::string_view>("scale_layout"));
