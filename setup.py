"""Only here for the compiled helper: everything else lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvcomm._l2core",
            sources=["src/kvcomm/_l2core.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-missing-braces"],
        ),
    ]
)
