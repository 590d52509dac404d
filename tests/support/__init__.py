"""What the tests share besides pytest's fixtures (tests/conftest.py): helpers, the dev
cluster's scaffolding, fakes, worker processes, fuzzers, and data files (``DATA``)."""

import pathlib

DATA = pathlib.Path(__file__).parent / "data"
ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
