// Validation of the MXFP4 GEMM contract (see problem.h); the only copy of these rules in C++.
#include "jax_mxfp4/problem.h"

#include "jax_mxfp4/str_cat.h"

namespace jax_mxfp4 {
namespace {

std::string Dims(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += StrCat(i ? ", " : "", d[i]);
  return s + "]";
}

Status Expect(const char* name, const TensorView& t, const std::vector<int64_t>& want,
              const char* rule) {
  if (t.dims != want) {
    return Status::Invalid(std::string(name) + " has shape " + Dims(t.dims) + ", expected " +
                           Dims(want) + " (" + rule + ")");
  }
  return Status::Ok();
}

}  // namespace

const char* ElemTypeName(ElemType t) {
  switch (t) {
    case ElemType::kU8: return "uint8";
    case ElemType::kE8M0: return "float8_e8m0fnu";
    case ElemType::kF32: return "float32";
    case ElemType::kBF16: return "bfloat16";
    case ElemType::kF16: return "float16";
    default: return "unsupported dtype";
  }
}

size_t ElemTypeBytes(ElemType t) {
  switch (t) {
    case ElemType::kU8:
    case ElemType::kE8M0: return 1;
    case ElemType::kF32: return 4;
    case ElemType::kBF16:
    case ElemType::kF16: return 2;
    default: return 0;
  }
}

Status ParseScaleLayout(std::string_view name, ScaleLayout* out) {
  if (name == "plain") {
    *out = ScaleLayout::kPlain;
  } else if (name == "swizzled") {
    *out = ScaleLayout::kSwizzled;
  } else {
    return Status::Invalid("attribute scale_layout must be \"plain\" or \"swizzled\", got \"" +
                           std::string(name) + "\"");
  }
  return Status::Ok();
}

Status ValidateGemm(const TensorView& lhs, const TensorView& lhs_scales, const TensorView& rhs,
                    const TensorView& rhs_scales, const TensorView& out, ScaleLayout layout,
                    std::initializer_list<ElemType> allowed_out, GemmProblem* p) {
  const size_t rank = lhs.dims.size();
  if (rank != 2 && rank != 3) {
    return Status::Invalid("lhs data must have rank 2 [M, K/2] or 3 [B, M, K/2], got shape " +
                           Dims(lhs.dims));
  }
  const struct {
    const char* name;
    const TensorView* t;
  } all[] = {{"lhs data", &lhs}, {"lhs scales", &lhs_scales}, {"rhs data", &rhs},
             {"rhs scales", &rhs_scales}, {"out", &out}};
  for (const auto& x : all) {
    if (x.t->dims.size() != rank) {
      return Status::Invalid(std::string(x.name) + " has rank " +
                             std::to_string(x.t->dims.size()) + " but lhs data has rank " +
                             std::to_string(rank) + " (all operands share the optional batch dim)");
    }
    for (int64_t d : x.t->dims) {
      if (d < 0) return Status::Invalid(std::string(x.name) + " has a negative dim");
    }
  }
  if (lhs.type != ElemType::kU8 || rhs.type != ElemType::kU8) {
    return Status::Invalid(std::string("lhs/rhs data must be uint8 (packed E2M1 pairs), got ") +
                           ElemTypeName(lhs.type) + " / " + ElemTypeName(rhs.type));
  }
  for (const TensorView* s : {&lhs_scales, &rhs_scales}) {
    if (s->type != ElemType::kE8M0 && s->type != ElemType::kU8) {
      return Status::Invalid(std::string(s == &lhs_scales ? "lhs" : "rhs") +
                             " scales must be float8_e8m0fnu or uint8 (E8M0 bytes), got " +
                             ElemTypeName(s->type));
    }
  }
  bool out_ok = false;
  std::string allowed;
  for (ElemType t : allowed_out) {
    out_ok |= (t == out.type);
    allowed += std::string(allowed.empty() ? "" : ", ") + ElemTypeName(t);
  }
  if (!out_ok) {
    return Status::Invalid(std::string("out must be one of {") + allowed + "} for this handler, got " +
                           ElemTypeName(out.type));
  }
  const size_t o = rank - 2;
  p->batch = rank == 3 ? lhs.dims[0] : 1;
  p->m = lhs.dims[o];
  p->k = 2 * lhs.dims[o + 1];
  p->n = rhs.dims[o];
  p->layout = layout;
  p->out_type = out.type;
  if (p->k % 32 != 0) {
    return Status::Invalid("K = 2 x lhs data's last dim = " + std::to_string(p->k) +
                           " must be a multiple of the MXFP4 block size 32 (OCP MX v1.0 §5.1)");
  }
  std::vector<int64_t> lead;
  if (rank == 3) lead.push_back(p->batch);
  auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> v = lead;
    v.insert(v.end(), tail);
    return v;
  };
  Status st = Expect("rhs data", rhs, with({p->n, p->k / 2}),
                     "same batch and K/2 as lhs data: contraction over K");
  if (!st.ok()) return st;
  const int64_t kb = p->k / 32;
  if (layout == ScaleLayout::kPlain) {
    p->lhs_scale_rows = p->m;
    p->rhs_scale_rows = p->n;
    p->scale_cols = kb;
  } else {
    p->lhs_scale_rows = RoundUp(p->m, 32);
    p->rhs_scale_rows = RoundUp(p->n, 32);
    p->scale_cols = RoundUp(kb, 8);
  }
  const char* scale_rule = layout == ScaleLayout::kPlain
                               ? "plain layout: one E8M0 byte per 32 elements along K"
                               : "swizzled layout: rows padded to 32, K/32 padded to 8 "
                                 "(hipBLASLt BLK32_UE8M0_32_8_EXT)";
  st = Expect("lhs scales", lhs_scales, with({p->lhs_scale_rows, p->scale_cols}), scale_rule);
  if (!st.ok()) return st;
  st = Expect("rhs scales", rhs_scales, with({p->rhs_scale_rows, p->scale_cols}), scale_rule);
  if (!st.ok()) return st;
  st = Expect("out", out, with({p->m, p->n}), "out = lhs . rhs^T");
  if (!st.ok()) return st;
  const size_t total = p->batch * p->m * p->n;
  for (const auto& x : all) {
    size_t count = 1;
    for (int64_t d : x.t->dims) count *= static_cast<size_t>(d);
    if (count != 0 && x.t->data == nullptr) {
      return Status::Invalid(std::string(x.name) + " has a null data pointer");
    }
  }
  (void)total;
  return Status::Ok();
}

}  // namespace jax_mxfp4
