/* What the client's compiled shared-memory parts share (_residency_copy.c,
 * _placement_check.c, _stream_copy.c): the stable ABI they are built against, the compiler barrier
 * that keeps their loads in program order, and their argument helpers. */
#ifndef LMCACHE_EC_SHM_READ_H
#define LMCACHE_EC_SHM_READ_H

/* The stable ABI of CPython 3.10 (setup.py: one abi3 wheel per platform). */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Keeps the compiler from moving loads across it; the CPU keeps them in order on
 * x86-64 (TSO), the only place clients read these segments (residency.usable_here). */
#define BARRIER() __asm__ __volatile__("" ::: "memory")

/* An unsigned 64-bit argument; -1 with an exception set if it is not one. */
static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* 0 if a METH_FASTCALL function got `want` arguments, else -1 with a TypeError. */
static int arity(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
    return -1;
}

#endif
