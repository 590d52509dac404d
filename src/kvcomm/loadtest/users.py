"""Locust users that act like agents, and the options every KVCOMM locustfile takes.

Each user is an agent with a pace (``rate`` ticks per second, as a control loop has) and
one store per process (:mod:`.stores`: KVCOMM, or Redis directly for the baseline). Every
operation is reported to Locust with its own latency through ``events.request.fire``:
``request_type`` is the store (``kvcomm`` / ``redis``), ``name`` the operation and, for a
read, the tier that answered (``get l1``, ``get l2``, ``get l3``, ``get guard`` — an
absent key answered on the host by the key filter or the negative cache —, ``get
absent``; Redis: ``get hit`` / ``get absent``). Locust's tables and charts then show
KVCOMM's own figures; :mod:`.record` keeps them exactly (Locust rounds response times to
whole milliseconds in its percentiles).

Writing your own: subclass :class:`Agent`, set ``rate``, and in a ``@task`` call
``self.get(key)``, ``self.put(key, value)``, ``self.claim(...)`` or
``self.timed(name, fn, *args)``; run it with ``locust -f your_file.py --kvcomm-config
host.yaml`` (or ``kvcomm loadtest``). Importing this module registers the options
(``--kvcomm-backend``, ``--kvcomm-config``, ``--kvcomm-name``, ``--kvcomm-redis``,
``--kvcomm-rate``, ``--kvcomm-out``) and the recorder.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

from locust import User, events, task

from ..errors import ValidationError
from . import record
from .stores import close_stores, store_for


def _options(parser: Any) -> None:
    parser.add_argument("--kvcomm-backend", choices=["kvcomm", "redis"], default="kvcomm",
                        help="the store the agents use (redis: the baseline)")
    parser.add_argument("--kvcomm-config", default="", help="the kvcomm config agents open")
    parser.add_argument("--kvcomm-name", default="", help="the L2 namespace (default: the config's)")
    parser.add_argument("--kvcomm-redis", default="127.0.0.1:6379",
                        help="the Redis of the baseline, host:port")
    parser.add_argument("--kvcomm-rate", type=float, default=0.0,
                        help="ticks per second per agent (0: the scenario's own)")
    parser.add_argument("--kvcomm-out", default="", help="write exact figures (JSON) here")
    parser.add_argument("--kvcomm-seed", type=int, default=0, help="seed of the agents' choices")


def _init(environment: Any, **kwargs: Any) -> None:
    # open the store (importing KVCOMM, attaching L2, connecting) before the clock runs
    if getattr(environment, "parsed_options", None) is not None:
        store_for(environment.parsed_options)


def _start(environment: Any, **kwargs: Any) -> None:
    record.start(environment)


def _stop(environment: Any, **kwargs: Any) -> None:
    record.stop(environment)
    close_stores()  # (KVCOMM: the client's last counts go to the host's metrics)


_events: Any = events  # (Locust is untyped)
_events.init_command_line_parser.add_listener(_options)
_events.init.add_listener(_init)
_events.test_start.add_listener(_start)
_events.test_stop.add_listener(_stop)

_IDS = itertools.count()


class Agent(User):
    """An agent: ``rate`` ticks per second, a store, timed operations."""

    abstract = True
    rate = 50.0

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        opts = environment.parsed_options
        self.opts = opts
        self.store = store_for(opts)
        self.me = next(_IDS)
        self.rng = random.Random((opts.kvcomm_seed or 0) * 1_000_003 + self.me)
        self.period = 1.0 / (opts.kvcomm_rate or self.rate)
        self._next = time.monotonic()
        self._fire = environment.events.request.fire
        self._kind = self.store.kind

    def wait_time(self) -> float:
        """Constant pacing: the next tick ``period`` after the last one began (at once
        when the tick overran)."""
        now = time.monotonic()
        self._next = max(self._next + self.period, now)
        return self._next - now

    @property
    def agents(self) -> int:
        """How many agents the run has (the swarm's size)."""
        return max(1, int(getattr(self.opts, "num_users", 1) or 1))

    def timed(self, name: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, reported to Locust as ``name`` with its latency; an exception is
        reported as a failure (and returned as None)."""
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as exc:
            self._fire(request_type=self._kind, name=name, response_time=(time.perf_counter() - t0) * 1000,
                       response_length=0, exception=exc, context={})
            return None
        self._fire(request_type=self._kind, name=name, response_time=(time.perf_counter() - t0) * 1000,
                   response_length=0, exception=None, context={})
        return out

    def get(self, key: str) -> Any:
        """A read, reported as ``get <tier>``."""
        t0 = time.perf_counter()
        try:
            value, tier = self.store.get(key)
        except Exception as exc:
            self._fire(request_type=self._kind, name="get", response_time=(time.perf_counter() - t0) * 1000,
                       response_length=0, exception=exc, context={})
            return None
        self._fire(request_type=self._kind, name=f"get {tier}",
                   response_time=(time.perf_counter() - t0) * 1000, response_length=0,
                   exception=None, context={})
        return value

    def put(self, key: str, value: Any) -> None:
        self.timed("put", self.store.put, key, value)

    def on_stop(self) -> None:
        pass


class SwarmDrone(Agent):
    """A drone: at ``rate`` (50 Hz) it puts its state and reads ``NEIGHBOURS`` other
    drones' states."""

    rate = 50.0
    NEIGHBOURS = 8

    @task
    def tick(self) -> None:
        t = time.time()
        self.put(f"drone/{self.me}/state",
                 {"pos": [self.me * 1.0, t % 100, 30.0], "vel": [1.0, 0.5, 0.0], "battery": 87.5,
                  "t": t})
        n = self.agents
        others = [i for i in self.rng.sample(range(n), min(n, self.NEIGHBOURS + 1)) if i != self.me]
        for other in others[:self.NEIGHBOURS]:
            self.get(f"drone/{other}/state")


# TODO(strong keys): once KVCOMM has strong key prefixes (linearizable across hosts through
# etcd), put the shelves under one (``consistency="strong"`` or a strong prefix in the
# config): claims are then exclusive cluster-wide, not only on one host. Until then the
# claim is a compare-and-set (exclusive on a host; across hosts, last-writer-wins) plus a
# validator, and the Redis baseline's claim is a server-side compare-and-set.
SHELF = "shelf/"


def _shelf_rule(key: str, old: Any, new: Any) -> None:
    """The warehouse's validator: a shelf is claimed only when free, released only by the
    robot holding it."""
    held = None if old is None else old.value.get("robot")
    if new is None:
        return
    if new.get("robot") is not None and held not in (None, new["robot"]):
        raise ValueError(f"{key} is held by robot {held}")
    if new.get("robot") is None and held is not None and new.get("by") != held:
        raise ValueError(f"{key} is held by robot {held}, not {new.get('by')}")


class WarehouseRobot(Agent):
    """A robot: at ``rate`` (20 Hz) it either releases the shelf it holds or tries to claim
    a random shelf with compare-and-set (a lost race is ``claim lost``, not a failure);
    a validator guards every claim and release (``claim refused`` if it ever objects)."""

    rate = 20.0
    SHELVES_PER_ROBOT = 4
    _validated: set[int] = set()

    def on_start(self) -> None:
        if id(self.store) not in WarehouseRobot._validated:
            WarehouseRobot._validated.add(id(self.store))
            self.store.register_validator(SHELF, _shelf_rule)
        self.holding: str | None = None

    def _cas(self, key: str, value: Any, token: Any) -> str:
        try:
            return "claim" if self.store.cas(key, value, token) else "claim lost"
        except ValidationError:
            return "claim refused"

    @task
    def tick(self) -> None:
        if self.holding is not None and self.rng.random() < 0.5:
            key = self.holding
            value, token = self.timed("read shelf", self.store.read_versioned, key) or (None, None)
            if value is not None and value.get("robot") == self.me:
                if self.timed("release", self.store.cas, key, {"robot": None, "by": self.me}, token):
                    self.holding = None
            else:
                self.holding = None  # (lost it: another host's write won)
            return
        key = f"{SHELF}{self.rng.randrange(self.agents * self.SHELVES_PER_ROBOT)}"
        got = self.timed("read shelf", self.store.read_versioned, key)
        if got is None:
            return
        value, token = got
        if value is not None and value.get("robot") is not None:
            return  # taken
        t0 = time.perf_counter()
        outcome = self._cas(key, {"robot": self.me, "since": time.time()}, token)
        self._fire(request_type=self._kind, name=outcome, response_time=(time.perf_counter() - t0) * 1000,
                   response_length=0, exception=None, context={})
        if outcome == "claim" and self.holding is None:
            self.holding = key


class HotKeyReader(Agent):
    """A hot-key storm: at ``rate`` (100 Hz) ``READS`` reads of ``HOT`` keys, most of them
    the first few (a Pareto draw), and 1 tick in 100 a write of one of them."""

    rate = 100.0
    HOT = 16
    READS = 5

    def on_start(self) -> None:
        if self.me == 0:
            for i in range(self.HOT):
                self.put(f"hot/{i}", {"i": i, "payload": "x" * 64})

    @task
    def tick(self) -> None:
        for _ in range(self.READS):
            i = min(int(self.rng.paretovariate(1.2)) - 1, self.HOT - 1)
            self.get(f"hot/{i}")
        if self.rng.random() < 0.01:
            self.put(f"hot/{self.rng.randrange(self.HOT)}", {"payload": "y" * 64})


class PenetrationProber(Agent):
    """A penetration storm: at ``rate`` (100 Hz) ``ABSENT`` reads of keys that were never
    written (each a new random key) and one read of a key that exists."""

    rate = 100.0
    ABSENT = 5
    REAL = 64

    def on_start(self) -> None:
        if self.me == 0:
            for i in range(self.REAL):
                self.put(f"real/{i}", {"i": i})

    @task
    def tick(self) -> None:
        for _ in range(self.ABSENT):
            self.get(f"ghost/{self.rng.getrandbits(48):012x}")
        self.get(f"real/{self.rng.randrange(self.REAL)}")


SCENARIOS = {"swarm": SwarmDrone, "warehouse": WarehouseRobot, "hotkeys": HotKeyReader,
             "penetration": PenetrationProber}
