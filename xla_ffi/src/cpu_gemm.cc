// CPU reference MXFP4 GEMM: arithmetic (see cpu_gemm.h for the rules).
#include "jax_mxfp4/cpu_gemm.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace jax_mxfp4 {
namespace {

// E2M1 magnitudes for codes 0..7, bit 3 is the sign (OCP MX v1.0 §5.3.3).
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr float kMinNormal = std::numeric_limits<float>::min();  // 2^-126

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Flush |x| < 2^-126 to a zero of x's sign (bit test: immune to the FPU's FTZ/DAZ mode).
inline float Flush(float x) {
  uint32_t u = Bits(x);
  if ((u & 0x7F800000u) == 0) {
    u &= 0x80000000u;
    std::memcpy(&x, &u, 4);
  }
  return x;
}

// Dequantizes one operand (batch element) to float32 [rows, k].
void Dequantize(const GemmProblem& p, const uint8_t* data, const uint8_t* scales, int64_t rows,
                std::vector<float>* out, std::vector<uint8_t>* block_scales) {
  const int64_t k = p.k, kb = p.k_blocks();
  out->resize(static_cast<size_t>(rows * k));
  block_scales->resize(static_cast<size_t>(rows * kb));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < kb; ++c) {
      const uint8_t s = scales[ScaleOffset(p.layout, r, c, p.scale_cols)];
      (*block_scales)[r * kb + c] = s;
      for (int64_t i = 0; i < 32; ++i) {
        const int64_t kk = c * 32 + i;
        const uint8_t byte = data[r * (k / 2) + kk / 2];
        const uint8_t code = (kk % 2 == 0) ? (byte & 0xF) : (byte >> 4);
        (*out)[r * k + kk] = DecodeMxfp4(code, s);
      }
    }
  }
}

}  // namespace

float DecodeMxfp4(uint8_t code, uint8_t scale) {
  const float v = kE2M1[code & 0xF];
  if (scale == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  // Exact in double; the float conversion is exact for normal results and overflows to inf.
  const float x = static_cast<float>(std::ldexp(static_cast<double>(v), int(scale) - 127));
  return std::fabs(x) < kMinNormal ? std::copysign(0.0f, v) : x;
}

uint16_t FloatToBf16(float f) {
  const uint32_t u = Bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

uint16_t FloatToF16(float f) {
  const uint32_t u = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return sign | (a > 0x7F800000u ? 0x7E00u : 0x7C00u);
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (a <= 0x33000000u) return sign;            // <= 2^-25 rounds to zero (tie to even)
  if (a < 0x38800000u) {                        // f16 subnormal: unit 2^-24
    const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    const int shift = 126 - static_cast<int>(a >> 23);
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (a - 0x38000000u) >> 13;  // rebias exponent 127 -> 15, keep 10 mantissa bits
  const uint32_t rem = a & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

void ReferenceGemm(const GemmProblem& p, const uint8_t* lhs, const uint8_t* lhs_scales,
                   const uint8_t* rhs, const uint8_t* rhs_scales, void* out) {
  std::vector<float> a, b;
  std::vector<uint8_t> sa, sb;
  const int64_t kb = p.k_blocks(), k = p.k;
  for (int64_t bi = 0; bi < p.batch; ++bi) {
    Dequantize(p, lhs + bi * p.lhs_data_stride(), lhs_scales + bi * p.lhs_scale_stride(), p.m, &a, &sa);
    Dequantize(p, rhs + bi * p.rhs_data_stride(), rhs_scales + bi * p.rhs_scale_stride(), p.n, &b, &sb);
    uint8_t* o = static_cast<uint8_t*>(out) + bi * p.out_stride_bytes();
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = 0; j < p.n; ++j) {
        const float* ar = a.data() + i * k;
        const float* br = b.data() + j * k;
        float acc = 0.0f;
        for (int64_t c = 0; c < kb; ++c) {
          const float* x = ar + c * 32;
          const float* y = br + c * 32;
          float block = 0.0f;
          if (int(sa[i * kb + c]) + int(sb[j * kb + c]) >= 130) {
            // Every nonzero product is >= 2^(sa+sb-256) >= 2^-126 and a multiple of it, and the
            // block has < 2^13 such units: the sum is exact in any order (no flush possible),
            // so it is summed in 8 lanes the compiler can vectorise.
            float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int t = 0; t < 32; t += 8) {
              for (int l = 0; l < 8; ++l) lane[l] += x[t + l] * y[t + l];
            }
            block = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
          } else {
            for (int t = 0; t < 32; ++t) block = Flush(block + Flush(x[t] * y[t]));
          }
          acc = Flush(acc + block);
        }
        const int64_t idx = i * p.n + j;
        switch (p.out_type) {
          case ElemType::kF32: reinterpret_cast<float*>(o)[idx] = acc; break;
          case ElemType::kBF16: reinterpret_cast<uint16_t*>(o)[idx] = FloatToBf16(acc); break;
          case ElemType::kF16: reinterpret_cast<uint16_t*>(o)[idx] = FloatToF16(acc); break;
          default: break;  // rejected by ValidateGemm
        }
      }
    }
  }
}

}  // namespace jax_mxfp4
