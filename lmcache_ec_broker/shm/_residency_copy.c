/* The residency index's get_into hot path, compiled (issue 42): find a key's slot,
 * check it, copy the entry into the caller's buffer, confirm the slot's seqlock.
 *
 * The Python reader (residency.py: ResidencyReader.find, ._checked, .unchanged, and
 * copy.py's SlabView.read_into) is the reference; this does exactly what they do, in
 * one call instead of ~20 Python-level steps, which in a process that just woke up
 * cost tens of microseconds (docs/performance.md, "A compiled index read"). Every
 * answer is one of:
 *   ABSENT  (0): nothing was written to the destination (no slot holds the key, the
 *                slot changed while read, a field is out of range, or the entry's
 *                dtype/shape/size differ from the destination's): ask the broker;
 *   COPIED  (1): the destination holds the entry's bytes, and the slot's seq was the
 *                same even value before the fields were read and after the copy;
 *   CHANGED (2): the destination was written but the slot changed (or the index died)
 *                during the copy: its bytes must not be shown.
 *
 * What keeps it safe (the module doc of residency.py has the seqlock argument):
 * - the index is another process's memory: every slot offset is checked against the
 *   mapping's length, every extent against the slab's size, and their sum against the
 *   destination's byte count before a byte is copied; the key's length is checked
 *   before it is compared;
 * - the destination is the caller's contiguous CPU tensor of exactly `nbytes` bytes
 *   (the caller checks contiguity and device); nothing else is ever written;
 * - loads of `seq` are single aligned 8-byte volatile loads, and compiler barriers keep
 *   the field reads and the copy between the two loads of `seq`. The CPU keeps loads in
 *   order on x86-64 (TSO); the reader is used only there (residency.usable_here).
 */
