/* The residency index's read hot path, compiled (issue 42): `contains` (has()), `find`
 * (a key's slot, checked) and `copy_into` (find, check against the destination, copy
 * the entry into the caller's buffer, confirm the slot's seqlock).
 *
 * The Python reader (residency.py: ResidencyReader._find_python, ._checked, .unchanged,
 * and copy.py's SlabView.read_into) is the reference; this does exactly what they do, in
 * one call instead of ~20 Python-level steps, which in a process that just woke up cost
 * tens of microseconds (docs/performance.md, "A compiled index read"). The layout
 * constants below are residency.py's: LAYOUT exports them, and residency.py uses this
 * module only when they match. copy_into's answer is one of:
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
 * - the slab and the destination are not held by the call (only their addresses are
 *   passed), and copies from RELEASE_GIL_FROM bytes release the GIL: they stay mapped
 *   and allocated because the caller holds the client's lock (ClientLink.lock), the
 *   only lock under which Mappings.close() unmaps the slab, and owns the destination
 *   tensor (as for ctypes.memmove, the Python path's copy, which releases the GIL too);
 * - loads of `seq` are single aligned 8-byte volatile loads, and compiler barriers keep
 *   the field reads and the copy between the two loads of `seq`. The CPU keeps loads in
 *   order on x86-64 (TSO); the reader is used only there (residency.usable_here).
 */
#include "_shm_read.h"

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

/* One slot's fixed fields, read between two loads of its seq that saw the same even
 * value (so they are one publish's, untorn). */
typedef struct {
    uint64_t gen, nbytes, shape[MAX_DIMS], ext[2 * MAX_EXTENTS];
    unsigned dtype, ndim, next;
} Entry;

/* The slot holding `key` (its offset in the index), its seq and a snapshot of its
 * fields in *e; -1 when no slot holds it or the slot changed while it was read (both:
 * ask the broker). As ResidencyReader._find_python: odd slots are skipped, a slot whose
 * key matches ends the probe. The caller checked that every probed slot is mapped. */
static int64_t probe(const unsigned char *index, uint64_t mask, uint64_t home, const char *key,
                     Py_ssize_t klen, Entry *e, uint64_t *seq_out) {
    for (uint64_t i = 0; i < PROBES; i++) {
        uint64_t off = HEADER_SIZE + ((home + i) & mask) * SLOT_BYTES;
        const unsigned char *at = index + off;
        uint64_t seq = load_seq(at);
        if (seq & 1)
            continue;
        BARRIER();
        uint16_t keylen;
        memcpy(&keylen, at + KEYLEN_AT, 2);
        if (keylen != klen || memcmp(at + KEY_AT, key, (size_t)klen) != 0)
            continue;
        e->gen = u64_at(at + 8);
        e->nbytes = u64_at(at + NBYTES_AT);
        e->dtype = at[DTYPE_AT];
        e->ndim = at[NDIM_AT];
        e->next = at[NEXTENTS_AT];
        memcpy(e->shape, at + SHAPE_AT, sizeof e->shape);
        memcpy(e->ext, at + EXTENTS_AT, sizeof e->ext);
        BARRIER();
        if (load_seq(at) != seq)
            return -1;
        *seq_out = seq;
        return (int64_t)off;
    }
    return -1;
}

/* Whether the entry's extents lie in a slab of `slab_size` bytes and cover exactly its
 * nbytes (ResidencyReader._checked's extent rule). */
static int extents_ok(const Entry *e, uint64_t slab_size) {
    if (e->next < 1 || e->next > MAX_EXTENTS)
        return 0;
    uint64_t total = 0;
    for (unsigned j = 0; j < e->next; j++) {
        uint64_t off = e->ext[2 * j], n = e->ext[2 * j + 1];
        if (n == 0 || off > slab_size || n > slab_size - off || n > e->nbytes - total)
            return 0; /* past the slab, or more than nbytes (total <= nbytes holds) */
        total += n;
    }
    return total == e->nbytes;
}

/* The arguments both functions start with: view, index, index_size, mask, home, key.
 *   view: the object holding an export of the index mapping (ResidencyReader._view),
 *   unused here but held as an argument, so the mapping cannot be closed during the
 *   call; index, index_size: the mapping's address and length; mask: the index's slot
 *   count - 1; home: the key's home slot (xxh3 of the key with the index's seed,
 *   masked); key: the key's UTF-8 bytes. 1: go on; 0: the answer is "absent"; -1: an
 *   exception is set. */
