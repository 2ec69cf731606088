#include "cuda/kernel_cache.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "cuda/kernel_sources.h"
#include "cuda/nvrtc.h"
#include "kernels/cuda/attention_common.cuh"

namespace fastattn::cuda {

namespace {

constexpr char kMagic[8] = {'F', 'A', 'C', 'U', 'B', 'I', 'N', '1'};

std::mutex cache_dir_mu;
std::string cache_dir;

uint64_t Fnv1a(const std::string& data, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : data) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string Hex(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

const std::string* FindSource(const std::string& name) {
  for (const auto& [file, text] : KernelSources()) {
    if (file == name) return &text;
  }
  return nullptr;
}

std::vector<std::string> Options(const KernelVariant& v) {
  std::vector<std::string> options = {"-std=c++17", "--ptxas-options=-v", "-lineinfo"};
  for (const std::string& d : v.Defines()) options.push_back(d);
  return options;
}

// Everything a cached module depends on; the file name is its hash and the
// file repeats it in full, so a hash collision reads as a miss.
std::string CacheKey(const KernelVariant& v, const std::string& target, const std::string& nvrtc) {
  std::string key = "fastattn_jax CUDA kernel\narch=" + target + "\nnvrtc=" + nvrtc +
                    "\nsource=" + v.SourceFile() + "\noptions=";
  for (const std::string& o : Options(v)) key += o + " ";
  key += "\nsources=";
  uint64_t h = Fnv1a("");
  for (const auto& [file, text] : KernelSources()) h = Fnv1a(text, Fnv1a(file, h));
  return key + Hex(h) + "\n";
}

// Entry file: magic, then three (u64 length, bytes) fields: key, log, cubin,
// then the FNV-1a hash of everything before it. Any entry that cannot be read
// as one (missing, a directory, no permission, truncated, corrupt) is a miss:
// the caller compiles in memory. Never throws (the FFI handlers call it).
bool ReadEntryOrThrow(const std::filesystem::path& file, const std::string& key,
                      CompiledKernel* out) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(file, ec);
  if (ec || status.type() == std::filesystem::file_type::not_found) return false;  // plain miss
  if (status.type() != std::filesystem::file_type::regular) {
    std::fprintf(stderr,
                 "fastattn_jax: warning: the kernel cache entry %s is not a regular file; "
                 "compiling in memory\n",
                 file.c_str());
    return false;
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    std::fprintf(stderr,
                 "fastattn_jax: warning: cannot read the kernel cache entry %s; compiling in "
                 "memory\n",
                 file.c_str());
    return false;
  }
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (data.size() < sizeof(kMagic) + 4 * 8 || std::memcmp(data.data(), kMagic, 8) != 0) {
    return false;
  }
  uint64_t stored_hash;
  std::memcpy(&stored_hash, data.data() + data.size() - 8, 8);
  std::string body = data.substr(0, data.size() - 8);
  if (Fnv1a(body) != stored_hash) return false;
  size_t pos = sizeof(kMagic);
  std::string fields[3];
  for (std::string& f : fields) {
    uint64_t len;
    if (pos + 8 > body.size()) return false;
    std::memcpy(&len, body.data() + pos, 8);
    pos += 8;
    if (len > body.size() - pos) return false;
    f = body.substr(pos, len);
    pos += len;
  }
  if (pos != body.size() || fields[0] != key || fields[2].empty()) return false;
  out->log = std::move(fields[1]);
  out->cubin = std::move(fields[2]);
  return true;
}

bool ReadEntry(const std::filesystem::path& file, const std::string& key, CompiledKernel* out) {
  try {
    return ReadEntryOrThrow(file, key, out);
  } catch (const std::exception& e) {  // e.g. std::ios_base::failure reading a directory
    std::fprintf(stderr,
                 "fastattn_jax: warning: cannot read the kernel cache entry %s (%s); compiling "
                 "in memory\n",
                 file.c_str(), e.what());
  } catch (...) {
    std::fprintf(stderr,
                 "fastattn_jax: warning: cannot read the kernel cache entry %s; compiling in "
                 "memory\n",
                 file.c_str());
  }
  out->log.clear();
  out->cubin.clear();
  return false;
}

// A failed write is reported once per folder and process, naming the entry
// and why, as the Ascend cache does (fastattn_jax/ascend): later kernels of
// the same run compile in memory as well, and would repeat the same words.
void WarnUnwritable(const std::filesystem::path& file, const std::string& why) {
  static std::mutex mu;
  static std::set<std::string> warned;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!warned.insert(file.parent_path().string()).second) return;
  }
  std::fprintf(stderr,
               "fastattn_jax: warning: cannot write the kernel cache entry %s%s%s; kernels "
               "compile in memory for this process (set FASTATTN_CACHE_DIR to a writable "
               "folder to keep them)\n",
               file.c_str(), why.empty() ? "" : ": ", why.c_str());
}

