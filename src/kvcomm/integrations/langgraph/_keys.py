"""The KVCOMM keys of LangGraph's checkpoints and store items (pure: no LangGraph, no I/O).

A KVCOMM key is a non-empty str of at most ``cache.max_key_bytes`` (250 by default) bytes
of UTF-8 without NUL (``_client/base.py`` ``_key``). LangGraph's ids (thread ids,
checkpoint namespaces, task ids, store namespace labels and keys) are arbitrary strings,
so each one becomes one *component*: ``%`` , ``/`` , ``=``, NUL and the other C0 control
characters are percent-escaped (``%2F``...). A component then never holds ``/``, so

* the mapping from ids to keys is injective (two different tuples of ids never share a
  key), and
* the keys of one thread (or one namespace, or one namespace *prefix* of the store) are
  exactly the keys under one key prefix, which ``kv.scan`` lists in key order.

Saver (``root`` defaults to ``lg/``; ``T`` thread id, ``N`` checkpoint namespace, ``C``
checkpoint id, all escaped)::

    {root}cp/h/T/N/          the thread's head: {"id": latest C, "w": its writes [[task, idx]...],
                             "p": writes of newer checkpoints not yet put}
    {root}cp/c/T/N/C         one checkpoint (immutable): serialized checkpoint, metadata,
                             parent id, run id
    {root}cp/b/T/N/CH/VER    one channel value at one version (immutable)
    {root}cp/w/T/N/C/TASK/IDX  one pending write

Store (``L`` namespace labels, ``K`` the item's key)::

    {root}st/L1/L2/.../=K    one item: serialized value, created and updated times

The ``=`` marks the end of the namespace (labels escape ``=``), so the items of namespace
prefix ``("a",)`` are the keys under ``{root}st/a/``, those of ``("a", "b")`` included and
those of ``("ab",)`` not.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from ..._l2core import plain_component as _plain
from ..._l2core import step_keys, write_keys
from ...errors import InvalidKey

_ESCAPE = re.compile(r"[%/=\x00-\x1f\x7f]")
_UNESCAPE = re.compile(r"%([0-9A-F]{2})")

DEFAULT_ROOT = "lg/"
_TN_MEMO = 4096  # (thread id, namespace) pairs whose escaped form a Keys keeps


def esc(component: str) -> str:
    """``component`` with ``%``, ``/``, ``=`` and control characters percent-escaped.
    Raises InvalidKey for a component that is not a str."""
    if type(component) is not str:
        raise InvalidKey(f"a LangGraph id must be a str, got {type(component).__name__}: "
                         f"{component!r}")
    return _esc(component)


def _escaped(component: str) -> str:
    return _ESCAPE.sub(lambda m: f"%{ord(m.group()):02X}", component)


_esc = functools.lru_cache(maxsize=65536)(_escaped)  # (a run escapes the same ids each step)


def _esc_id(component: str) -> str:
    """:func:`esc` of a checkpoint or task id (new at every step: not memoised); the common
    id, with nothing to escape, is itself (checked in one pass in C: the regular
    expression's search took 6x as long). Raises InvalidKey for an id that is not a str."""
    if type(component) is not str:
        return esc(component)  # (raises InvalidKey)
    return component if _plain(component) else _escaped(component)


def unesc(component: str) -> str:
    """The inverse of :func:`esc`."""
    return _UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), component)


def version_component(version: str | int | float) -> str:
    """A channel version as a key component; the type is kept (``1`` and ``"1"`` differ)."""
    if type(version) is str:  # (LangGraph's own: the common case first)
        return "s" + _esc_id(version)  # (new at every step: not memoised)
    if isinstance(version, bool) or not isinstance(version, str | int | float):
        raise InvalidKey(f"a channel version is a str, int or float, got {version!r}")
    tag = "s" if isinstance(version, str) else "i" if isinstance(version, int) else "f"
    return tag + esc(str(version) if not isinstance(version, float) else repr(version))