static int index_args(PyObject *const *args, const unsigned char **index, uint64_t *mask,
                      uint64_t *home, char **key, Py_ssize_t *klen) {
    uint64_t addr, size;
    if (as_u64(args[1], &addr) || as_u64(args[2], &size) || as_u64(args[3], mask) ||
        as_u64(args[4], home) || PyBytes_AsStringAndSize(args[5], key, klen) < 0)
        return -1;
    /* every slot the probe can reach is mapped; the key fits a slot */
    if (!addr || size < HEADER_SIZE || *mask >= (size - HEADER_SIZE) / SLOT_BYTES ||
        *klen <= 0 || *klen > KEY_CAP)
        return 0;
    *index = (const unsigned char *)(uintptr_t)addr;
    return live(*index);
}

/* contains(view, index, index_size, mask, home, key) -> bool: whether a slot held `key`
 * with the same even seq before and after its fields were read (has() needs no more:
 * a get checks every field it copies by). */
static PyObject *contains(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (arity("contains", nargs, 6) < 0)
        return NULL;
    const unsigned char *index;
    uint64_t mask, home, seq;
    char *key;
    Py_ssize_t klen;
    int go = index_args(args, &index, &mask, &home, &key, &klen);
    if (go < 0)
        return NULL;
    Entry e;
    return PyBool_FromLong(go && probe(index, mask, home, key, klen, &e, &seq) >= 0);
}

/* find(view, index, index_size, mask, home, key, slab_size, itemsizes)
 *   itemsizes: bytes, the item size of each dtype code (0: no such code).
 *   -> None, or (at, seq, gen, nbytes, dtype code, shape, extents): the slot's entry,
 *   checked as ResidencyReader._checked checks it (a known dtype, at most MAX_DIMS dims,
 *   1..MAX_EXTENTS extents inside the slab covering nbytes, nbytes = the shape's
 *   elements times the item size). */
static PyObject *find(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (arity("find", nargs, 8) < 0)
        return NULL;
    const unsigned char *index;
    uint64_t mask, home, slab_size, seq;
    char *key, *itemsizes;
    Py_ssize_t klen, ncodes;
    int go = index_args(args, &index, &mask, &home, &key, &klen);
    if (go < 0 || as_u64(args[6], &slab_size) ||
        PyBytes_AsStringAndSize(args[7], &itemsizes, &ncodes) < 0)
        return NULL;
    Entry e;
    int64_t at = go ? probe(index, mask, home, key, klen, &e, &seq) : -1;
    if (at < 0 || e.dtype == 0 || e.dtype >= (uint64_t)ncodes || !itemsizes[e.dtype] ||
        e.ndim > MAX_DIMS || !extents_ok(&e, slab_size))
        Py_RETURN_NONE;
    uint64_t count = (unsigned char)itemsizes[e.dtype];
    for (unsigned d = 0; d < e.ndim; d++)
        if (__builtin_mul_overflow(count, e.shape[d], &count))
            Py_RETURN_NONE; /* more than 2**64 bytes: not nbytes */
    if (count != e.nbytes)
        Py_RETURN_NONE;
    PyObject *shape = PyTuple_New(e.ndim), *extents = PyTuple_New(e.next);
    if (!shape || !extents)
        goto fail;
    for (unsigned d = 0; d < e.ndim; d++) {
        PyObject *v = PyLong_FromUnsignedLongLong(e.shape[d]);
        if (!v || PyTuple_SetItem(shape, d, v) < 0)
            goto fail;
    }
    for (unsigned j = 0; j < e.next; j++) {
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)e.ext[2 * j],
                                       (unsigned long long)e.ext[2 * j + 1]);
        if (!pair || PyTuple_SetItem(extents, j, pair) < 0)
            goto fail;
    }
    return Py_BuildValue("(LKKKINN)", (long long)at, (unsigned long long)seq,
                         (unsigned long long)e.gen, (unsigned long long)e.nbytes, e.dtype, shape,
                         extents);