// Written to a unique temporary file, then renamed over the entry: readers
// see the old entry, the new one or none, never a partial one.
void WriteEntryOrThrow(const std::filesystem::path& file, const std::string& key,
                       const CompiledKernel& k) {
  std::error_code ec;
  std::filesystem::create_directories(file.parent_path(), ec);
  static std::atomic<int> counter{0};
  std::filesystem::path tmp = file;
  tmp += ".tmp." + std::to_string(getpid()) + "." + std::to_string(counter++);
  std::string body(kMagic, sizeof(kMagic));
  for (const std::string* f : {&key, &k.log, &k.cubin}) {
    uint64_t len = f->size();
    body.append(reinterpret_cast<const char*>(&len), 8);
    body += *f;
  }
  uint64_t h = Fnv1a(body);
  body.append(reinterpret_cast<const char*>(&h), 8);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out.write(body.data(), body.size()) || !out.flush()) {
      WarnUnwritable(tmp, ec ? ec.message() : "");
      out.close();
      std::filesystem::remove(tmp, ec);
      return;
    }
  }
  std::filesystem::rename(tmp, file, ec);
  if (ec) {
    WarnUnwritable(file, ec.message());
    std::filesystem::remove(tmp, ec);
  }
}

// A failed write (unwritable folder, a directory at the entry's path, a full
// disk) warns and leaves the cache as it was; it never throws.
void WriteEntry(const std::filesystem::path& file, const std::string& key,
                const CompiledKernel& k) {
  try {
    WriteEntryOrThrow(file, key, k);
  } catch (const std::exception& e) {
    WarnUnwritable(file, e.what());
  } catch (...) {
    WarnUnwritable(file, "");
  }
}

// Says what is being compiled if the compile is still running after a second,
// so a long first run does not look hung.
class SlowCompileNotice {
 public:
  explicit SlowCompileNotice(std::string what)
      : thread_([this, what = std::move(what)] {
          std::unique_lock<std::mutex> lock(mu_);
          if (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return done_; })) {
            std::fprintf(stderr, "fastattn_jax: compiling %s (once; cached on disk)...\n",
                         what.c_str());
          }
        }) {}
  ~SlowCompileNotice() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

void SetCacheDir(std::string dir) {
  std::lock_guard<std::mutex> lock(cache_dir_mu);
  cache_dir = std::move(dir);
}

bool GetCompiledKernel(const KernelVariant& v, int cc, CompiledKernel* out, std::string* error) {
  if (std::string why = v.Check(); !why.empty()) {
    *error = "invalid kernel variant " + v.Describe() + ": " + why;
    return false;
  }
  // wgmma exists only in the arch-specific sm_90a target, whose code runs on
  // compute capability 9.0 alone.
  const bool arch_specific = v.kernel_sm == 90;
  if (arch_specific && !fa_runs_on(v.kernel_sm, cc)) {
    *error = v.Describe() + " runs on " + NvrtcTarget(v.kernel_sm) + " (H100, H200) only, not " +
             NvrtcTarget(cc);
    return false;
  }
  const std::string target = NvrtcTarget(cc, arch_specific);
  std::string nvrtc = NvrtcVersionFor(cc, error);
  if (nvrtc.empty()) return false;
  const std::string key = CacheKey(v, target, nvrtc);
  std::filesystem::path file;
  {
    std::lock_guard<std::mutex> lock(cache_dir_mu);
    if (!cache_dir.empty()) file = std::filesystem::path(cache_dir) / (Hex(Fnv1a(key)) + ".cubin");
  }
  out->nvrtc = nvrtc;
  out->target = target;
  if (!file.empty() && ReadEntry(file, key, out)) {
    out->from_cache = true;
    out->seconds = 0;
    return true;
  }
  const std::string* source = FindSource(v.SourceFile());
  if (!source) {
    *error = "the extension was built without the CUDA kernel source " + v.SourceFile();
    return false;
  }
  // Every embedded header is offered to #include by file name.
  std::vector<std::pair<std::string, std::string>> headers;
  for (const auto& [file, text] : KernelSources()) {
    if (file.size() > 3 && file.compare(file.size() - 3, 3, ".cu") != 0) {
      headers.emplace_back(file, text);
    }
  }
  auto start = std::chrono::steady_clock::now();
  CompileResult r;
  {
    SlowCompileNotice notice(v.Describe() + " for " + target + " with NVRTC " + nvrtc);
    r = NvrtcCompile(cc, arch_specific, *source, v.SourceFile(), headers, Options(v));
  }
  if (!r.ok) {
    *error = r.log;
    return false;
  }
  out->cubin = std::move(r.cubin);
  out->log = std::move(r.log);
  out->from_cache = false;
  out->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!file.empty()) WriteEntry(file, key, *out);
  return true;
}

