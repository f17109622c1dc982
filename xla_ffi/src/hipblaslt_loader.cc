// dlopen loader for libamdhip64 + libhipblaslt (search order documented in hipblaslt_api.h).
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>

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

// `hip_dir`: for libhipblaslt, the directory libamdhip64 was loaded from. Tried before the wheel
// directories when HIP did not come from a wheel (one ROCm installation for both libraries),
// otherwise the wheel directories already hold it.
std::vector<std::pair<std::string, int>> Candidates(const char* versioned, const char* plain,
                                                    const std::string& hip_dir) {
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
  const bool hip_from_wheel = std::find(wheels.begin(), wheels.end(), hip_dir) != wheels.end();
  if (!hip_dir.empty() && !hip_from_wheel) wheels.insert(wheels.begin(), hip_dir);
  for (const auto& d : wheels) {
    c.push_back({d + "/" + versioned, 0});
    c.push_back({d + "/" + plain, 0});
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

bool ReadAt(int fd, void* buf, size_t bytes, uint64_t offset) {
  return pread(fd, buf, bytes, static_cast<off_t>(offset)) == static_cast<ssize_t>(bytes);
}

// The DT_NEEDED names of an ELF64 shared object file (read from the file: the loaded image's
// dynamic section may or may not be relocated); empty when the file cannot be read as one.
std::vector<std::string> NeededOf(const std::string& path) {
  std::vector<std::string> needed;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return needed;
  Elf64_Ehdr eh;
  std::vector<Elf64_Phdr> ph;
  if (ReadAt(fd, &eh, sizeof(eh), 0) && std::memcmp(eh.e_ident, ELFMAG, SELFMAG) == 0 &&
      eh.e_ident[EI_CLASS] == ELFCLASS64 && eh.e_phentsize == sizeof(Elf64_Phdr)) {
    ph.resize(eh.e_phnum);
    if (!ReadAt(fd, ph.data(), ph.size() * sizeof(Elf64_Phdr), eh.e_phoff)) ph.clear();
  }
  auto file_offset = [&](uint64_t vaddr, uint64_t* off) {
    for (const auto& p : ph) {
      if (p.p_type == PT_LOAD && vaddr >= p.p_vaddr && vaddr < p.p_vaddr + p.p_filesz) {
        *off = vaddr - p.p_vaddr + p.p_offset;
        return true;
      }
    }
    return false;
  };
  for (const auto& p : ph) {
    if (p.p_type != PT_DYNAMIC) continue;
    std::vector<Elf64_Dyn> dyn(p.p_filesz / sizeof(Elf64_Dyn));
    if (!ReadAt(fd, dyn.data(), dyn.size() * sizeof(Elf64_Dyn), p.p_offset)) break;
    uint64_t strtab = 0, strsz = 0;
    std::vector<uint64_t> names;
    for (const auto& d : dyn) {
      if (d.d_tag == DT_NULL) break;
      if (d.d_tag == DT_NEEDED) names.push_back(d.d_un.d_val);
      if (d.d_tag == DT_STRTAB) strtab = d.d_un.d_ptr;
      if (d.d_tag == DT_STRSZ) strsz = d.d_un.d_val;
    }
    uint64_t off = 0;
    std::string table(strsz, '\0');
    if (strsz == 0 || !file_offset(strtab, &off) || !ReadAt(fd, table.data(), strsz, off)) break;
    for (uint64_t n : names) {
      if (n < strsz) needed.emplace_back(table.c_str() + n);
    }
    break;
  }
  close(fd);
  return needed;
}

struct FindLoaded {
  std::string base;  // a file name ("librocroller.so.1")
  std::string path;  // the loaded object of that name, if any
};
int FindLoadedByName(struct dl_phdr_info* info, size_t, void* out) {
  auto* f = static_cast<FindLoaded*>(out);
  const char* name = info->dlpi_name;
  if (name == nullptr) return 0;
  const char* base = std::strrchr(name, '/');
  if (f->base == (base ? base + 1 : name)) {
    f->path = name;
    return 1;
  }
  return 0;
}

// librocroller as a dependency of this libhipblaslt itself (hipBLASLt links rocRoller, the
// generator of its default MX kernels, as a shared library where it is built with it): its
// loaded path, or the DT_NEEDED name if it is not found loaded; "" if libhipblaslt needs none.
// Any other object of the process that loaded a librocroller says nothing about this build.
std::string RocrollerOf(const std::string& hipblaslt_path) {
  for (const std::string& n : NeededOf(hipblaslt_path)) {
    if (n.rfind("librocroller", 0) != 0) continue;
    FindLoaded f{n, ""};
    dl_iterate_phdr(&FindLoadedByName, &f);
    return f.path.empty() ? n : f.path;
  }
  return "";
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
  r.rocroller_path = RocrollerOf(r.hipblaslt_path);
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
