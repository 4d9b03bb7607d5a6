/* A put's copy into the slab with non-temporal stores (issue 42).
 *
 * A put writes slab blocks no cache line holds: the slab is larger than the CPU's
 * caches and a block is rewritten long after it was last touched. An ordinary copy
 * (glibc's memmove: `rep movsb` here; its own non-temporal path starts at
 * x86_non_temporal_threshold, 240 MiB on these VMs, whose hypervisor reports a 320 MiB
 * cache) first reads every destination line from memory to own it, then writes it.
 * Non-temporal stores write whole lines without reading them, and leave the writer's
 * caches -- the engine's working set -- as they were. Measured through a real broker
 * (benchmarks/shm_floor_probe.py, docs/performance.md): a put of 8 MiB 1.2-1.4x faster,
 * of 34 MiB 1.4-1.5x; a reader that copies the entry out at once then reads it from
 * memory, not the shared cache -- at 1-2 MiB it loses more than the put gains, from
 * 4 MiB the pair is faster. So the client streams only puts of SlabView.stream_min
 * (4 MiB) or more.
 *
 * What keeps it right:
 * - the copy ends with SFENCE: non-temporal stores are weakly ordered, and the frame
 *   the client sends after the copy (Place or Commit) makes the block readable by other
 *   processes; every byte must be globally visible before that frame is written;
 * - only the destination range is written, head and tail (the parts not aligned to
 *   32 bytes) with memcpy; overlapping ranges (never a put's, but a caller could build a
 *   tensor over the mapping) are copied with memmove, as before;
 * - the GIL is released for the copy only: no Python object is touched.
 */
#include "_shm_read.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define STREAM_X86 1
#endif

enum { KIND_MEMMOVE = 0, KIND_SSE2 = 1, KIND_AVX2 = 2 };

#ifdef STREAM_X86
/* dst is 32-byte aligned, n a multiple of 128. */
static void stream_sse2(unsigned char *dst, const unsigned char *src, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        __m128i v[8];
        for (int k = 0; k < 8; k++)
            v[k] = _mm_loadu_si128((const __m128i *)(src + i + 16 * k));
        for (int k = 0; k < 8; k++)
            _mm_stream_si128((__m128i *)(dst + i + 16 * k), v[k]);
    }
}

__attribute__((target("avx2"))) static void stream_avx2(unsigned char *dst,
                                                        const unsigned char *src, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
}
#endif

static int best_kind(void) {
#ifdef STREAM_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? KIND_AVX2 : KIND_SSE2;
#else
    return KIND_MEMMOVE;
#endif
}

static int BEST;

static void copy(unsigned char *dst, const unsigned char *src, size_t n, int kind) {
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (kind == KIND_MEMMOVE || (d < s + n && s < d + n) || n < 256) {
        memmove(dst, src, n);
        return;
    }
#ifdef STREAM_X86
    size_t head = (32 - (d & 31)) & 31;
    memcpy(dst, src, head);
    size_t body = (n - head) & ~(size_t)127;
    if (kind == KIND_AVX2)
        stream_avx2(dst + head, src + head, body);
    else
        stream_sse2(dst + head, src + head, body);
    memcpy(dst + head + body, src + head + body, n - head - body);
    _mm_sfence(); /* every byte visible before the frame that publishes the block */
#endif
}

/* stream_copy(dst, src, n[, kind]): copy n bytes from address src to address dst.
 * kind: KIND_* (default: the best this CPU has, BEST); a kind this CPU lacks raises. */
static PyObject *stream_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "stream_copy takes 3 or 4 arguments");
        return NULL;
    }
    uint64_t dst, src, n, kind = (uint64_t)BEST;
    if (as_u64(args[0], &dst) || as_u64(args[1], &src) || as_u64(args[2], &n) ||
        (nargs == 4 && as_u64(args[3], &kind)))
        return NULL;
    if (kind > (uint64_t)BEST) {
        PyErr_Format(PyExc_ValueError, "copy kind %llu is not available on this CPU (best: %d)",
                     (unsigned long long)kind, BEST);
        return NULL;
    }
    if (n && (!dst || !src)) {
        PyErr_SetString(PyExc_ValueError, "stream_copy: a null address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    copy((unsigned char *)(uintptr_t)dst, (const unsigned char *)(uintptr_t)src, (size_t)n, (int)kind);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stream_copy", (PyCFunction)(void (*)(void))stream_copy, METH_FASTCALL,
     "stream_copy(dst, src, n[, kind]): copy n bytes with non-temporal stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_stream_copy",
    "A put's copy into the slab with non-temporal stores (see connector/client/copy.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stream_copy(void) {
    BEST = best_kind();
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "MEMMOVE", KIND_MEMMOVE) < 0 ||
        PyModule_AddIntConstant(m, "SSE2", KIND_SSE2) < 0 ||
        PyModule_AddIntConstant(m, "AVX2", KIND_AVX2) < 0 ||
        PyModule_AddIntConstant(m, "BEST", BEST) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
