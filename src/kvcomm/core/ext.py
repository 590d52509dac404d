"""The extension field of a record: one msgpack map with string keys, packed.

Every L2 record and every L3 record carries one (``Segment.version()[7]``, the extra
element of an L2 write op; ``L3Record.ext``), for per-record data later features add
(agent ids, expiry...). Readers ignore keys they do not know. What a valid one is, is
decided here once: L3 readers refuse a record whose field is not valid
(CorruptRecord), and L2 refuses to store one (InvalidArgument), so that no host
acknowledges a write that every other host would then refuse to read.
"""

from __future__ import annotations

import msgpack

MAX_EXT = 4096  # the packed map's bytes
EMPTY_EXT = b"\x80"  # the empty map: L3's field of a record that has none (L2 stores b"")


def ext_problem(x: object) -> str:
    """Why ``x`` is not a packed extension map; "" if it is. Never raises."""
    if type(x) is not bytes or len(x) > MAX_EXT:
        return f"the extension is not bytes of at most {MAX_EXT}"
    try:
        m = msgpack.unpackb(x, raw=False, max_str_len=MAX_EXT, max_bin_len=MAX_EXT,
                            max_array_len=MAX_EXT, max_map_len=MAX_EXT, max_ext_len=0)
    except Exception:  # msgpack's errors have no common base; bad UTF-8 in a key too
        return "the extension is not one msgpack value"
    if type(m) is not dict or not all(type(k) is str for k in m):
        return "the extension is not a map with string keys"
    return ""


def l2_ext_problem(x: bytes) -> str:
    """:func:`ext_problem` for an L2 op's field, where b"" means none. Never raises."""
    return "" if x == b"" else ext_problem(x)
