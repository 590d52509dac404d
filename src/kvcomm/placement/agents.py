"""Agent ids, and the writer's id in a record's extension field.

An agent names itself at ``kvcomm.open(..., agent="drone-7")``: 1 to 64 letters, digits,
``_``, ``.``, ``:`` or ``-`` (the characters of ``node.host_id``). A client opened without
a name is the agent ``PID@HOST`` (its process id and ``node.host_id``): every client of
one process shares it, and the ``@`` (which no name holds) marks it as unnamed, so that a
plan never moves it — the process was not started by anything that could restart it
elsewhere.

Every local write carries its writer's id in the record's extension field (the msgpack
map every L2 and L3 record has; see :mod:`kvcomm.tiers.l3`) under the key ``"a"``. The
field is packed once per client (:func:`with_agent`), so a put pays for a few more bytes
copied, nothing else. Readers of the field (:func:`agent_of`) ignore the keys they do not
know, and :func:`with_agent` keeps them: the map is shared with later features.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack

from ..errors import InvalidArgument

AGENT_KEY = "a"  # the writer's agent id, in a record's extension map
MAX_EXT = 4096  # as tiers/l3.py MAX_EXT: a larger field is not ours to read
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}\Z")
_UNNAMED = re.compile(r"([0-9]{1,10})@([A-Za-z0-9_.:-]{1,64})\Z")


def check_agent(agent: object) -> str:
    """``agent`` if it is a valid agent name. Raises InvalidArgument saying what is allowed."""
    if type(agent) is not str or not _NAME.match(agent):
        raise InvalidArgument(
            f"agent must be a str of 1 to 64 letters, digits, '_', '.', ':' or '-' (such as "
            f"'drone-7'), got {agent!r}")
    return agent


def process_agent(pid: int, host: str) -> str:
    """The id of an unnamed agent: ``PID@HOST``."""
    return f"{pid}@{host}"


def is_named(agent: str) -> bool:
    """True for a name an agent gave itself; False for an unnamed ``PID@HOST``."""
    return bool(_NAME.match(agent))


def is_agent_id(agent: object) -> bool:
    """True for a valid agent id: a name, or an unnamed ``PID@HOST``."""
    return type(agent) is str and bool(_NAME.match(agent) or _UNNAMED.match(agent))


def host_of_unnamed(agent: str) -> str | None:
    """The host of an unnamed agent ``PID@HOST`` (None for a name)."""
    m = _UNNAMED.match(agent)
    return m.group(2) if m else None


def _unpack_map(ext: bytes) -> dict[Any, Any] | None:
    if not ext or len(ext) > MAX_EXT:
        return None
    try:
        m = msgpack.unpackb(ext, raw=False, strict_map_key=False, max_bin_len=MAX_EXT,
                            max_str_len=MAX_EXT, max_array_len=MAX_EXT, max_map_len=MAX_EXT,
                            max_ext_len=MAX_EXT)
    except Exception:  # written by something else: no map of ours
        return None
    return m if isinstance(m, dict) else None


def with_agent(ext: bytes, agent: str) -> bytes:
    """The extension field ``ext`` (b"": none) with the writer's id set to ``agent``; the
    map's other keys are kept as they are. A field that is not a map is replaced."""
    m = _unpack_map(ext) or {}
    m[AGENT_KEY] = agent
    return msgpack.packb(m, use_bin_type=True)  # type: ignore[no-any-return]


def agent_of(ext: bytes) -> str | None:
    """The writer's agent id in the extension field ``ext``, or None: no field, no id in
    it, or not a valid id (written by something else). Never raises."""
    m = _unpack_map(ext)
    if m is None:
        return None
    a = m.get(AGENT_KEY)
    return a if is_agent_id(a) else None
