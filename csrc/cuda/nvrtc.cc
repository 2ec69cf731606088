#include "cuda/nvrtc.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>

namespace fastattn::cuda {

namespace {

using nvrtcProgram = struct _nvrtcProgram*;

struct Nvrtc {
  std::string path;
  std::string version;
  std::vector<int> archs;  // nvrtcGetSupportedArchs: 70, 75, ... (compute capabilities)
  int (*Version)(int*, int*);
  int (*GetNumSupportedArchs)(int*);
  int (*GetSupportedArchs)(int*);
  int (*CreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                       const char* const*);
  int (*DestroyProgram)(nvrtcProgram*);
  int (*CompileProgram)(nvrtcProgram, int, const char* const*);
  int (*GetProgramLogSize)(nvrtcProgram, size_t*);
  int (*GetProgramLog)(nvrtcProgram, char*);
  int (*GetCUBINSize)(nvrtcProgram, size_t*);
  int (*GetCUBIN)(nvrtcProgram, char*);
};

std::mutex mu;
std::vector<std::string> candidates = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
std::map<std::string, std::unique_ptr<Nvrtc>> loaded;  // by candidate; null: failed

template <typename F>
bool Sym(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

const Nvrtc* Open(const std::string& candidate, std::string* why) {
  auto it = loaded.find(candidate);
  if (it == loaded.end()) {
    std::unique_ptr<Nvrtc> n;
    if (void* lib = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      n = std::make_unique<Nvrtc>();
      n->path = candidate;
      bool ok = Sym(lib, "nvrtcVersion", &n->Version) &&
                Sym(lib, "nvrtcGetNumSupportedArchs", &n->GetNumSupportedArchs) &&
                Sym(lib, "nvrtcGetSupportedArchs", &n->GetSupportedArchs) &&
                Sym(lib, "nvrtcCreateProgram", &n->CreateProgram) &&
                Sym(lib, "nvrtcDestroyProgram", &n->DestroyProgram) &&
                Sym(lib, "nvrtcCompileProgram", &n->CompileProgram) &&
                Sym(lib, "nvrtcGetProgramLogSize", &n->GetProgramLogSize) &&
                Sym(lib, "nvrtcGetProgramLog", &n->GetProgramLog) &&
                Sym(lib, "nvrtcGetCUBINSize", &n->GetCUBINSize) &&
                Sym(lib, "nvrtcGetCUBIN", &n->GetCUBIN);
      int major = 0, minor = 0, count = 0;
      if (ok && n->Version(&major, &minor) == 0 && n->GetNumSupportedArchs(&count) == 0) {
        n->version = std::to_string(major) + "." + std::to_string(minor);
        n->archs.resize(count);
        n->GetSupportedArchs(n->archs.data());
      } else {
        n.reset();
      }
    }
    it = loaded.emplace(candidate, std::move(n)).first;
  }
  if (!it->second) *why += "\n  " + candidate + ": cannot be loaded";
  return it->second.get();
}

// The first candidate NVRTC that supports compute capability `cc`.
const Nvrtc* ForCc(int cc, std::string* error) {
  std::string why;
  for (const std::string& c : candidates) {
    const Nvrtc* n = Open(c, &why);
    if (!n) continue;
    for (int a : n->archs) {
      if (a == cc) return n;
    }
    why += "\n  " + c + " (NVRTC " + n->version + ") cannot target " + NvrtcTarget(cc);
  }
  *error = "fastattn_jax compiles its CUDA kernels at run time with NVRTC, and no NVRTC "
           "that targets " + NvrtcTarget(cc) + " was found:" + why +
           "\nInstall the NVRTC matching your JAX CUDA plugin (jax[cuda12] installs "
           "nvidia-cuda-nvrtc-cu12, which targets sm_70..sm_90; the CUDA 13 plugin "
           "installs nvidia-cuda-nvrtc, which starts at sm_75), or set FASTATTN_NVRTC to "
           "the path of a libnvrtc.so.";
  return nullptr;
}

}  // namespace

void SetNvrtcCandidates(std::vector<std::string> list) {
  std::lock_guard<std::mutex> lock(mu);
  candidates = std::move(list);
}

std::string NvrtcTarget(int cc, bool arch_specific) {
  return "sm_" + std::to_string(cc) + (arch_specific ? "a" : "");
}

std::string NvrtcVersionFor(int cc, std::string* error) {
  std::lock_guard<std::mutex> lock(mu);
  const Nvrtc* n = ForCc(cc, error);
  return n ? n->version : "";
}

CompileResult NvrtcCompile(int cc, bool arch_specific, const std::string& source,
                           const std::string& name,
                           const std::vector<std::pair<std::string, std::string>>& headers,
                           const std::vector<std::string>& options) {
  CompileResult result;
  const Nvrtc* n;
  {
    std::lock_guard<std::mutex> lock(mu);
    n = ForCc(cc, &result.log);
  }
  if (!n) return result;
  result.nvrtc = n->version + " (" + n->path + ")";
  std::vector<const char*> header_src, header_names, opts;
  for (const auto& [hname, text] : headers) {
    header_names.push_back(hname.c_str());
    header_src.push_back(text.c_str());
  }
  const std::string target = NvrtcTarget(cc, arch_specific);
  const std::string arch_opt = "--gpu-architecture=" + target;
  opts.push_back(arch_opt.c_str());
  for (const std::string& o : options) opts.push_back(o.c_str());

  nvrtcProgram prog = nullptr;
  if (int rc = n->CreateProgram(&prog, source.c_str(), name.c_str(), (int)headers.size(),
                                header_src.data(), header_names.data());
      rc != 0) {
    result.log = "nvrtcCreateProgram failed with code " + std::to_string(rc);
    return result;
  }
  int rc = n->CompileProgram(prog, (int)opts.size(), opts.data());
  size_t size = 0;
  if (n->GetProgramLogSize(prog, &size) == 0 && size > 1) {
    result.log.resize(size);
    n->GetProgramLog(prog, result.log.data());
    result.log.resize(size - 1);  // drop the terminating NUL
  }
  if (rc == 0 && n->GetCUBINSize(prog, &size) == 0 && size > 0) {
    result.cubin.resize(size);
    result.ok = n->GetCUBIN(prog, result.cubin.data()) == 0;
  } else if (rc != 0) {
    result.log = "NVRTC " + n->version + " failed to compile " + name + " for " + target +
                 " (code " + std::to_string(rc) + "):\n" + result.log;
  }
  n->DestroyProgram(&prog);
  return result;
}

}  // namespace fastattn::cuda
