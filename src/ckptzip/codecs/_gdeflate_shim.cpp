// A C ABI over nvCOMP's CPU GDeflate encoder (libnvcomp_cpu, nvcomp/native/gdeflate_cpu.h),
// loaded at run time: ckptzip.codecs.gdeflate_cpu encodes through these, by ctypes (it decodes
// with ckptzip's own decoder, _gdeflate.c).
//
// nvCOMP declares its CPU GDeflate API only in C++ and reports errors by throwing
// nvcomp::NVCompException; an exception unwinding into ctypes' frames aborts the process. Every
// call below catches whatever is thrown and returns it as an error code and message instead.
// The library is dlopen'ed from a path Python chooses, so building this needs no nvCOMP.

#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <exception>

namespace {

using MaxOutputFn = void (*)(size_t, size_t *);
using CompressFn = void (*)(const void *const *, const size_t *, size_t, size_t, void *const *, size_t *, int);

// Itanium C++ ABI names of nvcomp::gdeflate::{compressCPUGetMaxOutputChunkSize, compressCPU}
// (size_t is unsigned long on the 64-bit Linux targets).
constexpr const char *kMaxOutput = "_ZN6nvcomp8gdeflate32compressCPUGetMaxOutputChunkSizeEmPm";
constexpr const char *kCompress = "_ZN6nvcomp8gdeflate11compressCPUEPKPKvPKmmmPKPvPmi";

MaxOutputFn max_output = nullptr;
CompressFn compress = nullptr;

void say(char *err, size_t errlen, const char *what) {
    if (err != nullptr && errlen > 0) std::snprintf(err, errlen, "%s", what);
}

template <typename Call>
int guarded(char *err, size_t errlen, Call call) noexcept {
    if (compress == nullptr) {
        say(err, errlen, "libnvcomp_cpu is not loaded");
        return 2;
    }
    try {
        call();
        return 0;
    } catch (const std::exception &e) {
        say(err, errlen, e.what());
    } catch (...) {
        say(err, errlen, "libnvcomp_cpu raised a non-standard exception");
    }
    return 1;
}

}  // namespace

extern "C" {

// Load the library at ``path`` and its two functions; 0 on success (idempotent: the caller
// serialises it, and a second call with the same library is a no-op).
int ckz_gdeflate_load(const char *path, char *err, size_t errlen) noexcept {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        const char *why = dlerror();
        say(err, errlen, why != nullptr ? why : "dlopen failed");
        return 1;
    }
    auto m = reinterpret_cast<MaxOutputFn>(dlsym(lib, kMaxOutput));
    auto c = reinterpret_cast<CompressFn>(dlsym(lib, kCompress));
    if (m == nullptr || c == nullptr) {
        say(err, errlen, "the library lacks nvcomp::gdeflate's CPU functions (nvCOMP >= 5 has them)");
        dlclose(lib);
        return 1;
    }
    max_output = m;
    compress = c;
    return 0;
}

int ckz_gdeflate_max_output(size_t chunk_bytes, size_t *bound, char *err, size_t errlen) noexcept {
    return guarded(err, errlen, [&] { max_output(chunk_bytes, bound); });
}

int ckz_gdeflate_compress(const void *const *in_ptr, const size_t *in_bytes, size_t max_chunk_bytes, size_t count,
                          void *const *out_ptr, size_t *out_bytes, int level, char *err, size_t errlen) noexcept {
    return guarded(err, errlen, [&] { compress(in_ptr, in_bytes, max_chunk_bytes, count, out_ptr, out_bytes, level); });
}

}  // extern "C"
