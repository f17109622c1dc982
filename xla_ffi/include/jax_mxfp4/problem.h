// The MXFP4 GEMM problem shared by every handler: operand contract and validation (one place).
//
// Contract (row-major buffers, the "TN" GEMM out = lhs . rhs^T per batch element):
//   lhs data    uint8 [B?, M, K/2]  packed E2M1 pairs, element 2i in bits 0-3 (OCP MX v1.0 §5.3.3;
//                                   hipBLASLt packData, reference/hipblaslt-mxfp4.md §4)
//   lhs scales  E8M0 (float8_e8m0fnu or uint8), layout "plain": [B?, M, K/32];
//               layout "swizzled": [B?, round_up(M, 32), round_up(K/32, 8)] (32x8 tiles, §1.6)
//   rhs data    uint8 [B?, N, K/2]; rhs scales as lhs scales with N rows
//   out         [B?, M, N]; element type chosen per handler (float32, bfloat16, float16)
// B? is an optional leading batch dim (all five buffers have the same rank, 2 or 3).
// K = 2 x packed bytes and must be a multiple of 32 (OCP MX v1.0 §5.1, block size 32).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace jax_mxfp4 {

enum class ElemType { kU8, kE8M0, kF32, kBF16, kF16, kOther };
enum class ScaleLayout { kPlain, kSwizzled };

// Mirrors the XLA FFI error codes we use; converted to ffi::Error at the handler boundary.
enum class StatusCode {
  kOk,
  kInvalidArgument,
  kFailedPrecondition,
  kUnimplemented,
  kResourceExhausted,
  kNotFound,
  kInternal,
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;
  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return Status{}; }
  static Status Invalid(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status Precondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
  static Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
};

const char* ElemTypeName(ElemType t);
size_t ElemTypeBytes(ElemType t);  // 0 for kOther

// One operand or result as the handler sees it (no ownership).
struct TensorView {
  ElemType type = ElemType::kOther;
  std::vector<int64_t> dims;
  void* data = nullptr;
};

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct GemmProblem {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  ScaleLayout layout = ScaleLayout::kPlain;
  ElemType out_type = ElemType::kF32;
  // Scale matrix of one batch element: rows x cols bytes (padded for "swizzled").
  int64_t lhs_scale_rows = 0, rhs_scale_rows = 0, scale_cols = 0;

  int64_t k_blocks() const { return k / 32; }
  int64_t lhs_data_stride() const { return m * (k / 2); }
  int64_t rhs_data_stride() const { return n * (k / 2); }
  int64_t lhs_scale_stride() const { return lhs_scale_rows * scale_cols; }
  int64_t rhs_scale_stride() const { return rhs_scale_rows * scale_cols; }
  int64_t out_stride_bytes() const { return m * n * static_cast<int64_t>(ElemTypeBytes(out_type)); }
};

// "plain" | "swizzled" -> ScaleLayout; anything else is an InvalidArgument naming the attribute.
Status ParseScaleLayout(std::string_view name, ScaleLayout* out);

// Validates the five buffers against the contract above and fills *problem.
// `allowed_out` lists the result element types this handler writes.
Status ValidateGemm(const TensorView& lhs, const TensorView& lhs_scales, const TensorView& rhs,
                    const TensorView& rhs_scales, const TensorView& out, ScaleLayout layout,
                    std::initializer_list<ElemType> allowed_out, GemmProblem* problem);

// Byte offset of scale (row r, K-block c) inside one batch element's scale matrix.
// plain: r * cols + c. swizzled (hipBLASLt BLK32_UE8M0_32_8_EXT, reference/hipblaslt-mxfp4.md
// §1.6 closed form): a*32*C + d*256 + f*64 + cc*4 + e*2 + b with a = r/32, b = (r%32)/16,
// cc = r%16, d = c/8, e = (c%8)/4, f = c%4 and C the padded column count.
inline int64_t ScaleOffset(ScaleLayout layout, int64_t r, int64_t c, int64_t cols) {
  if (layout == ScaleLayout::kPlain) return r * cols + c;
  const int64_t a = r / 32, b = (r % 32) / 16, cc = r % 16;
  const int64_t d = c / 8, e = (c % 8) / 4, f = c % 4;
  return a * 32 * cols + d * 256 + f * 64 + cc * 4 + e * 2 + b;
}

}  // namespace jax_mxfp4
