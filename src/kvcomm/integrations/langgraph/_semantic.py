"""KVCommStore's semantic search: embedding texts, the vectors in the items' records, and
the host's shared-memory matrix (:mod:`kvcomm.tiers.vectors`) searched in one pass.

An indexed item's record carries a sixth element (after its ttl in minutes, or None),
``[index id, stamp, [[path, vector bytes], ...]]``: its vectors (unit float32, one per
indexed text, named as LangGraph's ``InMemoryStore`` names them: the field path,
``path.i`` for the i-th of several texts) and a random stamp of this put. The vectors
travel with the record (to L3 and other hosts, in cluster mode; they expire with it);
the host's matrix holds copies tagged with the stamp.
"""

from __future__ import annotations

import json
import math
import random
import struct
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from langgraph.store.base import get_text_at_path, tokenize_path
from langgraph.store.base.embed import ensure_embeddings
from xxhash import xxh3_64_hexdigest

from ..._client import Client
from ..._extras import require
from ..._l2core import unit_f32
from ...errors import ConfigError, CorruptRecord, KVCommError, KVCommWarning
from ...tiers.vectors import VectorFile
from ._keys import Keys

DEFAULT_CAPACITY = 100_000


class SemanticIndex:
    """The index of one store (see the module docstring)."""

    def __init__(self, kv: Client, keys: Keys, index: Any, capacity: int) -> None:
        self.np = require("numpy", extra="numpy",
                          purpose="KVCommStore's semantic search (a store made with index=)")
        if not isinstance(index, dict) or "dims" not in index or "embed" not in index:
            raise ConfigError("", "KVCommStore's index= is LangGraph's IndexConfig: "
                                  "{'dims': int, 'embed': callable or Embeddings, 'fields': [...]}")
        dims = index["dims"]
        if type(dims) is not int or not 0 < dims <= 65536:
            raise ConfigError("", f"index['dims'] must be an int in 1..65536, got {dims!r}")
        if type(capacity) is not int or capacity < 1:
            raise ConfigError("", f"index_capacity must be a positive int, got {capacity!r}")
        fields = index.get("fields") or ["$"]
        self.kv, self.keys, self.dims, self.capacity = kv, keys, dims, capacity
        self.embeddings = ensure_embeddings(index["embed"])
        self.fields: list[tuple[str, Any]] = [(p, tokenize_path(p)) if p != "$" else (p, p)
                                              for p in fields]  # (as InMemoryStore)
        # the fields that name one key of the value (most do): read without the path walker
        self._plain = all(_plain(f) for _p, f in self.fields) \
            and len({p for p, _f in self.fields}) == len(self.fields)
        # (native order where it is little-endian: struct's native float packing takes a
        # quarter less time than its standard one, the same bytes)
        self._pack = struct.Struct(f"{'' if sys.byteorder == 'little' else '<'}{dims}f")
        self._f4 = self.np.dtype("<f4")
        # one index per (root, dims): stores that share them share the vector space
        self.id = xxh3_64_hexdigest(json.dumps([keys.store, dims]).encode())
        self.cluster = kv.config.cluster.enabled
        self._file: VectorFile | None = None
        self._warned = False

    # ------------------------------------------------------------------ embedding
    def texts(self, value: Mapping[str, Any], index: Any) -> list[tuple[str, str]]:
        """The ``(path, text)`` pairs of ``value`` to embed (``index`` a put's ``index=``:
        None for the store's fields, False for none, or a list of fields), as
        ``InMemoryStore`` extracts them."""
        if index is False:
            return []
        if index is None and self._plain and type(value) is dict:
            # (get_text_at_path's answer for a one-key path, when the key holds a str or
            # nothing; anything else takes the walker)
            fast: list[tuple[str, str]] = []
            for path, field in self.fields:
                text = value.get(field[0])
                if type(text) is str:
                    fast.append((path, text))
                elif text is not None:
                    break
            else:
                return fast
        paths = self.fields if index is None else [(ix, tokenize_path(ix)) for ix in index]
        out: dict[str, str] = {}
        for path, field in paths:
            texts = get_text_at_path(value, field)
            if len(texts) > 1:
                for i, text in enumerate(texts):
                    out[f"{path}.{i}"] = text
            elif texts:
                out[path] = texts[0]
        return list(out.items())

    def blobs(self, vectors: list[Any], finite: bool = False) -> list[bytes]:
        """``vectors`` as unit float32 rows, each its little-endian bytes (what a record
        and the host's matrix hold): :meth:`unit`'s rows (within float32 rounding),
        without its NumPy conversion of a list of Python floats, which was most of an
        indexed put's time: a list of ``dims`` floats in one pass in C
        (``_l2core.unit_f32``), anything else (other numbers, a zero, nan or huge vector)
        packed by ``struct`` and divided by NumPy. Raises ConfigError for a vector not of
        ``dims`` numbers (:meth:`check_dims`); with ``finite`` (a store's put) also for
        a vector holding NaN or a number beyond float32 (it would score NaN against every
        query)."""
        pack, frombuffer, f4, out = self._pack.pack, self.np.frombuffer, self._f4, []
        dims = self.dims
        for v in vectors:
            b = unit_f32(v, dims)
            if b is not None:
                out.append(b)
                continue
            try:
                row = frombuffer(pack(*v), f4)
            except (TypeError, OverflowError, struct.error):
                # (not dims plain numbers: NumPy's conversion, as before)
                self.check_dims([v])
                if finite:
                    self._check_finite(self.np.asarray(v, dtype="<f4"))
                out.append(self.unit([v]).tobytes())
                continue
            if finite:
                self._check_finite(row)
            r64 = row.astype("<f8")
            n = math.sqrt(r64.dot(r64))
            # (a zero vector, or one beyond float32 (inf), or nan: as unit() leaves them)
            out.append((r64 / n).astype(f4).tobytes() if 0.0 < n < math.inf
                       else self.unit([v]).tobytes())
        return out

    def _check_finite(self, row: Any) -> None:
        if not self.np.isfinite(row).all():
            raise ConfigError("", "the embedding function returned a vector holding NaN or "
                                  "a number beyond float32 (about 3.4e38): it would score NaN "
                                  "against every query; nothing was stored. Fix the embedding "
                                  "(or its input text)")

    def unit(self, vectors: Any) -> Any:
        """``vectors`` (a list of lists) as unit float32 rows (a zero vector stays zero)."""
        np = self.np
        m = np.array(vectors, dtype="<f4").reshape(-1, self.dims)
        # (norms in float64: a float32 vector's may overflow float32, or its squares fall
        # below it, 1e19 or 1e-22 in every element; InMemoryStore scores in float64)
        m64 = m.astype("<f8")
        norms = np.sqrt(np.einsum("ij,ij->i", m64, m64))
        norms[norms == 0] = 1.0
        return (m64 / norms[:, None]).astype("<f4")

    def check_dims(self, vectors: list[Any]) -> None:
        for v in vectors:
            if len(v) != self.dims:
                raise ConfigError("", f"the embedding function returned a vector of {len(v)} "
                                      f"dimensions; index['dims'] is {self.dims}")

    def record_part(self, paths: list[str], blobs: list[bytes]) -> list[Any]:
        """The record's vectors part (its sixth element) for ``blobs`` (unit rows'
        bytes: :meth:`blobs`) of ``paths``."""
        stamp = random.getrandbits(63) | 1  # (0 marks a free row; tells puts apart, no secret)
        return [self.id, stamp, [[p, b] for p, b in zip(paths, blobs, strict=True)]]

    def vectors_of(self, raw: Any) -> tuple[int, Any] | None:
        """``(stamp, unit rows)`` of a record's vectors part of this index, or None (no
        vectors of this index). Raises ValueError for a malformed one."""
        part = record_vectors(raw)
        if type(part) is not list or len(part) != 3 or part[0] != self.id:
            return None
        stamp, pairs = part[1], part[2]
        # (a stamp is what record_part draws: 1 .. 2**63-1; any other would poison the
        # vector file's repair: its stamps are unsigned 64-bit, 0 a free row)
        if type(stamp) is not int or not 0 < stamp < 1 << 63 or type(pairs) is not list:
            raise ValueError("its vectors are not [index id, stamp, [[path, bytes]...]]")
        if not pairs:
            return None
        blobs = [p[1] for p in pairs]
        if any(type(b) is not bytes or len(b) != 4 * self.dims for b in blobs):
            raise ValueError(f"its vectors are not {self.dims} float32s")
        return stamp, self.np.frombuffer(b"".join(blobs), dtype="<f4").reshape(-1, self.dims)

    def query_vector(self, q: list[float]) -> Any:
        self.check_dims([q])
        return self.unit([q])[0]

    # ------------------------------------------------------------------ the host's matrix
    @property
    def file(self) -> VectorFile | None:
        """The host's matrix (None in cluster mode: searches read the records there)."""
        if self._file is None and not self.cluster:
            c = self.kv.config.cache
            self._file = VectorFile.open(self.np, self.kv.name, self.id, self.dims, self.capacity,
                                         c.max_key_bytes, c.l2_permissions, c.l2_dir)
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _rows_of_record(self, key_b: bytes) -> tuple[int, Any]:
        """``(stamp, unit rows)`` of the record of ``key_b``, ``(0, None)`` when it has none
        of this index (or none readable)."""
        raw = self.kv.get(key_b.decode("utf-8", "surrogatepass"))
        try:
            got = self.vectors_of(raw)
        except ValueError:
            got = None
        return (0, None) if got is None else got

    def _repair(self, key_b: bytes) -> None:
        """Rebuild the rows of ``key_b`` from its record (a writer died mid-change)."""
        f = self._file
        assert f is not None
        if not f.set_rows(key_b, *self._rows_of_record(key_b)):
            self._overflowed()

    def write(self, key: str, change: Callable[[], tuple[int, Any]]) -> None:
        """Run ``change()``, which writes ``key``'s record and returns ``(stamp, rows)`` of
        its vectors (unit float32 rows or their bytes; ``(0, None)`` when the item has none
        now), with the host's rows of ``key`` kept in step (a writer killed meanwhile: see
        :mod:`kvcomm.tiers.vectors`)."""
        f = self.file
        if f is None:
            change()
        elif not f.update(key.encode("utf-8", "surrogatepass"), change, self._repair):
            self._overflowed()

    def repair(self, key: str) -> None:
        """Rebuild the host's rows of ``key`` from its record (a search found them stale)."""
        f = self.file
        if f is not None:
            key_b = key.encode("utf-8", "surrogatepass")
            if not f.update(key_b, lambda: self._rows_of_record(key_b), self._repair):
                self._overflowed()

    def _overflowed(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"KVCommStore's vector index {self._file.path if self._file else ''} is full "
                f"({self.capacity} vectors): searches on this host now read the records "
                "(exact, but O(items)); make the store with a larger index_capacity after "
                "purging the namespace", KVCommWarning, stacklevel=4)

    # ------------------------------------------------------------------ search
    def candidates(self, q: Any, prefix: bytes) -> Any:
        """Rows in descending score: yields ``(row score, key bytes, row stamp)`` of rows
        whose key is under ``prefix``; None when the matrix cannot answer (cluster mode,
        overflowed). The item a writer named in the file (one changing it now, or one that
        died before its rows) comes from its record, in its place by score."""
        f = self.file
        if f is None or f.overflow:
            return None
        named = f.intent_key()
        walk = self._walk(f, q, prefix, named)
        if named is None or not named.startswith(prefix):
            return walk
        try:
            got = self.vectors_of(self.kv.get(named.decode("utf-8", "surrogatepass")))
        except (ValueError, UnicodeDecodeError, KVCommError):
            got = None
        if got is None:
            return walk
        return self._merge(walk, (self.score(got[1], q), named, got[0]))

    @staticmethod
    def _merge(walk: Any, one: tuple[float, bytes, int]) -> Any:
        for c in walk:
            if one is not None and c[0] < one[0]:
                yield one
                one = None  # type: ignore[assignment]
            yield c
        if one is not None:
            yield one

    def _walk(self, f: VectorFile, q: Any, prefix: bytes, skip: bytes | None) -> Any:
        np = self.np
        scores, stamps = f.scores(q)
        neg = -scores
        n = len(scores)
        done, k = 0, 64
        while done < n:
            # the rows scoring at least the k-th best, by (score desc, row): each round's
            # list extends the last one's, ties included, so no row is skipped
            if k < n:
                sel = np.flatnonzero(neg <= np.partition(neg, k - 1)[k - 1])
            else:
                sel = np.arange(n)
            order = sel[np.lexsort((sel, neg[sel]))]
            for r in order[done:]:
                r = int(r)
                s = float(scores[r])
                if s == -np.inf:
                    return
                key = f.key_at(r)
                if key.startswith(prefix) and key != skip:
                    yield s, key, int(stamps[r])
            done, k = len(order), k * 4

    def score(self, rows: Any, q: Any) -> float:
        """The item's score: the best cosine of its vectors (InMemoryStore's max pooling)."""
        return float((rows.astype(self.np.float64) @ q.astype(self.np.float64)).max())


def _plain(field: Any) -> bool:
    """Whether the tokenized path ``field`` names one key of the value (not ``$``, an
    index, a wildcard, several fields or a nested path)."""
    return (type(field) is list and len(field) == 1 and field[0] != "*"
            and field[0][:1] not in ("[", "{"))


def record_vectors(raw: Any) -> Any:
    """A record's vectors part, or None: its 6th element (``[..., ttl or None, vectors]``),
    or a 5th that is a list (the layout before ttls; a ttl is a number)."""
    if type(raw) is not list:
        return None
    if len(raw) == 6:
        return raw[5]
    if len(raw) == 5 and type(raw[4]) is list:
        return raw[4]
    return None


def bad_vectors(namespace: tuple[str, ...], key: str, exc: Exception) -> CorruptRecord:
    return CorruptRecord(f"store item {key!r} of namespace {namespace!r} in KVCOMM has "
                         f"vectors KVCommStore did not write ({exc}); put it again or delete it")
