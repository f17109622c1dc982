// XLA FFI handler "jax_mxfp4_gemm_hipblaslt" (platform "ROCM"): loads hipBLASLt on first use,
// validates with the shared problem checks, then runs the call path of hipblaslt_gemm.cc.
#include <exception>

#include "ffi_common.h"
#include "handlers.h"
#include "jax_mxfp4/hipblaslt_gemm.h"

namespace jax_mxfp4 {
namespace {

class ScratchWorkspace : public WorkspaceAllocator {
 public:
  explicit ScratchWorkspace(ffi::ScratchAllocator* s) : s_(s) {}
  void* Allocate(size_t bytes, size_t alignment) override {
    auto r = s_->Allocate(bytes, alignment);
    return r.has_value() ? *r : nullptr;
  }

 private:
  ffi::ScratchAllocator* s_;
};

ffi::Error HipblasltGemmImpl(abi::hipStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                             ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, ffi::AnyBuffer rhs,
                             ffi::AnyBuffer rhs_scales, ffi::Result<ffi::AnyBuffer> out,
                             std::string_view scale_layout) {
  constexpr const char* kWhere = "jax_mxfp4_gemm_hipblaslt";
  try {
    const LoadResult& lib = LoadHipblaslt();
    if (lib.api == nullptr) return ToFfi(Status::Precondition(lib.error), kWhere);
    GemmProblem p;
    Status st = DescribeGemm(lhs, lhs_scales, rhs, rhs_scales, *out, scale_layout, &p);
    if (!st.ok()) return ToFfi(st, kWhere);
    GemmBuffers b{lhs.untyped_data(), lhs_scales.untyped_data(), rhs.untyped_data(),
                  rhs_scales.untyped_data(), out->untyped_data()};
    ScratchWorkspace ws(&scratch);
    return ToFfi(ProcessHipblasltRuntime(lib.api).Gemm(p, b, stream, device, &ws), kWhere);
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(kWhere) + ": " + e.what());
  }
}

}  // namespace
}  // namespace jax_mxfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMxfp4GemmHipblaslt, jax_mxfp4::HipblasltGemmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<jax_mxfp4::abi::hipStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs data
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs scales
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs data
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs scales
                                  .Ret<xla::ffi::AnyBuffer>()  // out
                                  .Attr<std::string_view>("scale_layout"));
