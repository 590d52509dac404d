"""The L3 record: its format (a msgpack map of short named fields, format 2), the rule
for bumping that format, its defensive decoding, and the names of a key's Redis keys.
Pure: no Redis, no I/O.

See :mod:`kvcomm.tiers.l3` ("Records", "When to bump FORMAT") for the format's fields and
why each is as it is.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import msgpack

from ...core import codec
from ...core.expiry import deadline_of
from ...core.ext import EMPTY_EXT, MAX_EXT
from ...core.ext import ext_problem as _check_ext
from ...core.versions import MAX_COUNTER, Dotted, Vector
from ...errors import CorruptRecord, UnsupportedValue
from ..groups import DEFAULT_GROUPS, groups

GROUPS = DEFAULT_GROUPS  # (the older name of the default cluster.groups)
FORMAT = 2  # the record format written (see "When to bump FORMAT" above)
FIELDS = ("f", "h", "d", "t", "m", "v", "vv", "dot", "x")  # a format-2 record's keys

# Bounds of a valid record (see L3Record.decode). The value's own bound is the
# configured cache.max_value_size; these are the rest.
MAX_VALUE_SIZE = 64 << 20  # cache.max_value_size's default, for callers without a config
MAX_META = 4096  # the codec's meta is an array header: [dtype, shape] of at most 64 dims
MAX_ACTORS = 1024  # hosts in one version vector
_ACTOR = re.compile(rb"[A-Za-z0-9_.:-]{1,64}\Z")  # as node.host_id
_HLC = re.compile(rb"[0-9a-f]{16}\Z")
_FIELD_SET = frozenset(f.encode() for f in FIELDS)
# the msgpack framing of a record besides its value, meta, extension and vector: ample
_RECORD_OVERHEAD = 256 + MAX_META + MAX_EXT + MAX_ACTORS * (64 + 9 + 2)


def _valid_counter(c: object) -> bool:
    return type(c) is int and 1 <= c <= MAX_COUNTER  # (type(): a bool is not a counter)


class L3Record(NamedTuple):
    hlc: int
    tombstone: bool
    tag: int
    meta: bytes
    value: bytes
    vector: Vector
    dot: tuple[str, int]
    ext: bytes = EMPTY_EXT  # the extension map, packed: carried through unchanged

    @property
    def version(self) -> Dotted:
        return Dotted(self.vector, self.dot, self.hlc)

    @property
    def deadline(self) -> float | None:
        """The record's expiry in epoch seconds, from its extension field (None: never;
        :mod:`kvcomm.core.expiry`). Past it the record reads as a tombstone."""
        return deadline_of(self.ext)

    @property
    def local_ext(self) -> bytes:
        """The extension field as an L2 record stores it (b"" for the empty map)."""
        return b"" if self.ext == EMPTY_EXT else self.ext

    def encode(self) -> bytes:
        """The record in the current FORMAT (a msgpack map)."""
        flat: list[object] = []
        for actor, counter in self.vector:
            flat += [actor, counter]
        return msgpack.packb(  # type: ignore[no-any-return]
            {"f": FORMAT, "h": f"{self.hlc:016x}", "d": self.tombstone, "t": self.tag,
             "m": self.meta, "v": self.value, "vv": flat, "dot": [self.dot[0], self.dot[1]],
             "x": self.ext}, use_bin_type=False)  # Redis' cmsgpack has no bin type

    @staticmethod
    def decode(data: object, max_value_size: int = MAX_VALUE_SIZE) -> L3Record:
        """The record encoded in ``data`` (format 2, or the older format 1).

        Raises CorruptRecord, and nothing else, for any input that is not a valid
        record: an unknown format, missing or unknown fields, wrong types, a value over
        ``max_value_size``, meta over MAX_META, an extension that is not one msgpack map
        of at most MAX_EXT bytes with string keys, counters outside 1..2**53-1, actors
        that are not host ids, an HLC that is not 16 lowercase hex digits, or more than
        MAX_ACTORS actors. Memory used is bounded by ``len(data)``, which is itself
        bounded before unpacking.
        """
        if type(data) is not bytes:
            raise CorruptRecord(f"not a KVCOMM record (a {type(data).__name__}, not bytes)")
        if len(data) > max_value_size + _RECORD_OVERHEAD:
            raise CorruptRecord(f"not a KVCOMM record ({len(data)} bytes, over "
                                f"cache.max_value_size = {max_value_size} plus its header)")
        try:
            # every limit explicit: a length field can claim no more than these, whatever
            # the msgpack version's defaults
            r = msgpack.unpackb(data, raw=True, use_list=True, max_str_len=max_value_size,
                                max_bin_len=max_value_size, max_array_len=2 * MAX_ACTORS + 9,
                                max_map_len=len(FIELDS), max_ext_len=0)
        except Exception as exc:  # msgpack's errors have no common base beyond Exception
            raise CorruptRecord(f"not a KVCOMM record (msgpack: {exc})") from None
        if type(r) is list:  # format 1: the same fields, by position
            why = _check_v1(r, max_value_size)
            if not why:
                r = dict(zip((b"f", b"h", b"d", b"t", b"m", b"v", b"vv"), r[:7], strict=True)
                         ) | {b"dot": r[7:9], b"x": EMPTY_EXT}
        else:
            why = _check(r, max_value_size)
        if why:
            raise CorruptRecord(f"not a KVCOMM record ({why})")
        flat, dot = r[b"vv"], r[b"dot"]
        vector = tuple(sorted((flat[i].decode("ascii"), flat[i + 1])
                              for i in range(0, len(flat), 2)))
        return L3Record(int(r[b"h"], 16), r[b"d"], r[b"t"], r[b"m"], r[b"v"], vector,
                        (dot[0].decode("ascii"), dot[1]), r[b"x"])

    def decode_value(self, key: str = "") -> Any:
        """The Python value this (non-tombstone) record holds.

        Raises CorruptRecord, naming ``key``, when the tag, meta or payload do not decode
        (whatever the codec or numpy raised), or for a tombstone; UnsupportedValue only
        when the value is a numpy array and numpy is not installed.
        """
        if self.tombstone:
            raise CorruptRecord(f"L3 record of {key!r} is a tombstone: it holds no value")
        try:
            return codec.decode(self.tag, self.meta, self.value)
        except UnsupportedValue:
            raise  # numpy missing: not the record's fault, and the message says what to do
        except Exception as exc:  # codec, msgpack and numpy errors alike: hostile input
            raise CorruptRecord(f"L3 value of {key!r} cannot be decoded "
                                f"({type(exc).__name__}: {exc}); remove or rewrite the key"
                                ) from None


def read_record(raw: object, key: str = "", max_value_size: int = MAX_VALUE_SIZE) -> L3Record:
    """:meth:`L3Record.decode`, with a CorruptRecord that names ``key`` and says what to do."""
    try:
        return L3Record.decode(raw, max_value_size)
    except CorruptRecord as exc:
        raise CorruptRecord(f"L3 value of {key!r}: {exc}; remove or rewrite the key") from None


def _check(r: object, max_value_size: int) -> str:
    """Why ``r`` (msgpack-decoded with raw=True) is not a format-2 record; "" if it is."""
    if type(r) is not dict:
        return "neither a map nor an array"
    fmt = r.get(b"f")
    if type(fmt) is not int or fmt != FORMAT:
        return f"format {fmt!r}, not {FORMAT} (nor 1)"
    if r.keys() != _FIELD_SET:
        return f"fields are not {', '.join(FIELDS)}"
    dot = r[b"dot"]
    if type(dot) is not list or len(dot) != 2:
        return "the dot is not [host id, counter]"
    return (_check_fields(r[b"h"], r[b"d"], r[b"t"], r[b"m"], r[b"v"], r[b"vv"], dot[0], dot[1],
                          max_value_size)
            or _check_ext(r[b"x"]))


def _check_v1(r: list[Any], max_value_size: int) -> str:
    """Why ``r`` (an array) is not a format-1 record; "" if it is."""
    if len(r) != 9:
        return "not an array of 9 fields"
    fmt, hlc, tomb, tag, meta, value, flat, actor, counter = r
    if type(fmt) is not int or fmt != 1:
        return f"format {fmt!r}, not {FORMAT} (nor 1)"
    return _check_fields(hlc, tomb, tag, meta, value, flat, actor, counter, max_value_size)


def _check_fields(hlc: object, tomb: object, tag: object, meta: object, value: object,
                  flat: object, actor: object, counter: object, max_value_size: int) -> str:
    if type(hlc) is not bytes or not _HLC.match(hlc):
        return "hlc is not 16 lowercase hex digits"
    if type(tomb) is not bool:
        return "tombstone flag is not a bool"
    if type(tag) is not int or not 0 <= tag <= 255:
        return "tag is not an int in 0..255"
    if type(meta) is not bytes or len(meta) > MAX_META:
        return f"meta is not bytes of at most {MAX_META}"
    if type(value) is not bytes or len(value) > max_value_size:
        return f"value is not bytes of at most {max_value_size} (cache.max_value_size)"
    if type(flat) is not list or not flat or len(flat) % 2 or len(flat) > 2 * MAX_ACTORS:
        return f"version vector is not 1..{MAX_ACTORS} (actor, counter) pairs"
    seen = set()
    for i in range(0, len(flat), 2):
        a, c = flat[i], flat[i + 1]
        if type(a) is not bytes or not _ACTOR.match(a) or not _valid_counter(c):
            return "a version-vector entry is not (host id, counter in 1..2**53-1)"
        seen.add(a)
    if len(seen) != len(flat) // 2:
        return "an actor appears twice in the version vector"
    if type(actor) is not bytes or not _ACTOR.match(actor) or not _valid_counter(counter):
        return "the dot is not (host id, counter in 1..2**53-1)"
    return ""


def group_of(key: str, count: int = DEFAULT_GROUPS) -> int:
    """The group of ``key`` among ``count`` (``cluster.groups``)."""
    return groups(count).of(key)


def record_key(key: str, count: int = DEFAULT_GROUPS) -> str:
    return groups(count).record_key(key)


def feed_key(group: int, count: int = DEFAULT_GROUPS) -> str:
    return groups(count).feed_key(group)


def seq_key(group: int, count: int = DEFAULT_GROUPS) -> str:
    """The group's change counter: the sequence number of its latest feed entry."""
    return groups(count).seq_key(group)


def approx_size(record: L3Record) -> int:
    """The bytes of ``record``'s value, meta and extension (its size in a push call, near
    enough; a field of another type, which the push script refuses, counts 0)."""
    return sum(len(b) for b in (record.value, record.meta, record.ext)
               if isinstance(b, (bytes, bytearray, memoryview)))


def _packed_vector(v: Vector) -> bytes:
    """A vector as CAS_LUA reads it: a msgpack array [actor, counter, ...]."""
    flat: list[object] = []
    for actor, counter in v:
        flat += [actor, counter]
    return msgpack.packb(flat, use_bin_type=False)  # type: ignore[no-any-return]


def _wire_key(key: str) -> bytes:
    """``key`` as sent to Redis: strict UTF-8. Raises CorruptRecord (a lone surrogate, say)."""
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError:
        raise CorruptRecord(f"key {key!r} is not valid UTF-8 (a lone surrogate?): it cannot "
                            "be stored in L3; rename it") from None


def _printable(s: str) -> str:
    """``s`` with anything UTF-8 cannot carry (lone surrogates) escaped."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")

