"""KVCommStore: a LangGraph store (``BaseStore``) on a KVCOMM client.

One KVCOMM key per item, ``lg/st/<label>/<label>/.../=<key>`` (``_keys.py``: labels and
keys escaped), holding ``[type, bytes, created_ms, updated_ms]``: the item's value through
LangGraph's serializer protocol (``JsonPlusSerializer`` by default; never pickle), and its
times. So:

* ``put``/``get``/``delete`` are one KVCOMM put/get/delete of an eventual key: on the host,
  linearizable; across hosts, last-writer-wins by hybrid logical clock, converging with
  the change feeds (a ``get`` on another host reads L3 on a miss). ``put`` keeps an
  existing item's ``created_at``.
* ``search(prefix, filter=, limit=, offset=)`` is one ``kv.scan`` of the namespace
  prefix's key prefix (every host's items, in cluster mode: ``kv.scan``'s contract), each
  item decoded and matched against ``filter`` (LangGraph's operators: equality, nested
  dicts, ``$eq $ne $gt $gte $lt $lte``), then paged. Results come in **key order**
  (the items' KVCOMM keys by UTF-8 bytes: escaped labels, then ``=`` and the key, so an
  item of ``("a",)`` comes after those of ``("a", "*")``, ``*`` sorting before ``=``;
  LangGraph's ``InMemoryStore`` returns insertion order, which no distributed store can
  keep), so pages are stable.
* ``list_namespaces`` scans the prefix's keys and lists the namespaces that hold at least
  one item (as LangGraph's SQL stores do: a namespace whose items were all deleted is
  gone), sorted, with ``prefix``/``suffix`` (``*`` wildcards), ``max_depth`` and paging.
  It reads every item key under the prefix: it is a tool for exploring, not a hot path.
* Semantic search (``index=``, LangGraph's ``IndexConfig``; ``_semantic.py``): a put
  embeds the item's fields and keeps the vectors in the item's record (its sixth element),
  and in the host's shared-memory matrix (:mod:`kvcomm.tiers.vectors`);
  ``search(query=...)`` embeds the query, multiplies the matrix by it in one pass, and
  checks each candidate against its record; scores are cosines, max-pooled over an
  item's vectors, best first, items without vectors after them (``InMemoryStore``'s
  rules). In cluster mode (and on a host whose index is full) a search scores the
  records of the namespace prefix instead (``kv.scan``: every host's items). Without
  ``index=``, ``search(query=...)`` raises InvalidArgument.
* **TTL** (``supports_ttl`` is True), LangGraph's store contract: ``put(..., ttl=)`` is in
  **minutes** (``BaseStore.put``: "Time to live in minutes"; ``KVCommSaver``'s ``ttl``
  is in seconds, KVCOMM's unit), ``None`` keeps the item until deleted, and
  ``KVCommStore(kv, ttl={"default_ttl": minutes, "refresh_on_read": True})`` (LangGraph's
  ``TTLConfig``) gives the default. The item becomes a KVCOMM key with that ttl: it is
  gone for every reader on every host once it expires (no sweeper: ``sweep_interval_minutes``
  is accepted and unused; expired items are never returned, as ``omit_expired``). A
  ``get`` or ``search`` with ``refresh_ttl`` (by default ``refresh_on_read``, itself True
  by default) gives each item it returns its whole ttl again, from now (``kv.touch``: a
  conditional write, never bringing back an item replaced or deleted meanwhile). Each item
  keeps its own ttl (in its record) for that.
* Async: ``abatch`` (every async method) first embeds through the embeddings' async
  methods, in the loop; then, on a ``kvcomm.aio`` client, it is native: inline on the
  event loop, only a call that would wait running in the aio client's pool
  (``_kv.run_async``); on a sync client, in the loop's default thread executor.
* The record: ``[type, bytes, created_ms, updated_ms]``, then ``ttl_minutes`` when the
  item has a ttl, and, when it has vectors, ``[..., ttl_minutes or None, vectors]``
  (6 elements). A ttl is a number, vectors a list: records of either older 5-element
  layout (ttl only, or vectors only) are read too.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from operator import index as _index
from typing import Any

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
    validate_op_namespace,
)

from ..._client import ABSENT, Client
from ...aio import AsyncClient
from ...core.expiry import MAX_TTL
from ...errors import (
    ConfigError,
    ConflictError,
    CorruptRecord,
    InvalidArgument,
    InvalidKey,
    KVCommError,
    Unavailable,
)
from ._keys import DEFAULT_ROOT, Keys
from ._kv import run_async, scan, sync_and_aio
from ._semantic import DEFAULT_CAPACITY, SemanticIndex, bad_vectors
from ._serde import no_pickle


def _ms_now() -> int:
    return time.time_ns() // 1_000_000


def _dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class KVCommStore(BaseStore):
    """A LangGraph store keeping items in KVCOMM (see the module docstring).

    ``kv`` is an open client (never closed by the store), ``serde`` a LangGraph
    serializer for the items' values (one that pickles is refused: ConfigError),
    ``root`` the key prefix (default ``"lg/"``; items under ``root + "st/"``). ``index``
    is LangGraph's ``IndexConfig`` (``dims``, ``embed``: a sync or async callable or a
    LangChain ``Embeddings``, ``fields``) for semantic search (needs numpy:
    ``kvcomm[numpy]``); ``index_capacity`` bounds the vectors of the host's index
    (default 100,000: beyond it searches read the records; see docs/integrations/langgraph.md).

    Operations raise LangGraph's InvalidNamespaceError for a bad namespace label, and
    what the client raises (kvcomm.KVCommError: InvalidKey when a namespace and key do
    not fit ``cache.max_key_bytes``, Unavailable...). ``batch`` runs its reads first,
    then its writes (see :meth:`batch`); an invalid op raises before any runs, one that
    fails when it runs leaves those run before it applied.
    """

    __slots__ = ("kv", "keys", "serde", "ttl_config", "aio", "_sem")

    supports_ttl: bool = True

    def __init__(self, kv: Client | AsyncClient, *, serde: Any | None = None,
                 root: str = DEFAULT_ROOT, index: Any | None = None,
                 index_capacity: int = DEFAULT_CAPACITY, ttl: TTLConfig | None = None) -> None:
        kv, aio = sync_and_aio(kv, "KVCommStore")
        if ttl is not None:
            if not isinstance(ttl, dict):
                raise InvalidArgument(f"ttl is LangGraph's TTLConfig, a dict such as "
                                      f"{{'default_ttl': 60, 'refresh_on_read': True}} (minutes), "
                                      f"got {ttl!r}")
            unknown = sorted(set(ttl) - _TTL_KEYS, key=str)
            if unknown:
                raise InvalidArgument(f"ttl (LangGraph's TTLConfig) has no key {unknown[0]!r}: "
                                      f"its keys are {', '.join(sorted(_TTL_KEYS))}")
            _minutes(ttl.get("default_ttl"), "ttl['default_ttl']")
            for flag in ("refresh_on_read", "omit_expired"):  # (0 and 1 pass, as they did)
                if not isinstance(ttl.get(flag, True), bool | int):
                    raise InvalidArgument(f"ttl[{flag!r}] is True or False, got {ttl[flag]!r}")
        self.kv = kv
        self.keys = Keys(root, kv.config.cache.max_key_bytes)
        self.serde = no_pickle(serde)
        self.ttl_config = ttl
        self.aio = aio
        self._sem = None if index is None else SemanticIndex(kv, self.keys, index, index_capacity)

    # ---------------------------------------------------------------- batch
    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops``, as LangGraph's own stores run a batch: its reads (get, search,
        list_namespaces) first, in order, on what was stored before the batch; then its
        puts and deletes, the last of each item's only. Results in the order of ``ops``.
        Every op is checked before any runs (and before any text is embedded)."""
        ops = list(ops)
        order = self._order(ops)
        sem = self._sem
        if sem is None:
            return self._batch(ops, None, order)
        op = ops[0] if len(ops) == 1 else None
        if type(op) is PutOp and op.value is not None:
            # (put()'s one op, the common call: its texts embedded and made rows without
            # the tables a batch of many needs; what _batch does with them)
            pairs = sem.texts(op.value, op.index)
            vectors = None
            if pairs:
                docs = sem.embeddings.embed_documents([t for _p, t in pairs])
                _check_count(docs, pairs)
                vectors = ([p for p, _t in pairs], sem.blobs(docs, finite=True))
            self._put(op.namespace, op.key, op.value, _minutes(op.ttl, "ttl"), vectors)
            return [None]
        texts, queries = self._to_embed(ops, order)
        emb = sem.embeddings
        docs = emb.embed_documents([t[2] for t in texts]) if texts else []
        qv = {q: emb.embed_query(q) for q in queries} if queries else {}
        return self._batch(ops, self._embedded(texts, docs, qv), order)

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch`: the embeddings' async methods called in the loop, the rest native
        on a ``kvcomm.aio`` client, in the loop's default executor on a sync one
        (``_kv.run_async``)."""
        ops = list(ops)
        order = self._order(ops)
        prepared = None
        if self._sem is not None:
            texts, queries = self._to_embed(ops, order)
            emb = self._sem.embeddings
            docs = await emb.aembed_documents([t for _i, _p, t in texts]) if texts else []
            qv = list(await asyncio.gather(*(emb.aembed_query(q) for q in queries)))
            prepared = self._embedded(texts, docs, dict(zip(queries, qv, strict=True)))
        if self.aio is None or len(ops) <= 1:
            return await run_async(self.aio, self._batch, (ops, prepared, order), {})
        # (one op per attempt: an op that meets a held lock runs again in the pool alone,
        # never the writes of the ops before it, which another process may have replaced
        # since; each op raises WouldBlock before its own write: see _kv.run_async)
        results: list[Result] = [None] * len(ops)
        for i in order:
            (results[i],) = await run_async(self.aio, self._run, ([(i, ops[i])], prepared), {})
        return results

    def _order(self, ops: list[Op]) -> list[int]:
        """The positions of ``ops`` in the order a batch runs them (LangGraph's
        InMemoryStore and PostgresStore: reads first, in order; then the last put or
        delete of each item), each op checked first: what it would raise when run
        (namespace, key and its length, value, ttl, search and list arguments) it raises
        here, before anything runs. One op alone (the store's own get, put, search...) has
        its key's length checked as it runs: it makes its key before it writes."""
        if len(ops) == 1:
            _check(ops[0])
            return [0]
        writes: dict[tuple[Any, Any], int] = {}
        reads = []
        for i, op in enumerate(ops):
            _check(op)
            if isinstance(op, GetOp | PutOp):
                self.keys.item(op.namespace, op.key)  # (InvalidKey when it cannot fit)
            if isinstance(op, PutOp):
                writes[op.namespace, op.key] = i
            else:
                reads.append(i)
        return reads + sorted(writes.values())

    def _to_embed(self, ops: list[Op], order: list[int]
                  ) -> tuple[list[tuple[int, str, str]], list[str]]:
        """The texts to embed of the puts that run (``order``: :meth:`_order`'s), as
        ``(op's position, path, text)``, and their searches' queries."""
        assert self._sem is not None
        texts: list[tuple[int, str, str]] = []
        queries: list[str] = []
        for i in order:
            op = ops[i]
            if isinstance(op, PutOp) and op.value is not None:
                for p, t in self._sem.texts(op.value, op.index):
                    texts.append((i, p, t))
            elif isinstance(op, SearchOp) and op.query and op.query not in queries:
                queries.append(op.query)
        return texts, queries

    def _embedded(self, texts: list[tuple[int, str, str]], docs: list[Any],
                  queries: dict[str, Any]) -> dict[Any, Any]:
        """``{op position: (paths, unit rows' bytes)}`` and ``{query: unit vector}`` in one
        dict."""
        sem = self._sem
        assert sem is not None
        _check_count(docs, texts)
        out: dict[Any, Any] = {}
        for (i, path, _t), blob in zip(texts, sem.blobs(docs, finite=True), strict=True):
            got = out.get(i)
            if got is None:
                out[i] = ([path], [blob])
            else:
                got[0].append(path)
                got[1].append(blob)
        if queries:
            for q, v in queries.items():
                out[q] = sem.query_vector(v)
        return out

    def _batch(self, ops: list[Op], prepared: dict[Any, Any] | None,
               order: list[int]) -> list[Result]:
        """``ops``' results, in order, run in ``order`` (:meth:`_order`'s)."""
        if len(ops) == 1:
            return self._run([(0, ops[0])], prepared)
        results: list[Result] = [None] * len(ops)
        for i, result in zip(order, self._run([(i, ops[i]) for i in order], prepared),
                             strict=True):
            results[i] = result
        return results

    def _run(self, ops: list[tuple[int, Op]], prepared: dict[Any, Any] | None) -> list[Result]:
        """The results of ``ops`` (each with its position in the batch ``prepared`` was
        made for), run in the order given; each op checked by :meth:`_order` already."""
        results: list[Result] = []
        for i, op in ops:
            if isinstance(op, GetOp):
                results.append(self._get(op.namespace, op.key, op.refresh_ttl))
            elif isinstance(op, PutOp):
                if op.value is None:
                    self._delete(op.namespace, op.key)
                else:
                    self._put(op.namespace, op.key, op.value, _minutes(op.ttl, "ttl"),
                              None if prepared is None else prepared.get(i))
                results.append(None)
            elif isinstance(op, SearchOp):
                results.append(self._search(op, prepared))
            else:  # (a ListNamespacesOp: _order let no other kind through)
                results.append(self._list_namespaces(op))
        return results

    # ---------------------------------------------------------------- operations
    def _item(self, namespace: tuple[str, ...], key: str, raw: Any,
              cls: type[Item] = Item) -> Any:
        """The Item (or SearchItem) of the stored record ``raw``, which is untrusted (anyone
        with the namespace can write under the store's keys): CorruptRecord naming the
        item for anything but ``[type, bytes, created_ms, updated_ms]`` holding a dict."""
        try:
            if not _is_record(raw):
                raise ValueError(f"not [type, bytes, created_ms, updated_ms(, ttl_minutes)"
                                 f"(, vectors)]: {str(raw)[:120]}")
            t, b, created, updated = raw[:4]
            value = self.serde.loads_typed((t, b))
            if type(value) is not dict:
                raise TypeError(f"its value is a {type(value).__name__}, not a dict")
        except KVCommError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                NotImplementedError, RecursionError) as exc:
            raise CorruptRecord(f"store item {key!r} of namespace {namespace!r} in KVCOMM is "
                                f"not one KVCommStore wrote ({type(exc).__name__}: "
                                f"{str(exc)[:200]}); delete it") from None
        if cls is SearchItem:
            return SearchItem(namespace, key, value, _dt(created), _dt(updated))
        return Item(value=value, key=key, namespace=namespace, created_at=_dt(created),
                    updated_at=_dt(updated))

    def _get(self, namespace: tuple[str, ...], key: str, refresh: bool = False) -> Item | None:
        k = self.keys.item(namespace, key)
        raw = self.kv.get(k)
        if raw is None:
            return None
        item = self._item(namespace, key, raw)
        if refresh:
            self._refresh(k, raw)
        return item  # type: ignore[no-any-return]

    def _refresh(self, key: str, raw: list[Any]) -> None:
        """The item's own ttl (minutes, in its record) again, from now."""
        ttl = _ttl_of(raw)
        if ttl:
            self.kv.touch(key, ttl * 60.0)

    def _put(self, namespace: tuple[str, ...], key: str, value: Any,
             ttl: float | None = None,
             vectors: tuple[list[str], list[bytes]] | None = None) -> None:
        """Store the item (keeping its created time) with ``ttl`` minutes to live, or
        none (None: until deleted, whatever deadline it had), and its ``vectors`` (paths,
        unit rows' bytes) in its record and the host's index. ``value``: a put's, checked
        by :meth:`_order`."""
        t, b = self.serde.dumps_typed(dict(value))
        part = None if vectors is None else self._sem.record_part(*vectors)  # type: ignore[union-attr]
        k = self.keys.item(namespace, key)

        def change() -> tuple[int, Any]:
            for _ in range(10_000):
                now = _ms_now()
                old = self.kv.get_item(k)
                # (a put replaces the item whole, its vectors too: one that is not a
                # KVCommStore record is replaced too, its created_at then now)
                record: list[Any] = [t, b, old.value[2] if old is not None
                                     and _is_record(old.value) else now, now]
                if part is not None:
                    record += [ttl, part]
                elif ttl is not None:
                    record.append(ttl)
                try:
                    self.kv.put(k, record, expect=ABSENT if old is None else old.version,
                                ttl=None if ttl is None else ttl * 60.0)
                    return (0, None) if part is None else (part[1], vectors[1])  # type: ignore[index]
                except ConflictError:
                    continue  # (another writer put it meanwhile: keep its created time)
            raise Unavailable(f"put of store item {key!r} lost 10000 races in a row")

        if self._sem is None:
            change()
        else:
            self._sem.write(k, change)

    def _delete(self, namespace: tuple[str, ...], key: str) -> None:
        item_key = self.keys.item(namespace, key)
        if self._sem is None:
            self.kv.delete(item_key)
            return

        def change() -> tuple[int, Any]:
            self.kv.delete(item_key)
            return 0, None

        self._sem.write(item_key, change)

    def _search(self, op: SearchOp, prepared: dict[Any, Any] | None = None) -> list[SearchItem]:
        if op.query:
            if self._sem is None or prepared is None:
                raise InvalidArgument("this KVCommStore has no semantic search (make it with "
                                      "index=...): search without query= (by namespace prefix, "
                                      "filter, limit and offset)")
            raws: dict[str, Any] = {}
            found = self._semantic_search(op, prepared[op.query], raws)
            if op.refresh_ttl:
                for it in found:
                    k = self.keys.item(it.namespace, it.key)
                    self._refresh(k, raws[k])
            return found
        out: list[SearchItem] = []
        skip = op.offset
        if op.limit <= 0:
            return out
        for entry in scan(self.kv, self.keys.store_prefix(op.namespace_prefix)):
            namespace, key = self.keys.parse_item(entry.key)
            item = self._item(namespace, key, entry.value, SearchItem)
            if op.filter and not all(_compare_values(item.value.get(fk), fv)
                                     for fk, fv in op.filter.items()):
                continue
            if skip > 0:
                skip -= 1
                continue
            out.append(item)
            if op.refresh_ttl:
                self._refresh(entry.key, entry.value)
            if len(out) >= op.limit:
                break
        return out

    def _matches(self, op: SearchOp, item: SearchItem) -> bool:
        return not op.filter or all(_compare_values(item.value.get(fk), fv)
                                    for fk, fv in op.filter.items())

    def _vectors(self, item: SearchItem, raw: Any) -> Any:
        assert self._sem is not None
        try:
            return self._sem.vectors_of(raw)
        except ValueError as exc:
            raise bad_vectors(item.namespace, item.key, exc) from None

    def _semantic_search(self, op: SearchOp, q: Any, raws: dict[str, Any]) -> list[SearchItem]:
        """The best items under ``op``'s prefix for the unit query vector ``q`` (see the
        module docstring); ``raws`` gets the records read, by KVCOMM key."""
        sem = self._sem
        assert sem is not None
        if op.limit <= 0:
            return []
        need = op.offset + op.limit
        prefix = self.keys.store_prefix(op.namespace_prefix)
        cands = sem.candidates(q, prefix.encode("utf-8", "surrogatepass"))
        if cands is None:
            return self._scan_search(op, q, raws)
        kept: list[tuple[float, SearchItem]] = []
        seen: set[bytes] = set()
        for _s, key_b, stamp in cands:
            if key_b in seen:
                continue
            seen.add(key_b)
            key = key_b.decode("utf-8", "surrogatepass")
            raw = self.kv.get(key)
            if raw is None:
                continue  # (deleted meanwhile)
            item = self._item(*self.keys.parse_item(key), raw, SearchItem)
            raws[key] = raw
            got = self._vectors(item, raw)
            if got is None or got[0] != stamp:
                # a row the record no longer has (written meanwhile, or not through this
                # host's index): mend it and read the records this once
                sem.repair(key)
                return self._scan_search(op, q, raws)
            if self._matches(op, item):
                kept.append((sem.score(got[1], q), item))
                if len(kept) >= need:
                    break
        kept.sort(key=lambda si: -si[0])
        return self._with_scores(op, kept[op.offset:need], prefix, None, raws)

    def _scan_search(self, op: SearchOp, q: Any, raws: dict[str, Any]) -> list[SearchItem]:
        """Semantic search over the records under ``op``'s prefix (cluster mode, a full
        index, a stale row)."""
        sem = self._sem
        assert sem is not None
        prefix = self.keys.store_prefix(op.namespace_prefix)
        scored: list[tuple[float, SearchItem]] = []
        scoreless: list[SearchItem] = []
        for entry in scan(self.kv, prefix):
            item = self._item(*self.keys.parse_item(entry.key), entry.value, SearchItem)
            if not self._matches(op, item):
                continue
            raws[entry.key] = entry.value
            got = self._vectors(item, entry.value)
            if got is None:
                scoreless.append(item)
            else:
                scored.append((sem.score(got[1], q), item))
        scored.sort(key=lambda si: -si[0])
        return self._with_scores(op, scored[op.offset:op.offset + op.limit], prefix, scoreless,
                                 raws)

    def _with_scores(self, op: SearchOp, kept: list[tuple[float, SearchItem]], prefix: str,
                     scoreless: list[SearchItem] | None,
                     raws: dict[str, Any]) -> list[SearchItem]:
        """``kept`` with their scores, then (InMemoryStore's rule) items without vectors
        to fill ``op.limit``, in key order."""
        out = [SearchItem(i.namespace, i.key, i.value, i.created_at, i.updated_at, s)
               for s, i in kept]
        if len(out) < op.limit:
            if scoreless is None:
                scoreless = []
                for entry in scan(self.kv, prefix):
                    item = self._item(*self.keys.parse_item(entry.key), entry.value, SearchItem)
                    if self._matches(op, item) and self._vectors(item, entry.value) is None:
                        raws[entry.key] = entry.value
                        scoreless.append(item)
                        if len(out) + len(scoreless) >= op.limit:
                            break
            out.extend(scoreless[:op.limit - len(out)])
        return out

    def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        prefix: tuple[str, ...] = ()
        for cond in op.match_conditions or ():
            if cond.match_type == "prefix" and "*" not in cond.path:
                prefix = tuple(cond.path)  # (narrows the scan; still checked below)
        seen: set[tuple[str, ...]] = set()
        for entry in scan(self.kv, self.keys.store_prefix(prefix)):
            namespace, _key = self.keys.parse_item(entry.key)
            if all(_does_match(c, namespace) for c in op.match_conditions or ()):
                seen.add(namespace if op.max_depth is None else namespace[:op.max_depth])
        return sorted(seen)[op.offset:op.offset + op.limit]


def _check(op: Op) -> None:
    """What a batch checks of each op before any runs, but its key's length (the store
    makes the key: :meth:`KVCommStore._order`)."""
    if not isinstance(op, GetOp | PutOp | SearchOp | ListNamespacesOp):
        raise InvalidArgument(f"unknown LangGraph store operation {type(op).__name__}")
    _validate(op)
    if isinstance(op, PutOp) and op.value is not None:
        _check_value(op.value)
        _minutes(op.ttl, "ttl")


def _check_value(value: Any) -> None:
    """InvalidArgument unless ``value`` (a put's) is a dict (a mapping), as LangGraph's
    stores take it."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"a store item's value is a dict, got a {type(value).__name__}"
                              f" ({str(value)[:60]!r}): wrap it, e.g. {{'value': ...}}")


def _validate(op: Op) -> None:
    """LangGraph's namespace checks, and a namespace that is a tuple of labels (a str
    would be taken as the tuple of its characters, an item no search finds)."""
    ns = getattr(op, "namespace", None)
    if ns is None:
        ns = getattr(op, "namespace_prefix", ())
    if not isinstance(ns, tuple):
        advice = f"({ns!r},) for one label" if isinstance(ns, str) else \
            f"{tuple(ns)!r}" if isinstance(ns, list) else "a tuple of str labels"
        raise InvalidArgument(f"a namespace is a tuple of str labels, got the "
                              f"{type(ns).__name__} {ns!r}: write {advice}")
    if isinstance(op, GetOp | PutOp):
        if type(op.key) is not str:
            raise InvalidKey(f"a store item's key is a str, got the {type(op.key).__name__} "
                             f"{op.key!r}: write {str(op.key)!r}")
    elif isinstance(op, SearchOp):
        if op.filter is not None and not isinstance(op.filter, dict):
            raise InvalidArgument(f"a search's filter is a dict of field -> value (or "
                                  f"{{'$gt': ...}}...), or None, got {op.filter!r}")
        if op.query is not None and type(op.query) is not str:
            raise InvalidArgument(f"a search's query is a str or None, got {op.query!r}")
        _count(op.limit, "a search's limit")
        _count(op.offset, "a search's offset")
    elif isinstance(op, ListNamespacesOp):
        for cond in op.match_conditions or ():
            if not (isinstance(cond.path, tuple | list) and all(type(p) is str for p in cond.path)):
                raise InvalidArgument(f"list_namespaces' prefix and suffix are tuples of str "
                                      f"labels ('*' matches any), got {cond.path!r}")
        if op.max_depth is not None:
            _count(op.max_depth, "list_namespaces' max_depth")
        _count(op.limit, "list_namespaces' limit")
        _count(op.offset, "list_namespaces' offset")
    validate_op_namespace(op)


_TTL_KEYS = frozenset({"default_ttl", "refresh_on_read", "omit_expired",
                       "sweep_interval_minutes"})  # (TTLConfig's)


def _count(n: Any, what: str) -> None:
    """InvalidArgument unless ``n`` is an integer >= 0 (a NumPy one too, as before)."""
    try:
        ok = _index(n) >= 0
    except TypeError:
        ok = False
    if not ok:
        raise InvalidArgument(f"{what} is an int >= 0, got {n!r}")


def _check_count(docs: list[Any], texts: list[Any]) -> None:
    """ConfigError unless the embedding function returned one vector per text."""
    try:
        len(docs)
    except TypeError:
        raise ConfigError("", f"the embedding function returned a {type(docs).__name__}, not "
                              f"a list of {len(texts)} vectors (one per text)") from None
    if len(docs) != len(texts):
        raise ConfigError("", f"the embedding function returned {len(docs)} vectors for "
                              f"{len(texts)} texts")


def _minutes(ttl: Any, what: str) -> float | None:
    """``ttl`` (LangGraph's minutes) checked: None, or a number > 0 and at most KVCOMM's
    ten years."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) \
            or not 0 < ttl <= MAX_TTL / 60:
        raise InvalidArgument(f"{what} is in MINUTES (LangGraph's store contract): a number > 0 "
                              f"and at most {MAX_TTL / 60:.0f} (ten years), or None for no "
                              f"expiry; got {ttl!r}")
    return float(ttl)


_MAX_MS = 253402300799999  # 9999-12-31T23:59:59.999Z: what a datetime can hold


def _is_record(raw: Any) -> bool:
    """Whether ``raw`` has the shape of a KVCommStore record: [type, bytes, created_ms,
    updated_ms], then its ttl in minutes (a number > 0; None before vectors), then its
    vectors (a list): lengths 4, 5 (ttl, or vectors: the older layouts) or 6, times as
    ints a datetime can hold."""
    if not (type(raw) is list and 4 <= len(raw) <= 6 and type(raw[0]) is str
            and type(raw[1]) is bytes and all(type(ms) is int and 0 <= ms <= _MAX_MS
                                              for ms in raw[2:4])):
        return False
    if len(raw) == 4:
        return True
    if len(raw) == 5:
        return _is_ttl(raw[4]) or type(raw[4]) is list
    return (raw[4] is None or _is_ttl(raw[4])) and type(raw[5]) is list


def _is_ttl(x: Any) -> bool:
    return type(x) in (int, float) and 0 < x <= MAX_TTL / 60


def _ttl_of(raw: list[Any]) -> float | None:
    """The ttl in minutes a (checked) record keeps, or None."""
    return raw[4] if len(raw) > 4 and type(raw[4]) is not list else None


def _does_match(cond: MatchCondition, namespace: tuple[str, ...]) -> bool:
    """LangGraph's namespace match: ``path`` (``*`` matches any label) is a prefix or a
    suffix of ``namespace``."""
    path = tuple(cond.path)
    if len(namespace) < len(path):
        return False
    if cond.match_type == "prefix":
        pairs = zip(namespace, path, strict=False)
    elif cond.match_type == "suffix":
        pairs = zip(reversed(namespace), reversed(path), strict=False)
    else:
        raise InvalidArgument(f"unsupported namespace match type {cond.match_type!r}")
    return all(p == "*" or n == p for n, p in pairs)


def _compare_values(item_value: Any, filter_value: Any) -> bool:
    """LangGraph's filter semantics (JSONB-like): nested dicts match key by key, lists
    element by element, ``{"$op": v}`` applies the operator, anything else is equality."""
    if isinstance(filter_value, dict):
        if any(k.startswith("$") for k in filter_value):
            return all(_apply_operator(item_value, k, v) for k, v in filter_value.items())
        if not isinstance(item_value, dict):
            return False
        return all(_compare_values(item_value.get(k), v) for k, v in filter_value.items())
    if isinstance(filter_value, list | tuple):
        return (isinstance(item_value, list | tuple) and len(item_value) == len(filter_value)
                and all(_compare_values(i, f) for i, f in zip(item_value, filter_value,
                                                              strict=False)))
    return bool(item_value == filter_value)


def _apply_operator(value: Any, operator: str, op_value: Any) -> bool:
    if operator == "$eq":
        return bool(value == op_value)
    if operator == "$ne":
        return bool(value != op_value)
    if operator in ("$gt", "$gte", "$lt", "$lte"):
        try:
            a, b = float(value), float(op_value)
        except (TypeError, ValueError, OverflowError):  # (not a number: no match)
            return False
        return {"$gt": a > b, "$gte": a >= b, "$lt": a < b, "$lte": a <= b}[operator]
    raise InvalidArgument(f"unsupported filter operator {operator!r} (use $eq $ne $gt $gte $lt $lte)")
