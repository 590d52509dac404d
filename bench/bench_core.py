"""The pure core measured against peers in one run.

    python bench/bench_core.py [--quick]

* versions: compare / merge / encode cost and encoded size at 3, 16 and 64 actors,
  beside a hand-written dict vector clock encoded as JSON (what a team writes first);
* hot keys: Count-Min Sketch update/query cost, and top-100 recall, precision and
  count error on Zipf workloads (10^6 keys, 2×10^6 accesses, s = 0.8, 1.0, 1.2) with
  0.1% of a 256 MiB cache as its memory, beside an exact ``collections.Counter``;
* Bloom filter: add/check cost and measured false-positive rate at capacity, beside
  rbloom and pyprobables configured alike;
* write window: ops and bytes in vs out on a swarm stream (64 agents × 50 Hz).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import xxhash
from _timing import heading, ns_per_item, p50_blocks, stopwatch

from kvcomm.core.bloom import BloomFilter
from kvcomm.core.sketch import CountMinSketch, TopK
from kvcomm.core.versions import compare_vectors, decode_vector, encode_vector, merge_vectors
from kvcomm.core.window import WriteWindow


def per_op_ns(fn: Callable[[], Any], n: int) -> float:
    """Median ns per call over 5 blocks of ``n`` calls."""
    return p50_blocks(fn, 5, n)


# ---------------------------------------------------------------- versions


def bench_versions(quick: bool) -> None:
    heading("version vectors: cost per operation and encoded size")
    print(f"{'actors':>6} | {'compare':>9} {'dict VV':>9} | {'merge':>9} {'dict VV':>9} | "
          f"{'encode':>8} {'json':>8} | {'bytes':>6} {'json':>6}")
    n = 2000 if quick else 20000
    for actors in (3, 16, 64):
        _vv_row(actors, n)


def _vv_row(actors: int, n: int) -> None:
    a = tuple(sorted((f"host-{i:03d}", 1000 + i) for i in range(actors)))
    b = tuple(sorted((f"host-{i:03d}", 1000 + i + (i % 2)) for i in range(actors)))
    da, db = dict(a), dict(b)

    def dict_compare() -> bool:
        return all(da.get(k, 0) <= v for k, v in db.items()) and all(
            db.get(k, 0) <= v for k, v in da.items())

    def dict_merge() -> dict[str, int]:
        out = dict(da)
        for k, v in db.items():
            out[k] = max(out.get(k, 0), v)
        return out

    hlc = 1 << 56
    ours_enc = encode_vector(a, hlc)
    json_enc = json.dumps({"vv": da, "hlc": hlc}, separators=(",", ":")).encode()
    assert decode_vector(ours_enc) == (a, hlc)
    print(f"{actors:>6} | {per_op_ns(lambda: compare_vectors(a, b), n) / 1000:>7.2f}µs "
          f"{per_op_ns(dict_compare, n) / 1000:>7.2f}µs | "
          f"{per_op_ns(lambda: merge_vectors(a, b), n) / 1000:>7.2f}µs "
          f"{per_op_ns(dict_merge, n) / 1000:>7.2f}µs | "
          f"{per_op_ns(lambda: encode_vector(a, hlc), n) / 1000:>6.2f}µs "
          f"{per_op_ns(lambda: json.dumps({'vv': da, 'hlc': hlc}), n) / 1000:>6.2f}µs | "
          f"{len(ours_enc):>6} {len(json_enc):>6}")


# ---------------------------------------------------------------- hot keys


def zipf_stream(n_keys: int, n: int, s: float, seed: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_keys + 1) ** s
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(n))
    perm = rng.permutation(n_keys)  # hot keys are not the lowest ids
    return perm[ranks]


def bench_sketch(quick: bool) -> None:
    heading("hot keys: Count-Min Sketch (conservative update) + top-100, 0.1% of a 256 MiB cache")
    n_keys, n_acc = (100_000, 200_000) if quick else (1_000_000, 2_000_000)
    budget = (256 << 20) // 1000
    topk = TopK(100, 24)
    cms = CountMinSketch.for_budget(budget - TopK.size_for(100, 24), depth=4,
                                    reset_every=10**12)
    mem = cms.nbytes + TopK.size_for(100, 24)
    print(f"memory {mem / 1024:.0f} KiB ({100 * mem / (256 << 20):.3f}% of 256 MiB): "
          f"{cms.depth} x {cms.width} counters + 100 top-k slots; "
          f"{n_keys:,} keys, {n_acc:,} accesses")
    key = b"drone/123456/state"
    upd = per_op_ns(lambda: cms.add(key), 20000)
    qry = per_op_ns(lambda: cms.estimate(key), 20000)
    exact: Counter[bytes] = Counter()
    ctr = per_op_ns(lambda: exact.update((key,)), 20000)
    print(f"update {upd / 1000:.2f} µs, query {qry / 1000:.2f} µs per key "
          f"(exact Counter.update: {ctr / 1000:.2f} µs, but it keeps every key)")
    print(f"{'zipf s':>6} | {'recall@100':>10} {'precision':>9} | {'mean err':>8} "
          f"{'max err':>8} {'(% of count)':>12} | {'sketch s':>8} | {'Counter MiB':>11}")
    for s in (0.8, 1.0, 1.2):
        cms = CountMinSketch.for_budget(budget - TopK.size_for(100, 24), depth=4,
                                        reset_every=10**12)
        topk = TopK(100, 24)
        stream = zipf_stream(n_keys, n_acc, s, seed=int(s * 10))
        keys = [b"k%d" % i for i in stream.tolist()]
        with stopwatch() as took:
            pending: Counter[bytes] = Counter()
            for i, k in enumerate(keys):
                pending[k] += 1
                if len(pending) >= 256 or i == len(keys) - 1:  # buffered, as the client does
                    topk.offer_many([(kk, cms.add(kk, c)) for kk, c in pending.items()])
                    pending.clear()
        el = took[0]
        truth = Counter(keys)
        true_top = {k for k, _ in truth.most_common(100)}
        found = topk.top(100)
        hits = sum(1 for k, _ in found if k in true_top)
        recall = hits / 100
        precision = hits / max(1, len(found))
        errs = [abs(est - truth[k]) for k, est in found]
        rel = [abs(est - truth[k]) / truth[k] for k, est in found]
        counter_mib = (sys.getsizeof(truth) + sum(sys.getsizeof(k) + 28 for k in truth)) / 2**20
        print(f"{s:>6} | {recall:>10.2%} {precision:>9.2%} | {statistics.mean(errs):>8.1f} "
              f"{max(errs):>8} {100 * statistics.mean(rel):>11.2f}% | {el:>7.1f}s | "
              f"{counter_mib:>11.1f}")


# ---------------------------------------------------------------- bloom


def bench_bloom(quick: bool) -> None:
    cap = 100_000 if quick else 1_000_000
    heading(f"Bloom filter: {cap:,} keys at a configured 0.1% false-positive rate")
    keys = [f"drone/{i}/state".encode() for i in range(cap)]
    absent = [f"nobody/{i}".encode() for i in range(200_000)]
    rows: list[tuple[str, float, float, float, int]] = []

    def run(name: str, add: Callable[[bytes], Any], check: Callable[[bytes], bool],
            nbytes: int) -> None:
        add_ns = ns_per_item(add, keys)
        assert all(check(k) for k in keys[:1000]), f"{name} has false negatives"
        check_ns = ns_per_item(check, absent)
        fp = sum(1 for k in absent if check(k))
        rows.append((name, add_ns, check_ns, fp / len(absent), nbytes))

    ours = BloomFilter(cap, 0.001)
    run("kvcomm BloomFilter", ours.add, ours.__contains__, ours.nbytes)
    try:
        import rbloom

        rb = rbloom.Bloom(cap, 0.001, hash_func=lambda b: xxhash.xxh3_128_intdigest(b) - (1 << 127))
        run("rbloom (xxh3 hash_func)", rb.add, rb.__contains__, rb.size_in_bits // 8)
    except ImportError:
        print("rbloom not installed")
    try:
        from probables import BloomFilter as PBloom

        pb = PBloom(est_elements=cap, false_positive_rate=0.001)
        run("pyprobables BloomFilter", pb.add, pb.check, pb.bloom_length)
    except ImportError:
        print("pyprobables not installed")
    print(f"{'filter':<26} {'add':>8} {'check':>8} {'measured FPR':>13} {'KiB':>8}")
    for name, add_ns, check_ns, fpr, nbytes in rows:
        print(f"{name:<26} {add_ns / 1000:>6.2f}µs {check_ns / 1000:>6.2f}µs {fpr:>12.4%} "
              f"{nbytes / 1024:>8.0f}")


# ---------------------------------------------------------------- window


def bench_window(quick: bool) -> None:
    heading("write window on the swarm stream: 64 agents x 50 Hz state updates, 10 s")
    rng = random.Random(7)
    seconds = 2 if quick else 10
    events = []
    for agent in range(64):
        phase = rng.random() / 50
        for i in range(seconds * 50):
            t = phase + i / 50 + rng.gauss(0, 0.002)
            size = 300 + rng.randrange(200)  # msgpack'd drone state
            events.append((t, f"drone/{agent}/state", size))
    events.sort()
    print(f"{'window':>7} | {'ops in':>7} {'ops out':>7} {'ops ratio':>9} | "
          f"{'MB in':>6} {'MB out':>6} {'reduction':>9} | {'batches':>7}")
    for interval in (0.005, 0.05, 0.2):
        w = WriteWindow(interval=interval, max_ops=1000, max_bytes=1 << 20)
        ops_in = ops_out = bytes_in = bytes_out = batches = 0
        for t, key, size in events:
            for b in (w.poll(t), w.add(key, b"x" * size, ((key[6:8], 1),), int(t * 1000), t)):
                if b:
                    ops_in += b.ops_in
                    ops_out += b.ops_out
                    bytes_in += b.bytes_in
                    bytes_out += b.bytes_out
                    batches += 1
        b = w.flush(events[-1][0] + 1)
        if b:
            ops_in, ops_out = ops_in + b.ops_in, ops_out + b.ops_out
            bytes_in, bytes_out, batches = bytes_in + b.bytes_in, bytes_out + b.bytes_out, batches + 1
        print(f"{interval * 1000:>5.0f}ms | {ops_in:>7} {ops_out:>7} {ops_in / ops_out:>8.2f}x | "
              f"{bytes_in / 1e6:>6.2f} {bytes_out / 1e6:>6.2f} {1 - bytes_out / bytes_in:>8.1%} | "
              f"{batches:>7}")
    print("(each key changes every 20 ms, so a 50 ms window keeps ~2 of every 5 writes; "
          "the L3 round trips saved come on top: one pipeline per window instead of one per put)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller inputs (a smoke run)")
    args = ap.parse_args()
    bench_versions(args.quick)
    bench_window(args.quick)
    bench_bloom(args.quick)
    bench_sketch(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
