/* The put arena's check, compiled (issue 42): whether the membership filter's "absent"
 * for a key may be trusted now -- no other connection's placement pending in the
 * placement journal (read first), and the filter live with one of the key's two
 * counters zero. One call instead of ~5 Python frames and ~12 calls, which in a
 * process that just woke up cost 19-47 us of an arena put (docs/performance.md).
 *
 * The Python reader is the reference and the fallback: Journal.any_unsettled and
 * FilterReader.maybe (connector/client/mappings.py: Mappings.proven_absent); the
 * property test in tests/test_placement_check.py compares both on random words.
 *
 * What keeps it right:
 * - the journal is read before the filter (journal.py's protocol: a slot that shows
 *   settled was written after the filter add, so a filter read that follows it sees
 *   the key); a compiler barrier keeps that order, x86-TSO keeps loads in order, and
 *   the filter (like the residency index) is used by clients on x86-64 only;
 * - nothing is written; every read is inside the mappings whose sizes the caller
 *   passes (checked here: `bound` is clamped to nslots, as in Python), and the caller
 *   holds the objects that keep the mappings alive as an argument during the call.
 */
#include "_shm_read.h"

/* journal.py's layout: PLACED_BYTES, SETTLED_BYTES and the word offsets in a slot */
#define PLACED_BYTES 4
#define SETTLED_BYTES 16
#define SETTLED_AT 0
#define DISTRUSTED_AT 4
#define HELD_AT 12
/* filter.py's layout: HEADER_SIZE, _FLAGS_OFFSET (one byte compared), FLAG_LIVE */
#define FILTER_HEADER 64
#define FILTER_FLAGS_AT 20
#define FILTER_LIVE 1

static inline uint32_t u32_at(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v; /* little-endian words, read on a little-endian CPU */
}

/* Journal.any_unsettled(own_slot): a held slot other than own_slot, not distrusted,
 * whose placed word differs from its settled word. */
static int any_unsettled(const unsigned char *placed, const unsigned char *settled,
                         uint64_t nslots, int64_t own_slot) {
    uint64_t bound = u32_at(settled + nslots * SETTLED_BYTES);
    if (bound > nslots)
        bound = nslots;
    for (uint64_t slot = 0; slot < bound; slot++) {
        const unsigned char *w = settled + slot * SETTLED_BYTES;
        if ((int64_t)slot != own_slot && u32_at(placed + slot * PLACED_BYTES) != u32_at(w + SETTLED_AT) &&
            u32_at(w + HELD_AT) && !u32_at(w + DISTRUSTED_AT))
            return 1;
    }
    return 0;
}

/* proven_absent(keep, placed, settled, nslots, own_slot, filter, filter_size, mask, digest)
 *   keep: the objects holding exports of the mappings (unused here: held as an argument
 *   so that no mapping can close during the call); placed, settled: the journal's two
 *   segments' addresses (placed 0: no connection holds an arena, nothing to scan);
 *   nslots: the journal's slot count (placed holds nslots words, settled nslots slots
 *   and then `bound`); own_slot: the caller's slot (-1: none); filter, filter_size: the
 *   filter mapping; mask: its slot count - 1; digest: filter.key_digest(key, seed), 8
 *   bytes. -> True when the filter's "absent" holds: nothing pending elsewhere, the
 *   filter live, one of the key's counters zero. */
static PyObject *proven_absent(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (arity("proven_absent", nargs, 9) < 0)
        return NULL;
    uint64_t placed, settled, nslots, filter, filter_size, mask;
    long long own_slot = PyLong_AsLongLong(args[4]);
    if (own_slot == -1 && PyErr_Occurred())
        return NULL;
    char *digest;
    Py_ssize_t dlen;
    if (as_u64(args[1], &placed) || as_u64(args[2], &settled) || as_u64(args[3], &nslots) ||
        as_u64(args[5], &filter) || as_u64(args[6], &filter_size) || as_u64(args[7], &mask) ||
        PyBytes_AsStringAndSize(args[8], &digest, &dlen) < 0)
        return NULL;
    if (dlen != 8 || !filter || filter_size < FILTER_HEADER || mask >= filter_size - FILTER_HEADER ||
        (placed && (!settled || !nslots)))
        Py_RETURN_FALSE; /* nothing proven: ask the broker */
    if (placed && any_unsettled((const unsigned char *)(uintptr_t)placed,
                                (const unsigned char *)(uintptr_t)settled, nslots, own_slot))
        Py_RETURN_FALSE;
    BARRIER(); /* the journal first, then the filter (journal.py's protocol) */
    const unsigned char *f = (const unsigned char *)(uintptr_t)filter;
    if (f[FILTER_FLAGS_AT] != FILTER_LIVE)
        Py_RETURN_FALSE; /* dead or partial: absences prove nothing */
    uint32_t a = u32_at((const unsigned char *)digest), b = u32_at((const unsigned char *)digest + 4);
    if (f[FILTER_HEADER + (a & mask)] && f[FILTER_HEADER + (b & mask)])
        Py_RETURN_FALSE; /* maybe present */
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"proven_absent", (PyCFunction)(void (*)(void))proven_absent, METH_FASTCALL,
     "Whether the membership filter's absent holds for a key now."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_placement_check",
    "The put arena's check, compiled (see connector/client/mappings.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__placement_check(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    PyObject *layout = Py_BuildValue("(iiiiiiii)", PLACED_BYTES, SETTLED_BYTES, SETTLED_AT,
                                     DISTRUSTED_AT, HELD_AT, FILTER_HEADER, FILTER_FLAGS_AT,
                                     FILTER_LIVE);
    if (!layout || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
