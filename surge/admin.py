"""`surge admin`: talk to a running server through its runtime dir (local, owner only)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import msgspec
import zmq

from surge.config import TABLES
from surge.config_live import LIVE_SECTION, inherited, is_secret
from surge.config_load import section_of
from surge.keys import KeyStore
from surge.protocol import AdminReply, AdminRequest, encode
from surge.replica_stats import total
from surge.runtime import admin_addresses, find_server, recorded, supervisor_pid

_TIMEOUT_MS = 10_000
# How long `admin reload` waits for the supervisor to read the file (then each replica's
# answer, up to _TIMEOUT_MS each) and record how the reload went.
_RELOAD_WAIT_S = 15.0


def ask(address: str, command: str, values: dict[str, str] | None = None) -> AdminReply:
    """One request to the scheduler's admin socket; it answers between two steps."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.connect(address)
        sock.send(encode(AdminRequest(command, values or {})))
        if not sock.poll(_TIMEOUT_MS):
            return AdminReply(False, f"no answer from the scheduler in {_TIMEOUT_MS // 1000}s "
                                     "(is it starting or replacing a worker?)")
        return msgspec.msgpack.decode(sock.recv(), type=AdminReply)
    finally:
        ctx.destroy(linger=0)


def ask_all(addresses: list[str], command: str,
            values: dict[str, str] | None = None) -> AdminReply:
    """ask() every data-parallel replica's scheduler: a set goes to replica 0 first (which
    checks it for all, as they share one configuration), then to the others; stats are
    summed, with each replica's under "replicas"."""
    first = ask(addresses[0], command, values)
    if len(addresses) == 1 or not first.ok or command == "get":
        return first
    replies = [first, *(ask(a, command, values) for a in addresses[1:])]
    if failed := next((i for i, r in enumerate(replies) if not r.ok), None):
        return AdminReply(False, f"replica {failed}: {replies[failed].message} (replicas "
                                 f"before it applied the change)", replies[failed].values)
    if command == "stats":
        return AdminReply(True, first.message, total([r.values for r in replies]))
    return first


def _pairs(values: list[str]) -> dict[str, str]:
    """KEY=VALUE items; a key's parameter name may be written as its flag (max-num-seqs) or
    after its section (scheduler.max_num_seqs), a tenant's or pool's name is kept as it is
    (tenants.team-a.weight)."""
    pairs = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{item!r} is not KEY=VALUE")
        head, dot, name = key.strip().rpartition(".")
        name = name.replace("-", "_")
        pairs[name if LIVE_SECTION.get(name) == head else head + dot + name] = value.strip()
    return pairs


def _config_path(runtime_dir: str) -> str:
    """The server's config file, which --persist writes to: refused (ValueError) before
    anything is applied where there is none or this user may not write it."""
    path = recorded(runtime_dir, "config")
    if path is None:
        raise ValueError("--persist needs the server's config file, and this server was "
                         "started without --config; nothing was changed (start it with "
                         "--config FILE, or drop --persist)")
    try:
        with open(path, "r+"):  # opened for writing, not truncated
            pass
    except OSError as e:
        raise ValueError(f"--persist cannot write the server's config file {path} "
                         f"({e.strerror}); nothing was changed (run surge admin as a user "
                         f"who may write it, or drop --persist)") from None
    return path


def _persist(runtime_dir: str, values: dict[str, object]) -> str:
    """Write values into the server's config file (their own section, or [tenants.NAME] /
    [pools.NAME]), the rest of it as it was: comments, order and layout."""
    import tomlkit

    path = _config_path(runtime_dir)
    with open(path) as f:
        doc = tomlkit.load(f)
    for key, value in values.items():
        table, _, rest = key.partition(".")
        if table in TABLES:  # tenants.NAME.FIELD -> [tenants.NAME] FIELD
            name, _, field = rest.rpartition(".")
            entries = doc.setdefault(table, tomlkit.table(is_super_table=True))
            if name not in entries:  # as the server made it: from the table it inherited
                entries[name] = tomlkit.table()
                entries[name].update(inherited(table, entries))
            place = entries[name]
        else:
            place, field = doc.setdefault(section_of(key), tomlkit.table()), key
        if value is None:  # unset: TOML has no null, the key's absence is its default
            place.pop(field, None)
        else:
            place[field] = value
    text = tomlkit.dumps(doc)  # all of it before the file is truncated
    with open(path, "w") as f:
        f.write(text)
    return path


