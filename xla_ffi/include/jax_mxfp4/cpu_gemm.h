// CPU reference MXFP4 GEMM (backend "ffi-cpu"; also the arithmetic of the hipBLASLt test double).
//
// Numerics (the same rules as jax_mxfp4.mx_format, written again here so the two check each other):
//   element  = E2M1(code) x 2^(scale_byte - 127); scale byte 0xFF -> NaN (OCP MX v1.0 §5.4.1);
//              |element| < 2^-126 -> zero of the same sign (the package-wide flush rule).
//   product  = lhs element x rhs element in float32: exact (<= 4 significant bits) unless it
//              overflows; |product| < 2^-126 flushes to signed zero (as XLA:CPU does).
//   block    = the 32 products of one K-block summed in float32: exact whenever it is finite and
//              above 2^-126 (all are multiples of one power of two, |sum| < 2^13 of them), so its
//              order does not matter; blocks whose products may flush are summed k ascending.
//   result   = block sums accumulated in float32, blocks ascending (fixed order); partial sums
//              below 2^-126 flush to signed zero; then one rounding to the output type (RNE).
#pragma once

#include <cstdint>

#include "jax_mxfp4/problem.h"

namespace jax_mxfp4 {

// Decoded float32 value of one E2M1 code (low 4 bits of `code`) with E8M0 scale byte `scale`.
float DecodeMxfp4(uint8_t code, uint8_t scale);

uint16_t FloatToBf16(float f);  // round to nearest even; NaN stays NaN
uint16_t FloatToF16(float f);   // round to nearest even, f16 subnormals kept, overflow -> inf

// out (problem.out_type) = lhs . rhs^T for every batch element. Buffers are host memory laid
// out as in problem.h; the problem must come from ValidateGemm.
void ReferenceGemm(const GemmProblem& p, const uint8_t* lhs, const uint8_t* lhs_scales,
                   const uint8_t* rhs, const uint8_t* rhs_scales, void* out);

}  // namespace jax_mxfp4
