"""The one compiled part (everything else is in pyproject.toml): the residency index's
get_into hot path (lmcache_ec_broker/shm/_residency_copy.c, issue 42), built against
CPython 3.10's stable ABI, so one wheel serves every CPython >= 3.10 on its platform.
Optional: where no C compiler is found the package installs without it, and the client
copies through the index in Python (the same answers, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_ec_broker.shm._residency_copy",
            ["lmcache_ec_broker/shm/_residency_copy.c"],
            py_limited_api=True,
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
