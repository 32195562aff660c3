"""Data-parallel routing: which engine replica takes a request. Prefix affinity (the replica
most likely to hold the prompt's first blocks) unless it is busier than the least loaded
candidate by a margin; candidates come from the replica pools serving the request's priority,
with overflow to the pools that take it once those are saturated."""

from __future__ import annotations

from collections import deque

from surge.config_frontend import PoolConfig, RoutingConfig
from surge.prefix_hash import prefix_hashes

# An entry the router made itself when it routed a prompt (before any report) lives this long
# unless the replica's report confirms it: long enough for a queued prefill to be reported.
OPTIMISTIC_TTL_S = 10.0


class NoReplica(LookupError):
    """No replica may serve this priority (the pools leave it out)."""


class Router:
    def __init__(self, num_replicas: int, block_size: int, routing: RoutingConfig,
                 pools: dict[str, PoolConfig]) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.routing = routing
        self.pools = pools
        self.load = [0] * num_replicas  # requests in flight on each (routed, not ended)
        self.waiting = [0] * num_replicas  # of which not started (no tokens yet)
        self.down = [False] * num_replicas  # lost a worker; back at its next stats
        self.where: dict[str, tuple[int, bool]] = {}  # request id -> (replica, started)
        # Prefix name -> replicas holding it: None once reported, else when the router's own
        # entry expires.
        self.holders: dict[bytes, dict[int, float | None]] = {}
        self._expiries: deque[tuple[float, bytes, int]] = deque()
        self._last = -1  # round robin among equals starts after the last choice

    def configure(self, routing: RoutingConfig, pools: dict[str, PoolConfig]) -> None:
        self.routing, self.pools = routing, pools

    # ---- choosing ----

    def candidates(self, priority: int, allowed: list[int] | None = None) -> list[int]:
        """The replicas that may take a request of this priority now: its own pools' and the
        pool-less ones, and once each of those is saturated (or down, or not `allowed`: its
        circuit breaker refuses), the pools taking its overflow."""
        pooled: set[int] = set()
        home: set[int] = set()
        homes: list[str] = []
        for name, pool in self.pools.items():
            members = [r for r in pool.members() if r < self.num_replicas]
            pooled.update(members)
            if pool.min_priority <= priority <= pool.max_priority:
                home.update(members)
                homes.append(name)
        home |= set(range(self.num_replicas)) - pooled
        limit = self.routing.route_spill_waiting
        if home and any(self.waiting[r] < limit and not self.down[r] and
                        (allowed is None or r in allowed) for r in home):
            return sorted(home)
        spill = set(home)
        for pool in self.pools.values():
            takes = pool.spill_from.split()
            if "*" in takes or any(name in takes for name in homes):
                spill.update(r for r in pool.members() if r < self.num_replicas)
        if not spill:
            pools = ", ".join(f"{n} ({p.min_priority} to {p.max_priority})"
                              for n, p in self.pools.items())
            raise NoReplica(f"no replica serves priority {priority}: the pools are {pools}, "
                            f"every replica is in one, and none takes this overflow")
        return sorted(spill)

    def hashes(self, token_ids: list[int]) -> list[bytes]:
        return prefix_hashes(token_ids, self.block_size, self.routing.route_prefix_blocks)

    def matched(self, replica: int, hashes: list[bytes], now: float) -> int:
        """How many of the prompt's first blocks the replica is taken to hold."""
        count = 0
        for h in hashes:
            expiry = self.holders.get(h, {}).get(replica, 0.0)
            if expiry is not None and expiry <= now:
                break
            count += 1
        return count

    def choose(self, hashes: list[bytes], priority: int, now: float,
               allowed: list[int] | None = None) -> int:
        """The replica, one of `allowed` (default: any), for a prompt with these prefix names
        (NoReplica: none may serve)."""
        self._expire(now)
        found = self.candidates(priority, allowed)
        if allowed is not None:
            found = [r for r in found if r in allowed]
            if not found:
                raise NoReplica(f"no replica that serves priority {priority} takes new requests "
                                f"now: their circuit breakers are open")
        found = [r for r in found if not self.down[r]] or found
        least = min(self.load[r] for r in found)
        if hashes:
            best = max(self.matched(r, hashes, now) for r in found)
            near = [r for r in found if best and self.matched(r, hashes, now) == best
                    and self.load[r] - least <= self.routing.route_balance_margin]
            if near:
                return self._turn(near, min(self.load[r] for r in near))
        return self._turn(found, least)

    def _turn(self, replicas: list[int], load: int) -> int:
        tied = [r for r in replicas if self.load[r] == load]
        pick = next((r for r in tied if r > self._last), tied[0])
        self._last = pick
        return pick

    # ---- what happens to routed requests ----

    def routed(self, request_id: str, replica: int, hashes: list[bytes], now: float) -> None:
        """Count it on its replica, and take the replica to hold its prefix from now on."""
        self.where[request_id] = (replica, False)
        self.load[replica] += 1
        self.waiting[replica] += 1
        expiry = now + OPTIMISTIC_TTL_S
        for h in hashes:
            held = self.holders.setdefault(h, {})
            if held.get(replica, 0.0) is not None:  # a reported entry stays reported
                held[replica] = expiry
                self._expiries.append((expiry, h, replica))

    def replica_of(self, request_id: str) -> int | None:
        entry = self.where.get(request_id)
        return None if entry is None else entry[0]

    def started(self, request_id: str) -> None:
        entry = self.where.get(request_id)
        if entry is not None and not entry[1]:
            self.where[request_id] = (entry[0], True)
            self.waiting[entry[0]] -= 1

    def ended(self, request_id: str) -> None:
        entry = self.where.pop(request_id, None)
        if entry is not None:
            self.load[entry[0]] -= 1
            if not entry[1]:
                self.waiting[entry[0]] -= 1

    # ---- what replicas report ----

    def report(self, replica: int, gained: list[bytes], lost: list[bytes]) -> None:
        for h in gained:
            self.holders.setdefault(h, {})[replica] = None
        for h in lost:
            self._drop(h, replica)

    def fault(self, replica: int) -> None:
        """It lost a worker, so its cache too: keep new work off it until it is back."""
        self.down[replica] = True
        for h in [h for h, held in self.holders.items() if replica in held]:
            self._drop(h, replica)

    def back(self, replica: int) -> None:
        self.down[replica] = False

    def _drop(self, h: bytes, replica: int) -> None:
        held = self.holders.get(h)
        if held is not None:
            held.pop(replica, None)
            if not held:
                del self.holders[h]

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expiry, h, replica = self._expiries.popleft()
            if self.holders.get(h, {}).get(replica) == expiry:  # not refreshed nor reported
                self._drop(h, replica)
