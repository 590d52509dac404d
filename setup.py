"""Only here for the compiled helper: everything else lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvcomm._atomic",
            sources=["src/kvcomm/_atomic.c"],
            extra_compile_args=["-O2", "-std=c11"],
        )
    ]
)
