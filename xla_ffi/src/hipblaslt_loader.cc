// dlopen loader for libamdhip64 + libhipblaslt (search order documented in hipblaslt_api.h).
#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "jax_mxfp4/hipblaslt_api.h"

namespace jax_mxfp4 {

const char* HipblasStatusName(abi::hipblasStatus_t s) {
  static const char* const kNames[] = {
      "HIPBLAS_STATUS_SUCCESS",          "HIPBLAS_STATUS_NOT_INITIALIZED",
      "HIPBLAS_STATUS_ALLOC_FAILED",     "HIPBLAS_STATUS_INVALID_VALUE",
      "HIPBLAS_STATUS_MAPPING_ERROR",    "HIPBLAS_STATUS_EXECUTION_FAILED",
      "HIPBLAS_STATUS_INTERNAL_ERROR",   "HIPBLAS_STATUS_NOT_SUPPORTED",
      "HIPBLAS_STATUS_ARCH_MISMATCH",    "HIPBLAS_STATUS_HANDLE_IS_NULLPTR",
      "HIPBLAS_STATUS_INVALID_ENUM",     "HIPBLAS_STATUS_UNKNOWN"};
  return s < sizeof(kNames) / sizeof(kNames[0]) ? kNames[s] : "UNKNOWN_STATUS";
}

namespace {

std::string DirOf(const std::string& path) {
  auto pos = path.rfind('/');
  return pos == std::string::npos ? std::string() : path.substr(0, pos);
}

std::string PathOf(void* symbol) {
  Dl_info info;
  if (symbol != nullptr && dladdr(symbol, &info) != 0 && info.dli_fname != nullptr) {
    return info.dli_fname;
  }
  return "";
}

// Tries the candidates in order; returns the first handle that dlopen accepts.
void* OpenFirst(const std::vector<std::pair<std::string, int>>& candidates, std::string* searched,
                std::string* last_error) {
  for (const auto& [name, extra_flags] : candidates) {
    *searched += (searched->empty() ? "" : "; ") + name +
                 ((extra_flags & RTLD_NOLOAD) ? " (already loaded?)" : "");
    dlerror();
    if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL | extra_flags)) return h;
    if (!(extra_flags & RTLD_NOLOAD)) {
      const char* e = dlerror();
      if (e) *last_error = e;
    }
  }
  return nullptr;
}

std::mutex wheel_mu;
std::vector<std::string> wheel_dirs;  // guarded by wheel_mu
bool loaded = false;                  // guarded by wheel_mu: LoadHipblaslt() has started

std::vector<std::pair<std::string, int>> Candidates(const char* versioned, const char* plain,
                                                    const std::string& extra_dir) {
  std::vector<std::pair<std::string, int>> c;
  const char* env_dir = std::getenv("JAX_MXFP4_ROCM_LIB_DIR");
  if (env_dir != nullptr && *env_dir != '\0') {
    const std::string d(env_dir);
    c.push_back({d + "/" + versioned, 0});
    c.push_back({d + "/" + plain, 0});
    return c;
  }
  c.push_back({versioned, RTLD_NOLOAD});
  std::vector<std::string> wheels;
  {
    std::lock_guard<std::mutex> lock(wheel_mu);
    wheels = wheel_dirs;
  }
  for (const auto& d : wheels) {
    c.push_back({d + "/" + versioned, 0});
    c.push_back({d + "/" + plain, 0});
  }
  if (!extra_dir.empty()) {
    c.push_back({extra_dir + "/" + versioned, 0});
    c.push_back({extra_dir + "/" + plain, 0});
  }
  c.push_back({versioned, 0});
  c.push_back({plain, 0});
  std::vector<std::string> dirs;
  if (const char* rp = std::getenv("ROCM_PATH"); rp != nullptr && *rp != '\0') {
    dirs.push_back(std::string(rp) + "/lib");
  }
  dirs.push_back("/opt/rocm/lib");
  for (const auto& d : dirs) {
    c.push_back({d + "/" + versioned, 0});
    c.push_back({d + "/" + plain, 0});
  }
  return c;
}