def histograms(runtime_dir: str) -> dict[str, list[tuple[float, float]]]:
    """Each surge histogram's cumulative buckets [(upper bound, count)], read from the
    server's own metric files (so no metrics key is needed when API keys guard /metrics)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.path.join(runtime_dir, "metrics"))
    out: dict[str, dict[float, float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket") and \
                    set(sample.labels) <= {"le", "model_name", "replica"}:
                # Summed over replicas: one bucket per bound.
                bounds = out.setdefault(family.name, {})
                le = float(sample.labels["le"])
                bounds[le] = bounds.get(le, 0.0) + sample.value
    return {name: list(bounds.items()) for name, bounds in out.items()}


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style: linear within the bucket that holds the q-th observation."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for high, count in buckets:
        if count >= rank:
            if high == float("inf"):
                return low
            return low + (high - low) * (rank - below) / max(count - below, 1e-9)
        low, below = high, count
    return low


def _summary(runtime_dir: str) -> str:
    """One screen: load, throughput, KV cache, prefix hits, latency percentiles."""
    addresses = admin_addresses(runtime_dir)
    first = ask_all(addresses, "stats")
    time.sleep(1.0)
    second = ask_all(addresses, "stats")
    if not (first.ok and second.ok):
        return second.message
    a, b = first.values, second.values
    dt = max(b["time"] - a["time"], 1e-6)
    url = recorded(runtime_dir, "url")
    assert url is not None  # written before the scheduler starts, so before it answers
    hist = histograms(runtime_dir)

    def pcts(name: str) -> str:
        p50, p95 = (quantile(hist.get(name, []), q) for q in (0.5, 0.95))
        return "no data yet" if p50 is None else f"p50 {p50:.3f} s   p95 {p95:.3f} s"

    used, total = b["kv_blocks_used"], b["kv_blocks_total"]
    hits = b["prefix_hit_tokens"] / b["prefix_queried_tokens"] if b["prefix_queried_tokens"] \
        else 0.0
    return "\n".join([
        f"surge at {url}: {b['running']} running, {b['waiting']} waiting",
        f"throughput   {(b['generated_tokens'] - a['generated_tokens']) / dt:.1f} tokens/s "
        f"generated, {(b['steps'] - a['steps']) / dt:.1f} steps/s (last second)",
        f"KV cache     {used} / {total} blocks ({used / max(total, 1):.0%})   prefix hit rate "
        f"{hits:.1%}   preemptions {b['preemptions']}",
        f"TTFT         {pcts('surge_time_to_first_token_seconds')}   (since start)",
        f"inter-token  {pcts('surge_inter_token_latency_seconds')}",
        f"request      {pcts('surge_request_latency_seconds')}",
        f"queue wait   {pcts('surge_queue_wait_seconds')}",
        *(_replica_line(r) for r in b.get("replicas", [])),
        f"overload     breaker {b['breaker']} ({b['breaker_rejected']} refused)   degradation "
        f"level {b['overload_level']}{' (congested)' if b['congested'] else ''}   "
        f"{b['degraded_requests']} requests degraded",
    ])


def _replica_line(r: dict) -> str:
    hits = r["prefix_hit_tokens"] / r["prefix_queried_tokens"] if r["prefix_queried_tokens"] \
        else 0.0
    breaker = "" if r["breaker"] == "closed" else f", breaker {r['breaker']}"
    return (f"replica {r['replica']:<3}  {r['running']} running, {r['waiting']} waiting, KV "
            f"{r['kv_blocks_used']} / {r['kv_blocks_total']} blocks, prefix hit rate "
            f"{hits:.1%}{breaker}")


def _capacity(runtime_dir: str, as_json: bool) -> tuple[bool, str]:
    """What an autoscaler sees: load, the capacity served lately and the arrival forecast."""
    reply = ask_all(admin_addresses(runtime_dir), "stats")
    if not reply.ok:
        return False, reply.message
    v = reply.values
    keys = ("running", "waiting", "queue_drain_s", "arrival_rate", "capacity_tokens_s",
            "capacity_requests_s", "forecast", "kv_blocks_used", "kv_blocks_total")
    if as_json:
        return True, json.dumps({k: v[k] for k in keys}, indent=2)
    forecast = "   ".join(f"in {int(h) // 60} min {rate:.2f}/s"
                           for h, rate in v["forecast"].items())
    return True, "\n".join([
        f"load         {v['running']} running, {v['waiting']} waiting, queue drains in "
        f"{v['queue_drain_s']:.1f} s, KV cache "
        f"{v['kv_blocks_used'] / max(v['kv_blocks_total'], 1):.0%}",
        f"capacity     {v['capacity_tokens_s']:.1f} tokens/s, {v['capacity_requests_s']:.2f} "
        f"requests/s (the best 10 s lately)",
        f"arrivals     {v['arrival_rate']:.2f} requests/s (last interval)",
        f"forecast     {forecast}",
    ])


def _table(values: dict[str, object]) -> str:
    """NAME VALUE SECTION, aligned."""
    rows = [("NAME", "VALUE", "SECTION")] + [
        (name, "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v),
         table if (table := name.partition(".")[0]) in TABLES else section_of(name))
        for name, v in values.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows)


def _keys_file(args: argparse.Namespace) -> str:
    """--keys-file, else the one the running server was started with."""
    if args.keys_file:
        return args.keys_file
    path = recorded(find_server(args.port, args.runtime_dir), "api_keys_file")
    if path is None:
        raise LookupError("the server has no API keys file: start it with --api-keys-file FILE "
                          "(or api_keys_file in [server]), or name one here with --keys-file "
                          "FILE")
    return path


def run_keys(args: argparse.Namespace) -> int:
    """`surge admin keys add TENANT [--key KEY] | remove ID | list`."""
    words = args.values
    arity = {"add": 2, "remove": 2, "list": 1}
    if not words or arity.get(words[0]) != len(words) or (args.key and words[0] != "add"):
        print("surge admin: usage: keys add TENANT [--key KEY] | keys remove ID | keys list",
              file=sys.stderr)
        return 2
    try:
        path = _keys_file(args)
    except LookupError as e:
        print(f"surge admin: {e}", file=sys.stderr)
        return 2
    try:
        store = KeyStore(path)
        if words[0] == "add":
            # "-": from stdin, to keep the key out of the shell history and the process list.
            imported = sys.stdin.readline().strip() if args.key == "-" else args.key
            key_id, key = store.add(words[1], imported)
            print(f"added key {key_id} for tenant {words[1]} in {store.path}")
            if imported is None:
                print(key)
                print("Keep it now: it cannot be shown again (the file holds only its hash).")
        elif words[0] == "remove":
            if not store.remove(words[1]):
                print(f"surge admin: no key with id {words[1]!r} in {store.path}",
                      file=sys.stderr)
                return 1
            print(f"removed key {words[1]}")
        else:
            rows = [(e["id"], e["tenant"], e["created"]) for e in store.entries()]
            width = max(len(r[1]) for r in [("", "TENANT"), *rows])
            for key_id, tenant, created in [("ID", "TENANT", "CREATED"), *rows]:
                print(f"{key_id:<8}  {tenant:<{width}}  {created}")
            if not rows:
                print(f"(no keys in {store.path})")
    except (ValueError, OSError) as e:
        print(f"surge admin: {e}", file=sys.stderr)
        return 1
    return 0


def _reload_outcome(runtime_dir: str, before: str | None) -> int:
    """Wait for the supervisor to record the reload it was signalled for, and say how it went."""
    # The supervisor asks each replica's scheduler in turn, each for up to _TIMEOUT_MS.
    wait = _RELOAD_WAIT_S + len(admin_addresses(runtime_dir)) * _TIMEOUT_MS / 1000
    deadline = time.monotonic() + wait
    while (now := recorded(runtime_dir, "reload")) == before:
        if time.monotonic() > deadline:
            print(f"surge admin: reload signalled, but no outcome within {wait:.0f}s; see the "
                  "server log", file=sys.stderr)
            return 1
        time.sleep(0.1)
    outcome = json.loads(now or "{}")
    if not outcome.get("ok"):
        print(f"surge admin: {outcome.get('message')}", file=sys.stderr)
        return 1
    print(outcome.get("message"))
    return 0


def run_admin(args: argparse.Namespace) -> int:
    if args.action == "keys":
        return run_keys(args)
    try:
        runtime_dir = find_server(args.port, args.runtime_dir)
        # get NAME ...: those parameters only
        values = _pairs(args.values) if args.action != "get" else {}
    except (LookupError, ValueError) as e:
        print(f"surge admin: {e}", file=sys.stderr)
        return 2
    if args.action in ("reload", "drain"):
        try:
            pid = supervisor_pid(runtime_dir)  # checked again: it may have exited since
            before = recorded(runtime_dir, "reload")
        except LookupError as e:
            print(f"surge admin: {e}", file=sys.stderr)
            return 2
        os.kill(pid, signal.SIGHUP if args.action == "reload" else signal.SIGTERM)
        if args.action == "drain":
            print(f"drain: signalled surge (pid {pid})")
            return 0
        return _reload_outcome(runtime_dir, before)
    if args.action == "stats":
        print(_summary(runtime_dir))
        return 0
    if args.action == "capacity":
        ok, text = _capacity(runtime_dir, args.json)
        print(text if ok else f"surge admin: {text}", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    if args.action == "top":
        from surge.admin_top import run_top

        return run_top(runtime_dir, args.iterations)
    if args.action == "set" and not values:
        print("surge admin: set needs KEY=VALUE pairs", file=sys.stderr)
        return 2
    persist = args.persist and args.action == "set"
    if persist:
        try:
            _config_path(runtime_dir)  # before anything is applied
        except ValueError as e:
            print(f"surge admin: {e}", file=sys.stderr)
            return 2
    reply = ask_all(admin_addresses(runtime_dir), args.action, values)
    if args.action == "get" and args.values and reply.ok:
        if unknown := [name for name in args.values if name not in reply.values]:
            print(f"surge admin: no live parameter {', '.join(unknown)}; `surge admin get` "
                  "lists them all", file=sys.stderr)
            return 2
        reply = msgspec.structs.replace(reply, values={n: reply.values[n] for n in args.values})
    if args.json:
        print(json.dumps({"ok": reply.ok, "message": reply.message, "values": reply.values},
                         indent=2))
    elif not reply.ok:
        print(f"surge admin: {args.action} refused, nothing changed: {reply.message}",
              file=sys.stderr)
    elif args.action == "set":
        print(f"{reply.message}:")
        print(_table({k: reply.values[k] for k in values}))
    else:
        print(_table(reply.values))
    if reply.ok and persist:
        try:
            # The reply's values as the server parsed them; a secret's as given (the reply
            # only says it is set).
            written = {k: values[k] if is_secret(k) else reply.values[k] for k in values}
            print(f"written to {_persist(runtime_dir, written)}")
            beaten = json.loads(recorded(runtime_dir, "overrides") or "{}")
            for key in values.keys() & beaten.keys():
                print(f"surge admin: note: {key} is also set by {beaten[key]}, which beats the "
                      f"config file: a reload or a restart takes {beaten[key]}'s value",
                      file=sys.stderr)
        except (ValueError, OSError, LookupError) as e:
            print(f"surge admin: applied live but NOT written to the config file: {e}",
                  file=sys.stderr)
            return 1
    return 0 if reply.ok else 1