fail:
    Py_XDECREF(shape);
    Py_XDECREF(extents);
    return NULL;
}

/* copy_into(view, index, index_size, mask, home, key, slab, slab_size, dst, nbytes, dtype,
 *           shape)
 *   slab, slab_size: the slab mapping's address and size; dst, nbytes: the destination's
 *   address and byte count; dtype: the destination's dtype code (residency.DTYPE_CODE);
 *   shape: the destination's shape (a tuple of ints). -> ABSENT, COPIED or CHANGED. */
static PyObject *copy_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (arity("copy_into", nargs, 12) < 0)
        return NULL;
    const unsigned char *index;
    uint64_t mask, home, slab_base, slab_size, dst, nbytes, dtype, shape[MAX_DIMS], seq;
    char *key;
    Py_ssize_t klen;
    int go = index_args(args, &index, &mask, &home, &key, &klen);
    if (go < 0 || as_u64(args[6], &slab_base) || as_u64(args[7], &slab_size) ||
        as_u64(args[8], &dst) || as_u64(args[9], &nbytes) || as_u64(args[10], &dtype))
        return NULL;
    Py_ssize_t ndim = PyTuple_Size(args[11]);
    if (ndim < 0)
        return NULL;
    if (!go || ndim > MAX_DIMS || !dtype || dtype > 255 || !dst)
        return PyLong_FromLong(ABSENT);
    for (Py_ssize_t d = 0; d < ndim; d++)
        if (as_u64(PyTuple_GetItem(args[11], d), &shape[d]))
            return NULL;
    Entry e;
    int64_t off = probe(index, mask, home, key, klen, &e, &seq);
    if (off < 0 || e.dtype != dtype || e.ndim != ndim || e.nbytes != nbytes ||
        !extents_ok(&e, slab_size))
        return PyLong_FromLong(ABSENT); /* not indexed, changed, or another entry: ask */
    for (Py_ssize_t d = 0; d < ndim; d++)
        if (e.shape[d] != shape[d])
            return PyLong_FromLong(ABSENT);
    const unsigned char *at = index + off;
    unsigned char *out = (unsigned char *)(uintptr_t)dst;
    const unsigned char *slab = (const unsigned char *)(uintptr_t)slab_base;
    if (nbytes >= RELEASE_GIL_FROM) {
        Py_BEGIN_ALLOW_THREADS
        for (unsigned j = 0; j < e.next; j++) {
            memcpy(out, slab + e.ext[2 * j], e.ext[2 * j + 1]);
            out += e.ext[2 * j + 1];
        }
        Py_END_ALLOW_THREADS
    } else {
        for (unsigned j = 0; j < e.next; j++) {
            memcpy(out, slab + e.ext[2 * j], e.ext[2 * j + 1]);
            out += e.ext[2 * j + 1];
        }
    }
    BARRIER();
    return PyLong_FromLong(load_seq(at) == seq && live(index) ? COPIED : CHANGED);
}

static PyMethodDef methods[] = {
    {"contains", (PyCFunction)(void (*)(void))contains, METH_FASTCALL,
     "Whether a slot holds the key, read consistently."},
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL,
     "The checked entry of an indexed key, or None."},
    {"copy_into", (PyCFunction)(void (*)(void))copy_into, METH_FASTCALL,
     "Copy an indexed entry into a destination buffer; ABSENT, COPIED or CHANGED."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_residency_copy",
    "The residency index's read hot path, compiled (see residency.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__residency_copy(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    PyObject *layout = Py_BuildValue(
        "(iiiiiiiiiiiiiiii)", HEADER_SIZE, FLAGS_AT, (int)FLAG_LIVE, SLOT_BYTES, NBYTES_AT,
        KEYLEN_AT, DTYPE_AT, NDIM_AT, NEXTENTS_AT, SHAPE_AT, EXTENTS_AT, KEY_AT, KEY_CAP,
        MAX_DIMS, MAX_EXTENTS, PROBES);
    if (!layout || PyModule_AddObject(m, "LAYOUT", layout) < 0) { /* steals on success */
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    if ((PyModule_AddIntConstant(m, "ABSENT", ABSENT) || PyModule_AddIntConstant(m, "COPIED", COPIED) ||
              PyModule_AddIntConstant(m, "CHANGED", CHANGED))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
