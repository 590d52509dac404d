"""Optional dependencies, and the error that names the extra which installs each one.

``pip install kvcomm`` is the embedded default (L1 + L2) with the fewest dependencies:
msgpack, xxhash, pydantic and PyYAML. Everything else comes with an extra:

=============  ======================  ==============================================
extra          installs                needed for
=============  ======================  ==============================================
``cluster``    redis, hiredis,         cluster mode (``cluster.redis`` set): clients
               prometheus-client       reaching L3, ``kvcomm node`` (and its metrics
                                       exporter), ``dev-cluster``,
                                       ``soak``, the demo's Redis baselines
``demo``       rich                    ``kvcomm demo``'s terminal output
``plot``       matplotlib              ``kvcomm demo --plot``
``numpy``      numpy                   storing numpy arrays as values, KVCommStore(index=)
``metrics``    prometheus-client,      ``kvcomm metrics`` (the exporter), ``kvcomm top``
               rich
``loadtest``   locust                  ``kvcomm loadtest``
``placement``  networkx                ``kvcomm placement plan`` (the partitioner)
``langgraph``  langgraph,              ``kvcomm.integrations.langgraph`` (a LangGraph
               langgraph-checkpoint    checkpointer and store)
``mcp``        mcp (the official MCP   ``kvcomm mcp`` (an MCP server)
               Python SDK, 2.x)
``all``        all of the above
``dev``        all, plus test tools    the test suite, linters, benchmarks' peers
=============  ======================  ==============================================

A code path that needs an optional module calls :func:`require` where it first imports
it, so that a missing one is a :class:`~kvcomm.errors.ConfigError` saying what to
install rather than a bare ImportError from deep inside.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

from .errors import ConfigError

# extra -> the modules it installs that code imports (hiredis is only a parser redis-py
# picks up by itself: it is never required)
EXTRAS: dict[str, tuple[str, ...]] = {
    "cluster": ("redis",),
    "demo": ("rich",),
    "plot": ("matplotlib",),
    "numpy": ("numpy",),
    "metrics": ("prometheus_client", "rich"),
    "loadtest": ("locust",),
    "placement": ("networkx",),
    "langgraph": ("langgraph",),
    "mcp": ("mcp",),
}


def available(module: str) -> bool:
    """True when ``module`` can be imported (without importing it when it is not yet)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or half-imported
        return False


def require(module: str, *, extra: str, purpose: str) -> ModuleType:
    """Import and return ``module``, which the extra ``extra`` installs.

    ``purpose`` says what needs it ("cluster mode (cluster.redis is set)"). Raises
    ConfigError (key ``""``) naming the command that installs it (:func:`install_hint`) when it is not
    installed, and KeyError when ``extra`` is not one of :data:`EXTRAS` (a bug here).
    Nothing is changed either way.
    """
    if module not in EXTRAS[extra]:
        raise KeyError(f"the extra {extra!r} does not install {module!r}")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name != module and not module.startswith(f"{exc.name}."):
            raise  # the module is there but itself broken: not a missing extra
        raise ConfigError("", f"the Python package {module!r} is needed for {purpose} but is "
                              f"not installed; install it with: {install_hint(extra)}") from None


def install_hint(extra: str) -> str:
    """The command that installs the extra ``extra`` into this environment: from the
    checkout this kvcomm was installed from, when pip recorded one (its
    ``direct_url.json``; ``-e`` when it was editable), else by name from an index."""
    import json
    import shlex
    import urllib.parse
    from importlib import metadata

    try:
        info = json.loads(metadata.distribution("kvcomm").read_text("direct_url.json") or "{}")
        url = info.get("url", "") if isinstance(info, dict) else ""
    except (metadata.PackageNotFoundError, ValueError, OSError):
        url = ""
    pip = f"{shlex.quote(sys.executable)} -m pip install"  # (this environment's, whatever
    # is first on PATH: a console script of a venv runs without it being activated)
    if not (type(url) is str and url.startswith("file://")):
        return f"{pip} 'kvcomm[{extra}]'"
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    dir_info = info.get("dir_info")
    editable = "-e " if isinstance(dir_info, dict) and dir_info.get("editable") else ""
    return f"{pip} {editable}{shlex.quote(f'{path}[{extra}]')}"


def require_cluster(purpose: str = "cluster mode (cluster.redis is set)") -> None:
    """:func:`require` of what cluster mode imports (redis-py). Raises ConfigError."""
    require("redis", extra="cluster", purpose=purpose)
