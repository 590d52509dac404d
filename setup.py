"""Only here for the compiled helper: everything else lives in pyproject.toml.

The C kernel's layout constants are generated from ``kvcomm/tiers/shm/layout.py`` (the one
definition of the L2 segment's layout) into ``_l2layout.h`` before it is compiled.
"""

import runpy
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).parent
LAYOUT = HERE / "src" / "kvcomm" / "tiers" / "shm" / "layout.py"
HEADER = HERE / "src" / "kvcomm" / "_l2layout.h"

text = runpy.run_path(str(LAYOUT))["c_header"]()
if not HEADER.exists() or HEADER.read_text() != text:
    HEADER.write_text(text)

setup(
    ext_modules=[
        Extension(
            "kvcomm._l2core",
            sources=["src/kvcomm/_l2core.c"],
            depends=["src/kvcomm/_l2layout.h",
                     *sorted(str(p.relative_to(HERE)) for p in (HERE / "src" / "kvcomm" / "_l2core_c").glob("*"))],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-missing-braces"],
            libraries=["pthread"],
        ),
    ]
)