// The first loaded object whose file name starts with "librocroller" (hipBLASLt links rocRoller,
// the generator of its default MX kernels, as a shared library where it is built with it).
int FindRocroller(struct dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name;
  if (name == nullptr) return 0;
  const char* base = std::strrchr(name, '/');
  base = base ? base + 1 : name;
  if (std::strncmp(base, "librocroller", 12) == 0) {
    *static_cast<std::string*>(out) = name;
    return 1;
  }
  return 0;
}

LoadResult DoLoad() {
  LoadResult r;
  static HipblasltApi api;
  std::string err;
  void* hip = OpenFirst(Candidates("libamdhip64.so.7", "libamdhip64.so", ""), &r.searched, &err);
  if (hip == nullptr) {
    r.error = "could not dlopen the HIP runtime (libamdhip64.so.7 / libamdhip64.so); tried: " +
              r.searched + (err.empty() ? "" : "; last error: " + err) +
              ". Set JAX_MXFP4_ROCM_LIB_DIR to the directory holding the ROCm 7 libraries.";
    return r;
  }
  std::vector<std::string> missing;
#define JAX_MXFP4_LOAD_HIP(ret, name, params) \
  api.name = reinterpret_cast<abi::PFN_##name>(dlsym(hip, #name)); \
  if (api.name == nullptr) missing.push_back(#name);
  JAX_MXFP4_HIP_FUNCTIONS(JAX_MXFP4_LOAD_HIP)
#undef JAX_MXFP4_LOAD_HIP
  r.hip_path = PathOf(reinterpret_cast<void*>(api.hipGetDevice));
  std::string searched_blas;
  void* blas = OpenFirst(Candidates("libhipblaslt.so.1", "libhipblaslt.so", DirOf(r.hip_path)),
                         &searched_blas, &err);
  r.searched += " | " + searched_blas;
  if (blas == nullptr) {
    r.error = "could not dlopen hipBLASLt (libhipblaslt.so.1 / libhipblaslt.so); tried: " +
              searched_blas + (err.empty() ? "" : "; last error: " + err) +
              ". Install hipBLASLt >= 1.0 (ROCm >= 7.0) or set JAX_MXFP4_ROCM_LIB_DIR.";
    return r;
  }
#define JAX_MXFP4_LOAD_BLAS(ret, name, params) \
  api.name = reinterpret_cast<abi::PFN_##name>(dlsym(blas, #name)); \
  if (api.name == nullptr) missing.push_back(#name);
  JAX_MXFP4_HIPBLASLT_FUNCTIONS(JAX_MXFP4_LOAD_BLAS)
#undef JAX_MXFP4_LOAD_BLAS
  r.hipblaslt_path = PathOf(reinterpret_cast<void*>(api.hipblasLtCreate));
  dl_iterate_phdr(&FindRocroller, &r.rocroller_path);
  if (!missing.empty()) {
    std::string m;
    for (const auto& s : missing) m += (m.empty() ? "" : ", ") + s;
    r.error = "the loaded ROCm libraries (" + r.hip_path + ", " + r.hipblaslt_path +
              ") lack the symbols: " + m + " (need ROCm >= 7.0)";
    return r;
  }
  r.api = &api;
  return r;
}

}  // namespace

const LoadResult& LoadHipblaslt() {
  static std::once_flag once;
  static LoadResult result;
  std::call_once(once, [] {
    {
      std::lock_guard<std::mutex> lock(wheel_mu);
      loaded = true;
    }
    result = DoLoad();
  });
  return result;
}

bool SetWheelLibraryDirs(const std::vector<std::string>& dirs) {
  std::lock_guard<std::mutex> lock(wheel_mu);
  if (loaded) return false;
  wheel_dirs = dirs;
  return true;
}

}  // namespace jax_mxfp4