const LoadedKernel* GetLoadedKernel(const Driver& d, CUcontext context,
                                    const KernelVariant& v, std::string* error) {
  static std::mutex mu;
  static std::map<std::pair<CUcontext, int64_t>, std::unique_ptr<LoadedKernel>> loaded;
  std::lock_guard<std::mutex> lock(mu);
  const auto id = std::make_pair(context, v.Key());
  if (auto it = loaded.find(id); it != loaded.end()) return it->second.get();

  if (CUresult rc = d.cuCtxPushCurrent(context); rc != 0) {
    *error = DriverError(d, rc, "cuCtxPushCurrent");
    return nullptr;
  }
  auto kernel = std::make_unique<LoadedKernel>();
  kernel->context = context;
  kernel->variant = v;
  std::string err = [&]() -> std::string {
    CUdevice dev;
    int major = 0, minor = 0, smem_optin = 0;
    if (auto rc = d.cuCtxGetDevice(&dev)) return DriverError(d, rc, "cuCtxGetDevice");
    d.cuDeviceGetAttribute(&major, kAttrComputeCapabilityMajor, dev);
    d.cuDeviceGetAttribute(&minor, kAttrComputeCapabilityMinor, dev);
    d.cuDeviceGetAttribute(&smem_optin, kAttrMaxSharedMemoryPerBlockOptin, dev);
    d.cuDeviceGetAttribute(&kernel->multiprocessors, kAttrMultiprocessorCount, dev);
    kernel->cc = major * 10 + minor;
    kernel->tile = v.Tile(kernel->cc);
    CompiledKernel compiled;
    std::string e;
    if (!GetCompiledKernel(v, kernel->cc, &compiled, &e)) return e;
    CUmodule module;
    if (auto rc = d.cuModuleLoadData(&module, compiled.cubin.data())) {
      return DriverError(d, rc, "cuModuleLoadData");
    }
    const char* main = v.backward ? "fa_backward_dkdv" : "fa_forward";
    if (auto rc = d.cuModuleGetFunction(&kernel->function, module, main)) {
      return DriverError(d, rc, v.backward ? "cuModuleGetFunction(fa_backward_dkdv)"
                                           : "cuModuleGetFunction(fa_forward)");
    }
    if (v.backward == 1) {  // the atomic-dQ build (2) has no dQ pass
      if (auto rc = d.cuModuleGetFunction(&kernel->dq, module, "fa_backward_dq")) {
        return DriverError(d, rc, "cuModuleGetFunction(fa_backward_dq)");
      }
    } else if (!v.backward && !v.decode_rows) {
      if (auto rc = d.cuModuleGetFunction(&kernel->merge, module, "fa_merge")) {
        return DriverError(d, rc, "cuModuleGetFunction(fa_merge)");
      }
    }
    // The handler fills the parameters with this compiler's layout, the
    // kernel reads them with NVRTC's: they must agree.
    CUdeviceptr global;
    size_t bytes = 0;
    int params_bytes = 0;
    if (auto rc = d.cuModuleGetGlobal(&global, &bytes, module, "fa_params_bytes")) {
      return DriverError(d, rc, "cuModuleGetGlobal(fa_params_bytes)");
    }
    if (bytes != sizeof(int)) return "fa_params_bytes must be an int";
    if (auto rc = d.cuMemcpyDtoH(&params_bytes, global, sizeof(int))) {
      return DriverError(d, rc, "cuMemcpyDtoH(fa_params_bytes)");
    }
    const size_t host_bytes = v.backward      ? sizeof(FaGradParams)
                            : v.decode_rows ? sizeof(FaDecodeParams)
                                            : sizeof(FaParams);
    if (static_cast<size_t>(params_bytes) != host_bytes) {
      return v.Describe() + ": the kernel's parameters take " + std::to_string(params_bytes) +
             " bytes, the host's " + std::to_string(host_bytes);
    }
    if (kernel->tile.smem_bytes > smem_optin) {
      return v.Describe() + " needs " + std::to_string(kernel->tile.smem_bytes) +
             " bytes of shared memory per block; " + NvrtcTarget(kernel->cc) + " allows " +
             std::to_string(smem_optin);
    }
    // Needed above 48 KB of static plus dynamic shared memory (the decode
    // kernel has both); harmless below.
    if (kernel->tile.smem_bytes > 0) {
      for (CUfunction f : {kernel->function, kernel->dq}) {
        if (!f) continue;
        if (auto rc = d.cuFuncSetAttribute(f, kFuncAttrMaxDynamicSharedSizeBytes,
                                           kernel->tile.smem_bytes)) {
          return DriverError(d, rc, "cuFuncSetAttribute(max dynamic shared memory)");
        }
      }
    }
    if (auto rc = d.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            &kernel->blocks_per_sm, kernel->function, kernel->tile.threads,
            kernel->tile.smem_bytes)) {
      return DriverError(d, rc, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    }
    if (kernel->blocks_per_sm < 1) {
      return v.Describe() + " cannot run a block on " + NvrtcTarget(kernel->cc);
    }
    return "";
  }();
  CUcontext popped;
  d.cuCtxPopCurrent(&popped);
  if (!err.empty()) {
    *error = err;
    return nullptr;
  }
  return loaded.emplace(id, std::move(kernel)).first->second.get();
}

}  // namespace fastattn::cuda
