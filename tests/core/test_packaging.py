"""Packaging: what `pip install kvcomm` needs, what each extra adds, what imports what.

Optional packages are hidden from a fresh interpreter by a ``sys.meta_path`` hook (as if
they were not installed), so these run in the dev environment without extra venvs.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest

import kvcomm
from kvcomm import _extras
from kvcomm._extras import install_hint
from kvcomm.cli import build_parser
from tests.support import ROOT

SRC = ROOT / "src" / "kvcomm"
BASE = {"msgpack", "xxhash", "pydantic", "yaml"}  # the modules of the four dependencies
OPTIONAL = {"redis", "hiredis", "rich", "matplotlib", "numpy", "prometheus_client", "locust",
            "gevent",
            "networkx", "langgraph", "langchain_core",
            "mcp", "anyio", "uvicorn"}  # (kvcomm[mcp]: the SDK, and what it installs)
# Locust loads these itself (kvcomm loadtest runs it): they may import locust when they load
LOCUSTFILES = {"kvcomm/loadtest/locustfile.py", "kvcomm/loadtest/users.py"}
# An integration is imported only by its users, after its package's __init__ has called
# require() (ConfigError naming the extra): its modules subclass the framework's classes
INTEGRATIONS = {"kvcomm/integrations/langgraph": ("langgraph", "langchain_core")}

HIDE = textwrap.dedent('''
    import sys

    class _Hidden:
        """Imports of these names fail as if the package were not installed."""

        def __init__(self, names):
            self.names = names

        def find_spec(self, name, path=None, target=None):
            if name in self.names or name.split(".")[0] in self.names:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Hidden(set(sys.argv[1].split(","))))
''')


def python(code: str, hide: set[str] = frozenset(), timeout: float = 120,  # type: ignore[assignment]
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in which the modules ``hide`` are missing."""
    return subprocess.run([sys.executable, "-c", HIDE + textwrap.dedent(code),
                           ",".join(sorted(hide)) or "-"],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


# ---------------------------------------------------------------- what loads what


def test_the_core_imports_alone_without_the_c_kernel_or_redis() -> None:
    out = python('''
        import pkgutil, sys
        import kvcomm.core
        names = sorted(m.name for m in pkgutil.iter_modules(kvcomm.core.__path__))
        for name in names:
            __import__(f"kvcomm.core.{name}")
        from kvcomm.core import codec, versions
        v = versions.encode_vector((("h", 1),), 5)
        assert versions.decode_vector(v) == ((("h", 1),), 5)
        assert codec.decode(*codec.encode({"a": [1, 2]})) == {"a": [1, 2]}
        loaded = {m for m in ("kvcomm._l2core", "kvcomm._client", "kvcomm.tiers.l2", "redis")
                  if m in sys.modules}
        print(",".join(names), "|", ",".join(sorted(loaded)))
    ''', hide={"kvcomm._l2core", "redis"})  # as if the C kernel were not even built
    assert out.returncode == 0, out.stderr
    names, _, loaded = out.stdout.strip().partition(" | ")
    assert len(names.split(",")) >= 7, names  # versions, resolve, window, sketch, bloom, ...
    assert loaded == ""


def test_import_kvcomm_loads_only_the_errors_and_every_name_still_works() -> None:
    out = python('''
        import sys
        import kvcomm
        heavy = [m for m in ("kvcomm._l2core", "kvcomm._client", "kvcomm.config", "redis",
                             "pydantic", "numpy") if m in sys.modules]
        assert heavy == [], heavy
        from kvcomm import ABSENT, Batch, Client, Config, Event, Item, Ordering, Version, open
        from kvcomm import ConfigError, KVCommError
        import kvcomm._client as c, kvcomm.config as cfg, kvcomm.core.versions as v
        assert (open, Client, Batch, Event, Item, ABSENT) == (
            c.open, c.Client, c.Batch, c.Event, c.Item, c.ABSENT)
        assert Config is cfg.Config and (Version, Ordering) == (v.Version, v.Ordering)
        assert kvcomm.open is open and kvcomm.Config is Config
        assert "redis" not in sys.modules  # not even once the client is loaded
        try:
            from kvcomm import no_such_name
        except ImportError:
            pass
        else:
            raise AssertionError("from kvcomm import no_such_name worked")
        print("ok")
    ''')
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_public_names_are_listed_and_typed() -> None:
    assert set(kvcomm.__all__) <= set(dir(kvcomm))
    for name in kvcomm.__all__:
        assert getattr(kvcomm, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        kvcomm.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    # what mypy and IDEs see: every lazy name has its TYPE_CHECKING import
    tree = ast.parse((SRC / "__init__.py").read_text())
    typed = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for a in node.names}
    assert set(kvcomm.__all__) <= typed


# ---------------------------------------------------------------- dependencies and extras


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_pip_install_kvcomm_needs_four_packages_and_the_extras_carry_the_rest() -> None:
    project = _pyproject()["project"]
    assert {_name(r) for r in project["dependencies"]} == {"msgpack", "xxhash", "pydantic", "pyyaml"}
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    assert extras["cluster"] == {"redis", "hiredis", "prometheus-client"}
    assert extras["metrics"] == {"prometheus-client", "rich"} and extras["loadtest"] == {"locust"}
    assert extras["demo"] == {"rich"} and extras["plot"] == {"matplotlib"}
    assert extras["numpy"] == {"numpy"}
    assert extras["placement"] == {"networkx"}
    assert extras["langgraph"] == {"langgraph", "langgraph-checkpoint"}
    assert {"langgraph-checkpoint-conformance", "langgraph-checkpoint-sqlite"} <= {
        _name(r) for r in project["optional-dependencies"]["dev"]}
    all_of = re.search(r"\[(.*)\]", project["optional-dependencies"]["all"][0])
    assert all_of is not None and set(all_of.group(1).split(",")) == set(_extras.EXTRAS)
    assert "kvcomm[all]" in project["optional-dependencies"]["dev"]
    for extra, modules in _extras.EXTRAS.items():  # what require() names installs the module
        # (a distribution's import name: prometheus-client installs prometheus_client)
        assert {m.replace("_", "-") for m in modules} <= extras[extra], (extra, modules)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported when the file loads) for each import in ``path``:
    an import inside a function, under ``if TYPE_CHECKING`` or in a ``try`` that handles
    ImportError does not run (or may fail) when the module loads."""
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            at_load = False
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            at_load = False
        elif isinstance(node, ast.Try) and any(
                h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers):
            at_load = False
        if isinstance(node, ast.Import):
            out.extend((a.name.split(".")[0], at_load) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], at_load))
        for child in ast.iter_child_nodes(node):
            visit(child, at_load)

    visit(ast.parse(path.read_text()), True)
    return out


def test_src_imports_only_the_base_dependencies_at_module_level() -> None:
    """An optional package is imported inside the function that needs it (or under a
    try), never when a module loads: so the embedded default runs without any of them."""
    std = set(sys.stdlib_module_names)
    for path in sorted(SRC.rglob("*.py")):
        for module, at_load in _imports(path):
            if module in std or module == "kvcomm" or module == "__future__":
                continue
            where = path.relative_to(SRC.parent)
            assert module in BASE | OPTIONAL, f"{where} imports {module}: not a declared dependency"
            integration = INTEGRATIONS.get(str(where.parent), ())
            if where.name == "__init__.py":
                integration = ()  # (the package itself requires the extra first)
            if module in OPTIONAL and not (str(where) in LOCUSTFILES and module in ("locust", "gevent")) \
                    and module not in integration:
                assert not at_load, f"{where} imports the optional {module} when it loads"
            assert module not in {"pytest", "hypothesis", "tests"}, where


def test_the_embedded_default_runs_with_no_extra_installed(ns: str) -> None:
    out = python(f'''
        import kvcomm
        cfg = kvcomm.Config.from_mapping({{"cache": {{"l2_size": "8MB"}}}})
        with kvcomm.open({ns!r}, config=cfg) as kv:
            kv.put("drone/1/state", {{"pos": [1, 2]}})
            with kv.batch() as b:
                b.put("a", b"x")
            assert kv.get("drone/1/state") == {{"pos": [1, 2]}} and kv.get("a") == b"x"
            assert kv.get_item("a").tier in ("l1", "l2")
            kv.delete("a")
        from kvcomm.cli import main
        assert main(["config", "--show"]) == 0
        assert main(["info", "--name", {ns!r}, "--json"]) == 0
    ''', hide=OPTIONAL)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------- the error that names the extra

def test_numpy_is_imported_only_by_a_process_that_uses_arrays(ns: str) -> None:
    """numpy, installed, is not imported by a client that stores no array (it costs ~90 ms
    at the first open and objects every full garbage collection walks); an array still
    round-trips once the caller imports numpy, and a process that never imported it reads
    one another process stored (imported then), or is told what to install."""
    cfg = 'kvcomm.Config.from_mapping({"cache": {"l2_size": "8MB"}})'
    writer = python(f'''
        import sys
        import kvcomm
        with kvcomm.open({ns!r}, config={cfg}) as kv:
            kv.put("state", {{"pos": [1.5, 2]}})
            with kv.batch() as b:
                b.put("b", [1, None])
            kv.update("n", lambda n: (n or 0) + 1, default=None)
            try:
                kv.put("bad", object())
            except kvcomm.UnsupportedValue:
                pass
            assert kv.get("state") == {{"pos": [1.5, 2]}} and [i.key for i in kv.scan("")]
            assert "numpy" not in sys.modules, "a client without arrays imported numpy"
            import numpy as np
            kv.put("arr", np.arange(6, dtype="<i4").reshape(2, 3))
            kv.put("x", np.float64(2.5))
            assert kv.get("x") == 2.5 and type(kv.get("x")) is float
            assert kv.get("arr").tolist() == [[0, 1, 2], [3, 4, 5]]
        print("ok")
    ''')
    assert out_ok(writer)
    reader = python(f'''
        import sys
        import kvcomm
        with kvcomm.open({ns!r}, config={cfg}) as kv:
            assert kv.get("state") == {{"pos": [1.5, 2]}}
            assert "numpy" not in sys.modules
            arr = kv.get("arr")
            assert type(arr).__name__ == "ndarray" and arr.tolist() == [[0, 1, 2], [3, 4, 5]]
        print("ok")
    ''')
    assert out_ok(reader)
    without = python(f'''
        import kvcomm
        with kvcomm.open({ns!r}, config={cfg}) as kv:
            assert kv.get("state") == {{"pos": [1.5, 2]}}
            try:
                kv.get("arr")
            except kvcomm.UnsupportedValue as exc:
                print(exc)
    ''', hide={"numpy"})
    assert without.returncode == 0, without.stderr
    assert install_hint("numpy") in without.stdout, without.stdout


def test_a_read_while_another_thread_imports_numpy_waits_for_that_import(ns: str) -> None:
    """The codec takes numpy from sys.modules, where a module being imported sits half
    made: a thread reading an array (or refusing a set) while another thread ran `import
    numpy` got 'partially initialized module' errors, an array's record reported as
    undecodable (the review's find: ~15,000 failed reads a run). It now waits for the
    import. The reads during the import are counted: the race was run."""
    out = python(f'''
        import subprocess, sys, threading
        import kvcomm
        subprocess.run([sys.executable, "-c", "import kvcomm, numpy as np\\n"
                        "with kvcomm.open({ns!r}) as kv: kv.put('arr', np.arange(10)); "
                        "kv.put('big', np.arange(2000))"], check=True)
        kv = kvcomm.open({ns!r})
        errors, during, stop = [], [0], []

        def reader():
            while "numpy" not in sys.modules:
                pass
            while not stop:
                np = sys.modules.get("numpy")
                half = getattr(getattr(np, "__spec__", None), "_initializing", False)
                try:
                    kv.get("arr"), kv.get("big")
                    try:
                        kv.put("bad", {{1, 2}})
                    except kvcomm.UnsupportedValue:
                        pass
                    during[0] += half
                except Exception as exc:
                    errors.append(repr(exc)[:200])

        t = threading.Thread(target=reader)
        t.start()
        import numpy  # (~100 ms: the reader gets the GIL many times meanwhile)
        stop.append(1)
        t.join()
        kv.close()
        assert not errors, errors[:3]
        assert during[0], "no read ran while numpy was being imported"
        print("ok", during[0])
    ''')
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok"), out.stdout


def out_ok(out: subprocess.CompletedProcess[str]) -> bool:
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().endswith("ok")



def _cluster_config(tmp_path: Path, ns: str) -> Path:
    f = tmp_path / "host.yaml"
    f.write_text(f"node:\n  namespace: {ns}\ncluster:\n  redis: ['127.0.0.1:1']\n")
    return f


def test_cluster_commands_without_redis_py_name_the_extra(tmp_path: Path, ns: str) -> None:
    cfg = _cluster_config(tmp_path, ns)
    dev = tmp_path / "dc"
    out = python(f'''
        import contextlib, io
        from kvcomm.cli import main
        for argv in (["node", "--config", {str(cfg)!r}],
                     ["dev-cluster", "up", "--hosts", "1", "--dir", {str(dev)!r}],
                     ["soak", "--seconds", "1", "--quiet"],
                     ["demo", "--baseline", "redis", "--name", {ns!r}],
                     ["demo", "--cluster", "--name", {ns!r}]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            print(argv[0], code, err.getvalue().strip())
    ''', hide={"redis", "hiredis"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 5, out.stdout
    for line in lines:
        assert " 2 kvcomm: " in line and install_hint("cluster") in line, line
    assert not (dev / "cluster.json").exists()  # nothing was started


def test_a_node_config_without_a_cluster_is_reported_before_the_missing_extra(
        tmp_path: Path) -> None:
    f = tmp_path / "h.yaml"
    f.write_text("node:\n  host_id: h1\n")
    out = python(f'''
        import sys
        from kvcomm.cli import main
        sys.exit(main(["node", "--config", {str(f)!r}]))
    ''', hide={"redis"})
    assert out.returncode == 2 and "cluster.redis" in out.stderr and "pip install" not in out.stderr


def test_demo_without_rich_or_matplotlib_names_the_extra(ns: str) -> None:
    out = python(f'''
        import contextlib, io
        from kvcomm.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            print(main(["demo", "--name", {ns!r}]), err.getvalue().strip())
    ''', hide={"rich"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("2 ") and install_hint("demo") in out.stdout
    out = python(f'''
        import contextlib, io
        from kvcomm.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            print(main(["demo", "--plot", "x.png", "--name", {ns!r}]), err.getvalue().strip())
    ''', hide={"matplotlib"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("2 ") and install_hint("plot") in out.stdout


def test_demo_auto_baseline_falls_back_to_the_manager_without_redis_py() -> None:
    out = python('''
        from kvcomm.cli.demo import _choose_baseline
        print(_choose_baseline("auto"), _choose_baseline("manager"))
    ''', hide={"redis"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["manager", "manager"]


def test_a_client_reaching_l3_without_redis_py_names_the_extra(tmp_path: Path, ns: str) -> None:
    cfg = _cluster_config(tmp_path, ns)
    out = python(f'''
        import kvcomm
        try:  # at open(): a config naming cluster.redis needs redis-py before anything runs
            kvcomm.open(config={str(cfg)!r})
        except kvcomm.ConfigError as exc:
            print("ConfigError", exc)
        else:
            print("opened")
    ''', hide={"redis"})
    assert out.returncode == 0, out.stderr
    assert "ConfigError" in out.stdout and install_hint("cluster") in out.stdout


def test_the_langgraph_integration_without_langgraph_names_the_extra() -> None:
    out = python('''
        import kvcomm
        try:
            import kvcomm.integrations.langgraph
        except kvcomm.ConfigError as exc:
            print("ConfigError", exc)
        else:
            print("imported")
    ''', hide={"langgraph"})
    assert out.returncode == 0, out.stderr
    assert "ConfigError" in out.stdout and install_hint("langgraph") in out.stdout


def test_require_tells_a_missing_extra_from_a_broken_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _extras.require("numpy", extra="numpy", purpose="arrays").__name__ == "numpy"
    with pytest.raises(KeyError):
        _extras.require("numpy", extra="cluster", purpose="a typo in our own code")
    (tmp_path / "kvcomm_test_broken.py").write_text("import kvcomm_test_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(_extras.EXTRAS, "demo", ("kvcomm_test_broken", "kvcomm_test_absent"))
    with pytest.raises(ModuleNotFoundError, match="kvcomm_test_not_there"):  # not our message
        _extras.require("kvcomm_test_broken", extra="demo", purpose="x")
    with pytest.raises(kvcomm.ConfigError, match=re.escape(install_hint("demo"))):
        _extras.require("kvcomm_test_absent", extra="demo", purpose="x")
    assert not _extras.available("kvcomm_test_absent") and _extras.available("kvcomm_test_broken")


# ---------------------------------------------------------------- shipped tools, documented options


def test_the_shipped_package_holds_no_test_fixtures() -> None:
    assert not (SRC / "testing").exists()
    import kvcomm.devcluster as dc

    assert dc.__doc__ and all(getattr(dc, n).__doc__ for n in dc.__all__)


def test_the_l3_lua_scripts_are_package_data() -> None:
    """The L3 scripts are files (``kvcomm/tiers/l3/lua/*.lua``, read at import): pyproject's
    package data must name each, or a wheel would ship a ``kvcomm.tiers.l3`` that cannot
    be imported."""
    import fnmatch

    import kvcomm.tiers.l3.scripts as scripts

    globs = _pyproject()["tool"]["setuptools"]["package-data"]["kvcomm"]
    files = sorted((SRC / "tiers" / "l3" / "lua").glob("*.lua"))
    assert len(files) == 8
    for f in files:
        rel = f.relative_to(SRC).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data"
    assert all(getattr(scripts, n).strip() for n in dir(scripts) if n.endswith("_LUA"))


def _commands(parser: argparse.ArgumentParser | None = None,
              prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every command by its name, subcommands too ("placement plan")."""
    parser = parser or build_parser()
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, p in action.choices.items():
                out[prefix + name] = p
                out.update(_commands(p, f"{prefix}{name} "))
    return out


def test_every_command_and_option_has_help() -> None:
    parsers = [build_parser(), *_commands().values()]
    helps = {c.dest: c.help for p in parsers for a in p._actions
             if isinstance(a, argparse._SubParsersAction) for c in a._choices_actions}
    for name, parser in _commands().items():
        assert helps.get(name.rpartition(" ")[2]), f"kvcomm --help says nothing of {name}"
        assert parser.description, f"kvcomm {name} --help has no description"
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"kvcomm {name}: {action.option_strings or action.dest} has no help"


def test_the_docs_document_every_option_of_every_command() -> None:
    """Every command and option is in the docs' command-line reference (once the README's
    Commands section), which docs/hooks/reference.py generates from the parser when the
    site is built; the soak's paragraph in docs/cli.md lists every fault kind."""
    from kvcomm.faults import fault_kinds
    from kvcomm.faults import kinds as _kinds  # noqa: F401 (registers the built-in faults)

    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    page = (ROOT / "docs" / "cli.md").read_text()
    assert "<!-- generated: cli -->" in page
    text = reference.on_page_markdown(page)
    for name, parser in _commands().items():
        start = text.find(f"# `kvcomm {name}`\n")
        assert start >= 0, f"the docs' CLI reference has no section on kvcomm {name}"
        end = text.find("\n#", start + 3)
        part = text[start:end if end > 0 else None]
        assert " ".join(parser.description.split()) in part, f"kvcomm {name}: no description"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            for opt in action.option_strings:
                assert f"`{opt}`" in part, f"the docs do not document kvcomm {name} {opt}"
            for choice in action.choices or []:
                assert str(choice) in part, f"the docs do not document kvcomm {name} {choice}"
    soak = page[page.index("**`kvcomm soak"):]
    soak = soak[:soak.index("\n**`kvcomm ")]
    for kind in fault_kinds():
        assert f"`{kind}`" in soak, f"docs/cli.md does not list the fault kind {kind}"


def test_the_missing_extra_hint_names_the_checkout_kvcomm_was_installed_from(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kvcomm is not on a package index: ``pip install 'kvcomm[demo]'`` typed as told
    fails (or installs whatever a registry holds under that name). The hint installs from
    the checkout pip recorded (direct_url.json), and by name only when there is none; with
    this environment's pip (``python -m pip``: a venv's console script runs unactivated,
    and the first pip on PATH may be the system's)."""
    from importlib import metadata

    class Dist:
        def __init__(self, text: str | None) -> None:
            self.text = text

        def read_text(self, name: str) -> str | None:
            assert name == "direct_url.json"
            return self.text

    pip = f"{sys.executable} -m pip install"
    for text, want in (
            ('{"url": "file:///src/my%20kvcomm", "dir_info": {"editable": true}}',
             f"{pip} -e '/src/my kvcomm[demo]'"),
            ('{"url": "file:///src/kvcomm", "dir_info": {}}', f"{pip} '/src/kvcomm[demo]'"),
            ('{"url": "https://example.com/kvcomm.whl"}', f"{pip} 'kvcomm[demo]'"),
            (None, f"{pip} 'kvcomm[demo]'"), ("not json", f"{pip} 'kvcomm[demo]'")):
        monkeypatch.setattr(metadata, "distribution", lambda _n, t=text: Dist(t))
        assert install_hint("demo") == want