/* The stable ABI of CPython 3.10 (pyproject.toml: one abi3 wheel per platform). */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The layout (residency.py's HEADER_SIZE, SLOT_BYTES, _FIXED, KEY_AT, PROBES, ...). */
#define HEADER_SIZE 64
#define FLAGS_AT 16
#define FLAG_LIVE 1u
#define SLOT_BYTES 256
#define NBYTES_AT 16
#define KEYLEN_AT 24
#define DTYPE_AT 26
#define NDIM_AT 27
#define NEXTENTS_AT 28
#define SHAPE_AT 32
#define EXTENTS_AT 80
#define KEY_AT 144
#define KEY_CAP (SLOT_BYTES - KEY_AT)
#define MAX_DIMS 6
#define MAX_EXTENTS 4
#define PROBES 8
/* Copies from this size release the GIL (ctypes.memmove always did; small copies are
 * over before another thread could use it). */
#define RELEASE_GIL_FROM (256 << 10)

enum { ABSENT = 0, COPIED = 1, CHANGED = 2 };

#define BARRIER() __asm__ __volatile__("" ::: "memory")

static inline uint64_t load_seq(const unsigned char *at) {
    return *(volatile const uint64_t *)at;
}

static inline int live(const unsigned char *index) {
    uint32_t flags;
    memcpy(&flags, index + FLAGS_AT, 4);
    return (flags & FLAG_LIVE) != 0;
}

static inline uint64_t u64_at(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The slot's entry checked against the destination; the extents copied out into
 * `ext` (pairs), their count returned, 0 when anything does not match. Reads only
 * the slot (a snapshot; its seq is confirmed by the caller afterwards). */
static unsigned checked_extents(const unsigned char *at, uint64_t slab_size, uint64_t nbytes,
                                unsigned dtype, const uint64_t *shape, Py_ssize_t ndim,
                                uint64_t *ext) {
    unsigned next = at[NEXTENTS_AT];
    if (at[DTYPE_AT] != dtype || at[NDIM_AT] != ndim || next < 1 || next > MAX_EXTENTS)
        return 0;
    if (u64_at(at + NBYTES_AT) != nbytes)
        return 0;
    for (Py_ssize_t d = 0; d < ndim; d++)
        if (u64_at(at + SHAPE_AT + 8 * d) != shape[d])
            return 0;
    uint64_t total = 0;
    for (unsigned j = 0; j < next; j++) {
        uint64_t off = u64_at(at + EXTENTS_AT + 16 * j), n = u64_at(at + EXTENTS_AT + 16 * j + 8);
        if (n == 0 || off > slab_size || n > slab_size - off || n > nbytes - total)
            return 0;
        ext[2 * j] = off;
        ext[2 * j + 1] = n;
        total += n;
    }
    return total == nbytes ? next : 0;
}

static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* copy_into(view, index, index_size, mask, home, key, slab, slab_size, dst, nbytes, dtype,
 *           shape)
 *   view: the object holding an export of the index mapping (ResidencyReader._view);
 *   unused here but held as an argument, so the mapping cannot be closed during the
 *   call; index, index_size: the index mapping's address and length;
 *   mask: the index's slot count - 1; home: the key's home slot (xxh3 of the key
 *   with the index's seed, masked);
 *   key: the key's UTF-8 bytes; slab, slab_size: the slab mapping's address and size;
 *   dst, nbytes: the destination's address and byte count; dtype: the destination's
 *   dtype code (residency.DTYPE_CODE); shape: the destination's shape (a tuple of ints).
 *   -> ABSENT, COPIED or CHANGED. */
static PyObject *copy_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "copy_into takes 12 arguments");
        return NULL;
    }
    uint64_t index_addr, index_size, mask, home, slab_base, slab_size, dst, nbytes, dtype;
    if (as_u64(args[1], &index_addr) || as_u64(args[2], &index_size) || as_u64(args[3], &mask) ||
        as_u64(args[4], &home) || as_u64(args[6], &slab_base) || as_u64(args[7], &slab_size) ||
        as_u64(args[8], &dst) || as_u64(args[9], &nbytes) || as_u64(args[10], &dtype))
        return NULL;
    char *key;
    Py_ssize_t klen;
    if (PyBytes_AsStringAndSize(args[5], &key, &klen) < 0)
        return NULL;
    Py_ssize_t ndim = PyTuple_Size(args[11]);
    if (ndim < 0)
        return NULL;
    uint64_t shape[MAX_DIMS];
    if (klen <= 0 || klen > KEY_CAP || ndim > MAX_DIMS || !dtype || dtype > 255 || !dst || !index_addr ||
        index_size < HEADER_SIZE || mask >= (index_size - HEADER_SIZE) / SLOT_BYTES)
        return PyLong_FromLong(ABSENT); /* every slot the probe can reach is mapped */
    for (Py_ssize_t d = 0; d < ndim; d++)
        if (as_u64(PyTuple_GetItem(args[11], d), &shape[d]))
            return NULL;

    const unsigned char *index = (const unsigned char *)(uintptr_t)index_addr;
    if (!live(index))
        return PyLong_FromLong(ABSENT);
    for (uint64_t i = 0; i < PROBES; i++) {
        uint64_t slot = (home + i) & mask;
        const unsigned char *at = index + HEADER_SIZE + slot * SLOT_BYTES;
        uint64_t seq = load_seq(at);
        if (seq & 1)
            continue;
        BARRIER();
        uint16_t keylen;
        memcpy(&keylen, at + KEYLEN_AT, 2);
        if (keylen != klen || memcmp(at + KEY_AT, key, (size_t)klen) != 0)
            continue;
        uint64_t ext[2 * MAX_EXTENTS];
        unsigned next = checked_extents(at, slab_size, nbytes, (unsigned)dtype, shape, ndim, ext);
        BARRIER();
        if (load_seq(at) != seq || !next)
            return PyLong_FromLong(ABSENT); /* rewritten under us, or another entry: ask */
        unsigned char *out = (unsigned char *)(uintptr_t)dst;
        const unsigned char *slab = (const unsigned char *)(uintptr_t)slab_base;
        if (nbytes >= RELEASE_GIL_FROM) {
            Py_BEGIN_ALLOW_THREADS
            for (unsigned j = 0; j < next; j++) {
                memcpy(out, slab + ext[2 * j], ext[2 * j + 1]);
                out += ext[2 * j + 1];
            }
            Py_END_ALLOW_THREADS
        } else {
            for (unsigned j = 0; j < next; j++) {
                memcpy(out, slab + ext[2 * j], ext[2 * j + 1]);
                out += ext[2 * j + 1];
            }
        }
        BARRIER();
        return PyLong_FromLong(load_seq(at) == seq && live(index) ? COPIED : CHANGED);
    }
    return PyLong_FromLong(ABSENT);
}

static PyMethodDef methods[] = {
    {"copy_into", (PyCFunction)(void (*)(void))copy_into, METH_FASTCALL,
     "Copy an indexed entry into a destination buffer; ABSENT, COPIED or CHANGED."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_residency_copy",
    "The residency index's get_into hot path, compiled (see residency.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__residency_copy(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (m && (PyModule_AddIntConstant(m, "ABSENT", ABSENT) || PyModule_AddIntConstant(m, "COPIED", COPIED) ||
              PyModule_AddIntConstant(m, "CHANGED", CHANGED))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
