"""The compiled parts (everything else is in pyproject.toml): the client's two hot reads of
shared memory (issue 42) -- the residency index's read (lmcache_ec_broker/shm/
_residency_copy.c) and the put arena's check (shm/_placement_check.c) -- and its
streaming copy into the slab (shm/_stream_copy.c), built against
CPython 3.10's stable ABI, so one wheel serves every CPython >= 3.10 on its platform.
Optional: where no C compiler is found the package installs without them, and the
client reads those segments in Python and copies puts with memmove (the same answers,
slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"lmcache_ec_broker.shm.{name}",
            [f"lmcache_ec_broker/shm/{name}.c"],
            depends=["lmcache_ec_broker/shm/_shm_read.h"],
            py_limited_api=True,
            optional=True,
        )
        for name in ("_residency_copy", "_placement_check", "_stream_copy")
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