class Keys:
    """The key layout under one root, checked against the client's ``max_key_bytes``."""

    def __init__(self, root: str, max_key_bytes: int) -> None:
        if type(root) is not str or not root.endswith("/") or "\x00" in root:
            raise InvalidKey(f"the key root must be a str ending in '/' (such as 'lg/'), "
                             f"got {root!r}")
        self.root = root
        self.max = max_key_bytes
        self.heads = root + "cp/h/"
        self.checkpoints = root + "cp/c/"
        self.blobs = root + "cp/b/"
        self.writes = root + "cp/w/"
        self.store = root + "st/"
        # (thread id, namespace) -> ("T/N/", the head's key, the prefixes of its
        # checkpoints, of its writes and of its channel values), for ids whose head is
        # within the bound
        self._tn: dict[tuple[str, str], tuple[str, str | None, str, str, str]] = {}

    def _of(self, thread_id: str, checkpoint_ns: str) -> tuple[str, str | None, str, str, str]:
        """``("T/N/", head key, checkpoints' prefix, writes' prefix, blobs' prefix)`` of a thread's
        namespace (``T/N/``: ``esc(thread_id)/esc(checkpoint_ns)/``; the head key None
        when over ``max_key_bytes``, as every key of it is then), memoised for str ids
        whose keys can fit: a run builds its keys at every step; at most _TN_MEMO
        entries, then forgotten all at once. Raises InvalidKey for ids that are not str."""
        if type(thread_id) is str and type(checkpoint_ns) is str:  # (only: a str subclass
            got = self._tn.get((thread_id, checkpoint_ns))  # may equal another id)
            if got is not None:
                return got
        tn = esc(thread_id) + "/" + esc(checkpoint_ns) + "/"  # (raises InvalidKey)
        head = self.heads + tn
        if len(head.encode("utf-8", "surrogatepass")) > self.max:
            # (no key fits: not kept)
            return tn, None, self.checkpoints + tn, self.writes + tn, self.blobs + tn
        got = (tn, head, self.checkpoints + tn, self.writes + tn, self.blobs + tn)
        if len(self._tn) >= _TN_MEMO:
            self._tn.clear()
        self._tn[thread_id, checkpoint_ns] = got
        return got

    def fit(self, key: str, what: str, *args: object) -> str:
        """``key``, checked against ``max_key_bytes``: InvalidKey naming ``what`` (formatted
        with ``args``, only then: a key is built at every step) when it is longer."""
        n = len(key) if key.isascii() else len(key.encode("utf-8", "surrogatepass"))
        if n > self.max:
            if args:
                what = what.format(*args)
            raise InvalidKey(
                f"the KVCOMM key of {what} is {n} bytes, over cache.max_key_bytes={self.max}: "
                "use shorter ids (thread ids, namespaces, store keys) or raise "
                "cache.max_key_bytes (up to 4096) in every host's config")
        return key

    # ---------------------------------------------------------------- saver
    def thread(self, prefix: str, thread_id: str) -> str:
        """The prefix of every key of ``thread_id`` under ``prefix`` (heads, checkpoints...)."""
        return prefix + esc(thread_id) + "/"

    def ns(self, prefix: str, thread_id: str, checkpoint_ns: str) -> str:
        return prefix + self._of(thread_id, checkpoint_ns)[0]

    def head(self, thread_id: str, checkpoint_ns: str) -> str:
        return self._head(self._of(thread_id, checkpoint_ns), thread_id)

    def _head(self, of: tuple[str, str | None, str, str, str], thread_id: str) -> str:
        return of[1] or self.fit(self.heads + of[0], "the head of thread {!r}", thread_id)

    def checkpoint(self, thread_id: str, checkpoint_ns: str, checkpoint_id: str) -> str:
        return self._checkpoint(self._of(thread_id, checkpoint_ns), thread_id, checkpoint_id)

    def _checkpoint(self, of: tuple[str, str | None, str, str, str], thread_id: str,
                    checkpoint_id: str) -> str:
        return self.fit(of[2] + _esc_id(checkpoint_id), "checkpoint {!r} of thread {!r}",
                        checkpoint_id, thread_id)

    def step(self, thread_id: str, checkpoint_ns: str, checkpoint_id: str) -> tuple[str, str, str]:
        """(:meth:`checkpoint`, the prefix of the thread's channel values (:meth:`blob`
        completes it), :meth:`head`): the keys a put makes, the thread's part found once."""
        of = self._of(thread_id, checkpoint_ns)
        return (self._checkpoint(of, thread_id, checkpoint_id), of[4], self._head(of, thread_id))

    def blob(self, thread_id: str, checkpoint_ns: str, channel: str,
             version: str | int | float) -> str:
        return self.fit(self.ns(self.blobs, thread_id, checkpoint_ns) + esc(channel) + "/"
                        + version_component(version),
                        "channel {!r} of thread {!r}", channel, thread_id)

    def write_prefix(self, thread_id: str, checkpoint_ns: str, checkpoint_id: str) -> str:
        return self._of(thread_id, checkpoint_ns)[3] + _esc_id(checkpoint_id) + "/"

    def write(self, thread_id: str, checkpoint_ns: str, checkpoint_id: str, task_id: str,
              idx: int) -> str:
        return self.task_write(self.task_prefix(thread_id, checkpoint_ns, checkpoint_id,
                                                task_id), idx, task_id, thread_id)

    def task_prefix(self, thread_id: str, checkpoint_ns: str, checkpoint_id: str,
                    task_id: str) -> str:
        """The prefix of the writes of one task (:meth:`task_write` completes it)."""
        return self.write_prefix(thread_id, checkpoint_ns, checkpoint_id) + _esc_id(task_id) + "/"

    def task_write(self, prefix: str, idx: int, task_id: str, thread_id: str) -> str:
        """The key of write ``idx`` under ``prefix`` (from :meth:`task_prefix`)."""
        return self.task_writes(prefix, [idx], task_id, thread_id)[0]

    def step_writes(self, thread_id: str, checkpoint_ns: str, checkpoint_id: str, task_id: str,
                    indices: list[int]) -> list[str]:
        """``task_writes(task_prefix(...), indices, ...)``: the keys of a task's writes."""
        return self.task_writes(self._of(thread_id, checkpoint_ns)[3] + _esc_id(checkpoint_id)
                                + "/" + _esc_id(task_id) + "/", indices, task_id, thread_id)

    def in_c(self) -> tuple[Callable[[str, str, str], tuple[str, str, str]],
                            Callable[[str, str, str, str, list[int]], list[str]]]:
        """(:meth:`step`, :meth:`step_writes`) in C, for a caller to keep (the saver): the
        keys a put and a task's writes make at every step of a graph, made in C for ids
        the memo holds (and LangGraph's uuids, which need no escaping); for any other, the
        methods themselves, given the same arguments. They hold this Keys, which does not
        hold them (no reference cycle); ``max_key_bytes`` as it is now."""
        return (functools.partial(step_keys, self._tn, self.max, self.step),
                functools.partial(write_keys, self._tn, self.max, self.step_writes))

    def task_writes(self, prefix: str, indices: list[int], task_id: str,
                    thread_id: str) -> list[str]:
        """The keys of writes ``indices`` (ints) under ``prefix``, as :meth:`task_write`
        makes each: one check of the longest against ``max_key_bytes``."""
        keys = list(map(prefix.__add__, map(str, indices)))
        if keys:
            self.fit(max(keys, key=len), "a write of task {!r} in thread {!r}", task_id,
                     thread_id)
        return keys

    @staticmethod
    def split(key: str, prefix: str) -> list[str]:
        """The unescaped components of ``key`` after ``prefix`` (a head's trailing '/'
        gives no empty last component)."""
        rest = key[len(prefix):]
        if rest.endswith("/"):
            rest = rest[:-1]
        return [unesc(c) for c in rest.split("/")]

    # ---------------------------------------------------------------- store
    def store_prefix(self, labels: tuple[str, ...]) -> str:
        """The prefix of the items of every namespace that starts with ``labels``."""
        return self.store + "".join(esc(label) + "/" for label in labels)

    def item(self, namespace: tuple[str, ...], key: str) -> str:
        return self.fit(self.store_prefix(namespace) + "=" + esc(key),
                         f"store item {key!r} of namespace {namespace!r}")

    def parse_item(self, key: str) -> tuple[tuple[str, ...], str]:
        """(namespace, item key) of a store key made by :meth:`item`."""
        rest = key[len(self.store):]
        labels, _, k = rest.rpartition("/=")
        if not _:  # the namespace is the whole store (never made by item(): namespaces are non-empty)
            raise InvalidKey(f"{key!r} is not a KVCOMM store item key")
        return tuple(unesc(c) for c in labels.split("/")), unesc(k)
