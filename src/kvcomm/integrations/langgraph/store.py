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
* Semantic (vector) search is not provided: a store made with ``index=`` raises
  ConfigError, and ``search(query=...)`` raises InvalidArgument (nothing is read).
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
* Async: on a ``kvcomm.aio`` client ``abatch`` (every async method) is native: inline on
  the event loop, only a call that would wait running in the aio client's pool
  (``_kv.run_async``); on a sync client, in the loop's default thread executor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from datetime import UTC, datetime
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
    KVCommError,
    Unavailable,
)
from ._keys import DEFAULT_ROOT, Keys
from ._kv import run_async, scan, sync_and_aio
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
    is accepted only as None: vector search is not provided (ConfigError otherwise).

    Operations raise LangGraph's InvalidNamespaceError for a bad namespace label, and
    what the client raises (kvcomm.KVCommError: InvalidKey when a namespace and key do
    not fit ``cache.max_key_bytes``, Unavailable...). ``batch`` applies its operations
    in order; one that raises leaves the earlier ones applied.
    """

    __slots__ = ("kv", "keys", "serde", "ttl_config", "aio")

    supports_ttl: bool = True

    def __init__(self, kv: Client | AsyncClient, *, serde: Any | None = None,
                 root: str = DEFAULT_ROOT, index: Any | None = None,
                 ttl: TTLConfig | None = None) -> None:
        kv, aio = sync_and_aio(kv, "KVCommStore")
        if index is not None:
            raise ConfigError("", "KVCommStore does not provide semantic (vector) search: make it "
                                  "without index= (search by namespace prefix and filter works)")
        if ttl is not None:
            if not isinstance(ttl, dict):
                raise InvalidArgument(f"ttl is LangGraph's TTLConfig, a dict such as "
                                      f"{{'default_ttl': 60, 'refresh_on_read': True}} (minutes), "
                                      f"got {ttl!r}")
            _minutes(ttl.get("default_ttl"), "ttl['default_ttl']")
        self.kv = kv
        self.keys = Keys(root, kv.config.cache.max_key_bytes)
        self.serde = no_pickle(serde)
        self.ttl_config = ttl
        self.aio = aio

    # ---------------------------------------------------------------- batch
    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` in order; their results in the same order."""
        results: list[Result] = []
        for op in ops:
            validate_op_namespace(op)
            if isinstance(op, GetOp):
                results.append(self._get(op.namespace, op.key, op.refresh_ttl))
            elif isinstance(op, PutOp):
                if op.value is None:
                    self.kv.delete(self.keys.item(op.namespace, op.key))
                else:
                    self._put(op.namespace, op.key, op.value, _minutes(op.ttl, "ttl"))
                results.append(None)
            elif isinstance(op, SearchOp):
                results.append(self._search(op))
            elif isinstance(op, ListNamespacesOp):
                results.append(self._list_namespaces(op))
            else:
                raise InvalidArgument(f"unknown LangGraph store operation {type(op).__name__}")
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch`, native on a ``kvcomm.aio`` client (see ``_kv.run_async``)."""
        return await run_async(self.aio, self.batch, (list(ops),), {})

    # ---------------------------------------------------------------- operations
    def _item(self, namespace: tuple[str, ...], key: str, raw: Any,
              cls: type[Item] = Item) -> Any:
        """The Item (or SearchItem) of the stored record ``raw``, which is untrusted (anyone
        with the namespace can write under the store's keys): CorruptRecord naming the
        item for anything but ``[type, bytes, created_ms, updated_ms]`` holding a dict."""
        try:
            if not _is_record(raw):
                raise ValueError(f"not [type, bytes, created_ms, updated_ms(, ttl_minutes)]: "
                                 f"{str(raw)[:120]}")
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
        """The item's own ttl (minutes, its record's 5th field) again, from now."""
        if len(raw) > 4 and raw[4]:
            self.kv.touch(key, raw[4] * 60.0)

    def _put(self, namespace: tuple[str, ...], key: str, value: Any,
             ttl: float | None = None) -> None:
        """Store the item (keeping its created time) with ``ttl`` minutes to live, or
        none (None: until deleted, whatever deadline it had)."""
        t, b = self.serde.dumps_typed(dict(value))
        k = self.keys.item(namespace, key)
        for _ in range(10_000):
            now = _ms_now()
            old = self.kv.get_item(k)
            # (a put replaces the item whole: one that is not a KVCommStore record is
            # replaced too, its created_at then now)
            record = [t, b, old.value[2] if old is not None and _is_record(old.value) else now,
                      now]
            if ttl is not None:
                record.append(ttl)
            try:
                self.kv.put(k, record, expect=ABSENT if old is None else old.version,
                            ttl=None if ttl is None else ttl * 60.0)
                return
            except ConflictError:
                continue  # (another writer put it meanwhile: keep its created time)
        raise Unavailable(f"put of store item {key!r} lost 10000 races in a row")

    def _search(self, op: SearchOp) -> list[SearchItem]:
        if op.query:
            raise InvalidArgument("KVCommStore has no semantic search: search without query= "
                                  "(by namespace prefix, filter, limit and offset)")
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
    updated_ms] and perhaps its ttl in minutes (a number > 0), times as ints a datetime
    can hold."""
    return (type(raw) is list and len(raw) in (4, 5) and type(raw[0]) is str
            and type(raw[1]) is bytes and all(type(ms) is int and 0 <= ms <= _MAX_MS
                                              for ms in raw[2:4])
            and (len(raw) == 4 or (type(raw[4]) in (int, float)
                                   and 0 < raw[4] <= MAX_TTL / 60)))


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
