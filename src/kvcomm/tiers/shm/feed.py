"""The change feed: a ring of events every process reads with its own cursor."""

from __future__ import annotations

from dataclasses import dataclass

from .layout import FEED, FEED_KEY_AT, KIND_DELETE, KIND_EVICT, KIND_EXPIRE, KIND_PUT, KIND_RESYNC
from .segment import _H_FEED_HEAD, SegmentCore


@dataclass(slots=True)
class FeedEvent:
    seq: int
    kind: int  # KIND_PUT, KIND_DELETE, KIND_EVICT, KIND_EXPIRE (KIND_RESYNC: an overflow)
    key: str
    counter: int
    hlc: int


class Feed(SegmentCore):
    """The change feed."""

    def feed_head(self) -> int:
        return int(self._q[_H_FEED_HEAD])

    def feed_read(self, cursor: int, limit: int = 1 << 30) -> tuple[list[FeedEvent], int, bool]:
        """Events after ``cursor``: (events, new cursor, overflowed). Lock-free.

        ``overflowed``: events after the cursor were overwritten before they were read (or a
        writer died and the segment was repaired): the reader must rescan what it tracks.
        """
        q = self._q
        lay = self.layout
        try:
            head = int(q[_H_FEED_HEAD])
        except (TypeError, ValueError):  # (released by another thread's close since)
            raise self._closed("this read of its change feed was under way") from None
        if cursor > head or head - cursor > lay.feed_n:
            return [], head, True
        out: list[FeedEvent] = []
        buf = self._buf
        end = min(head, cursor + limit)
        for seq in range(cursor + 1, end + 1):
            e = lay.feed_off + ((seq - 1) % lay.feed_n) * lay.feed_esz
            ei = e >> 3
            if q[ei + FEED["SEQ"]] != seq:
                return out, head, True
            info = q[ei + FEED["INFO"]]
            klen = min(info >> 8, lay.max_key)
            key = bytes(buf[e + FEED_KEY_AT : e + FEED_KEY_AT + klen])
            counter, hlc = q[ei + FEED["COUNTER"]], q[ei + FEED["HLC"]]
            if q[ei + FEED["SEQ"]] != seq:
                return out, head, True
            kind = info & 0xFF
            if kind == KIND_RESYNC:
                return out, seq, True
            if kind in (KIND_PUT, KIND_DELETE, KIND_EVICT, KIND_EXPIRE):
                out.append(FeedEvent(seq, kind, key.decode("utf-8", "surrogateescape"), counter, hlc))
        return out, end, False

