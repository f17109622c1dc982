// XLA FFI <-> problem.h glue shared by the handlers.
#pragma once

#include <string>
#include <string_view>

#include "jax_mxfp4/problem.h"
#include "xla/ffi/api/ffi.h"

namespace jax_mxfp4 {

namespace ffi = xla::ffi;

inline ElemType FromFfi(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U8: return ElemType::kU8;
    case ffi::DataType::F8E8M0FNU: return ElemType::kE8M0;
    case ffi::DataType::F32: return ElemType::kF32;
    case ffi::DataType::BF16: return ElemType::kBF16;
    case ffi::DataType::F16: return ElemType::kF16;
    default: return ElemType::kOther;
  }
}

inline TensorView View(const ffi::AnyBuffer& b) {
  TensorView v;
  v.type = FromFfi(b.element_type());
  auto d = b.dimensions();
  v.dims.assign(d.begin(), d.end());
  v.data = b.untyped_data();
  return v;
}

inline ffi::Error ToFfi(const Status& s, const char* where) {
  if (s.ok()) return ffi::Error::Success();
  ffi::ErrorCode c = ffi::ErrorCode::kInternal;
  switch (s.code) {
    case StatusCode::kInvalidArgument: c = ffi::ErrorCode::kInvalidArgument; break;
    case StatusCode::kFailedPrecondition: c = ffi::ErrorCode::kFailedPrecondition; break;
    case StatusCode::kUnimplemented: c = ffi::ErrorCode::kUnimplemented; break;
    case StatusCode::kResourceExhausted: c = ffi::ErrorCode::kResourceExhausted; break;
    case StatusCode::kNotFound: c = ffi::ErrorCode::kNotFound; break;
    default: break;
  }
  return ffi::Error(c, std::string(where) + ": " + s.message);
}

// The common prologue of every GEMM handler: parse the scale-layout attribute and validate the
// operands against the one problem contract (problem.h). Output dtypes: f32, bf16, f16.
inline Status DescribeGemm(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& lhs_scales,
                           const ffi::AnyBuffer& rhs, const ffi::AnyBuffer& rhs_scales,
                           const ffi::AnyBuffer& out, std::string_view scale_layout, GemmProblem* p) {
  ScaleLayout layout;
  Status st = ParseScaleLayout(scale_layout, &layout);
  if (!st.ok()) return st;
  return ValidateGemm(View(lhs), View(lhs_scales), View(rhs), View(rhs_scales), View(out), layout,
                      {ElemType::kF32, ElemType::kBF16, ElemType::kF16}, p);
}

}  // namespace jax_mxfp4
