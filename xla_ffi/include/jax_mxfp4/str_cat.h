// StrCat: error messages built by appending, without iostreams.
//
// Why not std::ostringstream: a module whose libstdc++ is linked statically (some toolchains and
// wheel builders do this) numbers its locale facets apart from the process's shared libstdc++, and
// an ostream's number formatting may then call the wrong facet. On an NVIDIA H200 this crashed
// `ostream << long` once Triton had compiled kernels in the same process. std::to_string formats
// through vsnprintf and touches no facet.
#ifndef JAX_MXFP4_STR_CAT_H_
#define JAX_MXFP4_STR_CAT_H_

#include <string>
#include <string_view>
#include <type_traits>

namespace jax_mxfp4 {
namespace str_cat_internal {

inline void Append(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void Append(std::string& s, const char* v) { s += (v != nullptr ? v : "(null)"); }

template <typename T, std::enable_if_t<std::is_integral_v<T> || std::is_enum_v<T>, int> = 0>
void Append(std::string& s, T v) {
  if constexpr (std::is_same_v<T, bool>) {
    s += v ? "true" : "false";
  } else if constexpr (std::is_enum_v<T>) {
    s += std::to_string(static_cast<long long>(v));
  } else {
    s += std::to_string(v);
  }
}

}  // namespace str_cat_internal

template <typename... Parts>
std::string StrCat(const Parts&... parts) {
  std::string s;
  (str_cat_internal::Append(s, parts), ...);
  return s;
}

}  // namespace jax_mxfp4

#endif  // JAX_MXFP4_STR_CAT_H_
