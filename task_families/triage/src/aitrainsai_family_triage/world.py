"""Public: the seeded generator and the tools. An agent's job may import this module.

A world is one incident: services and the services each one calls, the failing ones (the root cause and every
service that calls it, directly or through others), alerts (some misleading, on healthy services), recent deploys
(some unrelated), logs and metrics. The root cause is the failing service none of whose dependencies fail; its own
logs show what broke, and that decides the remediation action.
"""

from __future__ import annotations

import random
import re
from typing import Any

from aitrainsai import Item

FAMILY = "triage"
LEVELS = (1, 2, 3, 4)

EDGE = ("api-gateway", "web-frontend", "mobile-bff", "partner-api", "admin-portal")
APPS = (
    "checkout", "cart", "orders", "payments", "billing", "invoicing", "inventory", "catalog", "search", "pricing",
    "recommendations", "reviews", "shipping", "notifications", "email-sender", "sms-gateway", "auth", "user-profile",
    "fraud-check", "ledger", "reporting", "media", "image-resizer", "coupons", "loyalty", "tax-calc", "geo-lookup",
    "feature-flags",
)
STORES = ("postgres-orders", "postgres-users", "mysql-catalog", "redis-cache", "redis-sessions", "kafka-events",
          "elasticsearch", "mongo-reviews", "cassandra-ledger", "rabbitmq")
SERVICES = EDGE + APPS + STORES
ACTIONS = ("rollback", "restart", "scale_up", "failover", "renew_certificate", "clear_cache")
CAUSE_ACTION = {
    "bad_deploy": "rollback",
    "memory_leak": "restart",
    "traffic_surge": "scale_up",
    "primary_down": "failover",
    "cert_expired": "renew_certificate",
    "stale_cache": "clear_cache",
}
DEPTH = {1: (1, 2), 2: (1, 2), 3: (2, 3), 4: (3, 4)}
SIZE = {1: (8, 9), 2: (9, 10), 3: (10, 12), 4: (12, 14)}
MAX_NAME_CHARS = 60

ROOT_ALERT = {  # what an alert on the root says at level 1, where it names the symptom
    "bad_deploy": "error rate {err}%, new NullPointerException errors",
    "memory_leak": "memory {mem}%, OutOfMemoryError, containers OOMKilled",
    "traffic_surge": "CPU {cpu}%, traffic {traffic}x the usual, request queue full",
    "primary_down": "primary node unreachable in zone-a, replica in zone-b healthy",
    "cert_expired": "TLS handshakes failing: certificate has expired",
    "stale_cache": "cached data out of date: checksum mismatches on cached entries",
}
ROOT_LOGS = {
    "bad_deploy": ("ERROR NullPointerException in {module}.handle ({version})",
                   "ERROR 500 Internal Server Error on POST /v1/{endpoint} ({version})",
                   "ERROR unhandled exception in {module}.validate ({version})"),
    "memory_leak": ("WARN heap usage {mem}% and rising",
                    "ERROR java.lang.OutOfMemoryError: Java heap space",
                    "WARN container OOMKilled by the kernel, restart count {restarts}"),
    "traffic_surge": ("WARN inbound traffic {traffic}x baseline",
                      "WARN worker pool exhausted ({workers}/{workers} busy)",
                      "ERROR request queue full, rejecting new requests"),
    "primary_down": ("ERROR connection refused: primary {service}-0 (zone-a) unreachable",
                     "ERROR writes failing: no primary for shard {shard}",
                     "INFO replica {service}-1 (zone-b) healthy, replication lag 0s"),
    "cert_expired": ("ERROR TLS handshake failed: x509: certificate has expired",
                     "ERROR certificate for {service}.internal expired at {expired}",
                     "WARN rejecting client connections: expired certificate"),
    "stale_cache": ("WARN cache generation {generation} is behind source generation {source_generation}",
                    "ERROR checksum mismatch for cached key {endpoint}:{shard}",
                    "WARN serving stale entries from cache"),
}
HEALTHY_LOGS = ("INFO GET /health 200 (3ms)", "INFO processed {requests} requests in the last minute",
                "INFO cache hit ratio 0.9{digit}", "INFO connection pool {pool}/50 in use",
                "INFO scheduled job finished in {seconds}s", "DEBUG config reloaded")
# misleading alerts on healthy services: (severity, summary, log line, metric overrides)
NOISE: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    ("warning", "disk usage {disk}% on /var/log", "WARN disk /var/log at {disk}%", {}),
    ("warning", "TLS certificate expires in {days} days", "WARN certificate expires in {days} days", {}),
    ("warning", "CPU {busy}% for 10 minutes", "WARN CPU {busy}% during nightly batch", {"cpu_pct": "busy"}),
    ("info", "1 container restarted", "INFO container restarted after node drain", {}),
    ("critical", "nightly export job failed", "ERROR nightly export job failed: upstream file missing", {}),
    ("warning", "p99 latency {slow}ms above 500ms target", "WARN slow query on report endpoint ({slow}ms)",
     {"p99_ms": "slow"}),
)
SYMPTOMS = ("users see errors", "requests are failing", "latency spiked and requests time out",
            "customers report failed pages")
MODULES = ("OrderMapper", "PriceRule", "CartMerger", "TokenParser", "InvoiceBuilder", "QueryPlanner", "EventCodec")


# -- reading an answer (the eval scores what this returns) ----------------------------------------------------------

ACTION_PHRASES = [(re.compile(r"\b" + action.replace("_", r"[\s_\-]+") + r"s?\b"), action) for action in ACTIONS]
ACTION_PHRASES.append((re.compile(r"\broll[\s_\-]+back\b"), "rollback"))
TOKEN = re.compile(r"[a-z0-9][a-z0-9_\-]*[a-z0-9]|[a-z0-9]")


def parse_reply(answer: str) -> tuple[set[str], set[str]]:
    """The service names and the actions an answer mentions ('scale up', 'restarts', 'roll back' read as
    scale_up, restart, rollback)."""
    text = answer.lower()
    for pattern, action in ACTION_PHRASES:
        text = pattern.sub(action, text)
    tokens = TOKEN.findall(text)
    services = {t for t in tokens if t in SERVICES}
    actions = {t.replace("-", "_") for t in tokens if t.replace("-", "_") in ACTIONS}
    return services, actions


# -- times -------------------------------------------------------------------------------------------------------

def clock(total: int) -> str:
    total %= 24 * 60
    return f"{total // 60:02d}:{total % 60:02d}"


# -- generator -----------------------------------------------------------------------------------------------------

def generate(seed: int, level: int, n: int) -> list[Item]:
    """``n`` items at ``level``; the same seed and level give the same items."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    items = []
    for index in range(n):
        rng = random.Random(f"{FAMILY}:{seed}:{level}:{index}")
        world = _incident(rng, level)
        question = _question(rng, level, world)
        items.append(Item(family=FAMILY, level=level, seed=seed, index=index, question=question,
                          answer=f"{world['root']} {CAUSE_ACTION[world['cause']]}", world=world))
    return items


def _incident(rng: random.Random, level: int) -> dict:
    cause = rng.choice(tuple(CAUSE_ACTION))
    depth = rng.randint(*DEPTH[level])
    start = rng.randrange(30, 24 * 60 - 30)
    root = rng.choice(STORES if cause == "primary_down" else APPS)
    apps = [a for a in APPS if a != root]
    rng.shuffle(apps)
    chain = [rng.choice(EDGE)] + [apps.pop() for _ in range(depth - 1)] + [root]

    # ranks order the graph: a service only calls services of higher rank
    rank = {service: position for position, service in enumerate(chain)}
    bottom = depth + 2
    if root in STORES:
        rank[root] = bottom
    size = rng.randint(*SIZE[level])
    stores = [s for s in STORES if s not in rank]
    extra_stores = rng.sample(stores, rng.randint(1, 2))
    for store in extra_stores:
        rank[store] = bottom
    while len(rank) < size:
        rank[apps.pop()] = rng.randint(1, depth + 1)
    services = sorted(rank, key=lambda s: (rank[s], s))

    calls: dict[str, list[str]] = {s: [] for s in services}
    for upper, lower in zip(chain, chain[1:]):
        calls[upper].append(lower)
    for service in services:  # only chain services call chain services, so exactly the chain fails
        if service in STORES:
            continue
        below = [s for s in services if rank[s] > rank[service] and s not in calls[service]
                 and (service in chain or s not in chain)]
        for dep in rng.sample(below, min(len(below), rng.randint(0 if calls[service] else 1, 2))):
            calls[service].append(dep)
    if level >= 2 and rng.random() < 0.5:  # except one more caller of a chain service, which fails too
        pairs = [(s, c) for s in services for c in chain[1:]
                 if s not in chain and s not in STORES and rank[s] < rank[c]]
        if pairs:
            caller, callee = rng.choice(pairs)
            calls[caller].append(callee)
    for service in services:  # every non-edge service has a caller
        if rank[service] > 0 and not any(service in deps for deps in calls.values()):
            above = [s for s in services if rank[s] < rank[service] and s not in STORES]
            calls[rng.choice(above)].append(service)
    for deps in calls.values():
        rng.shuffle(deps)

    failing = {root} | _callers_of(root, calls)
    world: dict[str, Any] = {"start": clock(start), "root": root, "cause": cause, "chain": chain,
                             "services": services, "calls": calls, "failing": sorted(failing, key=services.index)}
    details: dict[str, Any] = {
        "err": rng.randint(12, 60), "mem": rng.randint(95, 99), "cpu": rng.randint(95, 99),
        "traffic": rng.choice(("2.8", "3.1", "3.4", "3.9", "4.5")), "restarts": rng.randint(3, 9),
        "workers": rng.choice((32, 64, 128)), "shard": rng.randint(1, 16), "version": _version(rng),
        "module": rng.choice(MODULES), "endpoint": rng.choice(("orders", "prices", "items", "accounts")),
        "expired": clock(start - rng.randint(1, 4)), "generation": rng.randint(30, 90), "service": root}
    details["source_generation"] = details["generation"] + rng.randint(1, 3)
    world["metrics"] = {s: _metrics(rng, s, world, details) for s in services}
    world["alerts"] = _alerts(rng, level, world, details)
    world["deploys"], started = _deploys(rng, level, world, details, start)
    world["logs"] = {s: _logs(rng, s, level, world, details, start, started.get(s)) for s in services}
    return world


def _callers_of(target: str, calls: dict[str, list[str]]) -> set[str]:
    found: set[str] = set()
    frontier = [target]
    while frontier:
        current = frontier.pop()
        for service, deps in calls.items():
            if current in deps and service not in found:
                found.add(service)
                frontier.append(service)
    return found


def _version(rng: random.Random) -> str:
    return f"v{rng.randint(1, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}"


def _metrics(rng: random.Random, service: str, world: dict, details: dict) -> dict:
    metrics: dict[str, Any] = {"error_rate_pct": round(rng.uniform(0.1, 0.9), 1), "p99_ms": rng.randint(40, 300),
                               "cpu_pct": rng.randint(20, 65), "memory_pct": rng.randint(30, 70),
                               "traffic_vs_usual": round(rng.uniform(0.8, 1.2), 1)}
    if service == world["root"]:
        cause = world["cause"]
        metrics["error_rate_pct"] = float(details["err"])
        metrics["p99_ms"] = rng.randint(1500, 9000)
        if cause == "memory_leak":
            metrics["memory_pct"] = details["mem"]
        if cause == "traffic_surge":
            metrics.update(cpu_pct=details["cpu"], traffic_vs_usual=float(details["traffic"]))
    elif service in world["failing"]:
        metrics["error_rate_pct"] = float(rng.randint(6, 40))
        metrics["p99_ms"] = rng.randint(2000, 9000)
    metrics["health"] = "failing" if metrics["error_rate_pct"] >= 5 else "ok"
    return metrics


def _alerts(rng: random.Random, level: int, world: dict, details: dict) -> list[dict]:
    start = world["start"]
    root, chain, failing = world["root"], world["chain"], world["failing"]
    alerts = []
    if level == 1:
        alerts.append({"service": root, "severity": "critical", "since": start,
                       "summary": ROOT_ALERT[world["cause"]].format(**details)})
        caller = chain[-2]
        if world["cause"] == "bad_deploy" or rng.random() < 0.7:
            alerts.append({"service": caller, "severity": "critical", "since": start,
                           "summary": f"error rate {world['metrics'][caller]['error_rate_pct']:g}%, "
                                      f"calls to {root} time out"})
    else:
        silent_root = level == 4 or (level == 3 and rng.random() < 0.5)
        alerting = [s for s in failing if not (s == root and silent_root)]
        alerting = [s for s in alerting if s in chain] + rng.sample(
            [s for s in alerting if s not in chain], min(1, len([s for s in alerting if s not in chain])))
        for service in alerting:
            metrics = world["metrics"][service]
            summary = rng.choice((f"error rate {metrics['error_rate_pct']:g}%", f"p99 latency {metrics['p99_ms']}ms"))
            alerts.append({"service": service, "severity": "critical", "since": start, "summary": summary})
        noise_count = {2: int(rng.random() < 0.4), 3: 1, 4: 2}[level]
        healthy = [s for s in world["services"] if s not in failing]
        for service, (severity, summary, line, overrides) in zip(rng.sample(healthy, noise_count),
                                                                  rng.sample(NOISE, noise_count)):
            values = {"disk": rng.randint(81, 89), "days": rng.randint(5, 14), "busy": rng.randint(75, 85),
                      "slow": rng.randint(600, 900)}
            world["metrics"][service].update({k: values[v] for k, v in overrides.items()})
            world.setdefault("noise_logs", {})[service] = line.format(**values)
            since = rng.choice((f"yesterday {clock(rng.randrange(24 * 60))}", "2 days ago", "3 days ago"))
            alerts.append({"service": service, "severity": severity, "since": since,
                           "summary": summary.format(**values)})
    rng.shuffle(alerts)
    return alerts


def _deploys(rng: random.Random, level: int, world: dict, details: dict,
             start: int) -> tuple[list[dict], dict[str, tuple[int, str]]]:
    """The deploys, and for each service deployed today the minute it started its new version."""
    root, chain, failing = world["root"], world["chain"], world["failing"]
    healthy = [s for s in world["services"] if s not in failing]
    healthy = [s for s in healthy if s not in STORES] or healthy
    started: dict[str, tuple[int, str]] = {}
    deploys = []

    def deploy(service: str, version: str, minute: int | None) -> None:
        at = f"yesterday {clock(rng.randrange(24 * 60))}" if minute is None else clock(minute)
        deploys.append({"service": service, "version": version, "at": at})
        if minute is not None:
            started[service] = (minute, version)

    if world["cause"] == "bad_deploy":
        deploy(root, details["version"], start - rng.randint(2, 9))
    if level >= 3:  # a caller of the root was deployed shortly before the incident
        deploy(rng.choice(chain[:-1]), _version(rng), start - rng.randint(4, 25))
    if level == 4 and world["cause"] != "bad_deploy":  # the root was deployed, but yesterday or after the start
        deploy(root, _version(rng), rng.choice((None, start + rng.randint(6, 15))))
    wanted = {1: 1, 2: 2, 3: rng.randint(2, 3), 4: rng.randint(3, 4)}[level]
    for service in rng.sample(healthy, min(len(healthy), max(0, wanted - len(deploys)))):
        deploy(service, _version(rng), start - rng.randint(5, 180) if rng.random() < 0.6 else None)
    rng.shuffle(deploys)
    return deploys, started


def _logs(rng: random.Random, service: str, level: int, world: dict, details: dict, start: int,
          started: tuple[int, str] | None) -> list[str]:
    values = {"requests": f"{rng.randint(300, 9000):,}", "digit": rng.randint(0, 9), "pool": rng.randint(3, 40),
              "seconds": round(rng.uniform(0.4, 9.0), 1)}
    lines = [(start - rng.randint(5, 15), line.format(**values)) for line in rng.sample(HEALTHY_LOGS, 2)]
    if started:
        lines.append((started[0], f"INFO {service} started version {started[1]}"))
    if service in world.get("noise_logs", {}):
        lines.append((start - rng.randint(1, 20), world["noise_logs"][service]))
    if service == world["root"]:
        for offset, line in enumerate(ROOT_LOGS[world["cause"]]):
            lines.append((start + offset, line.format(**details)))
    elif service in world["failing"]:
        failing_deps = [d for d in world["calls"][service] if d in world["failing"]]
        named = level <= 2 or (level == 3 and rng.random() < 0.5)
        for offset, dep in enumerate(failing_deps):
            if named:
                lines.append((start + offset, rng.choice((f"ERROR call to {dep} failed: timeout after 3000ms",
                                                          f"ERROR {dep} returned 503 Service Unavailable"))))
                lines.append((start + offset + 1, f"WARN retrying request to {dep} (attempt 3/3)"))
            else:
                lines.append((start + offset, "ERROR upstream dependency call failed: deadline exceeded"))
                lines.append((start + offset + 1, "WARN circuit breaker open for an upstream dependency"))
    lines.sort(key=lambda pair: pair[0])
    return [f"{clock(minute)} {text}" for minute, text in lines]


def _question(rng: random.Random, level: int, world: dict) -> str:
    incident = f"INC-{rng.randint(10000, 99999)}"
    if level > 1:
        return (f"Incident {incident} started at {world['start']}: {rng.choice(SYMPTOMS)} on {world['chain'][0]}. "
                f"Find the root-cause service and the remediation action.")
    lines = [f"Incident {incident} started at {world['start']}.", "Alerts:"]
    lines += [f"- {a['service']} ({a['severity']} since {a['since']}): {a['summary']}" for a in world["alerts"]]
    (deploy,) = world["deploys"]
    when = deploy["at"] if deploy["at"].startswith("yesterday") else f"at {deploy['at']}"
    lines.append(f"Recent deploy: {deploy['service']} {deploy['version']} deployed {when}.")
    lines.append("Which service is the root cause, and which action fixes it?")
    return "\n".join(lines)


# -- tools ---------------------------------------------------------------------------------------------------------

def _service(world: dict, service: str) -> str:
    if len(service) > MAX_NAME_CHARS:
        raise ValueError(f"service name is too long ({len(service)} characters)")
    key = service.strip().lower()
    if key not in world["calls"]:
        raise KeyError(f"service {key}; call list_services for the names")
    return key


def list_services(world: dict) -> list[str]:
    """List the names of all services in this system."""
    return list(world["services"])


def list_alerts(world: dict) -> list[dict]:
    """List the alerts firing now: service, severity, since when, and a summary. Some alerts are unrelated noise."""
    return [dict(alert) for alert in world["alerts"]]


def list_deploys(world: dict) -> list[dict]:
    """List recent deploys: service, version and time. A deploy is not necessarily the cause of the incident."""
    return [dict(deploy) for deploy in world["deploys"]]


def get_dependencies(world: dict, service: str) -> dict:
    """Show a service's health and the services it calls, each with its health (ok or failing).

    Args:
        service: the service name, such as checkout
    """
    key = _service(world, service)
    return {"service": key, "health": world["metrics"][key]["health"],
            "calls": [{"service": dep, "health": world["metrics"][dep]["health"]} for dep in world["calls"][key]]}


def get_metrics(world: dict, service: str) -> dict:
    """Show a service's current metrics: error rate, p99 latency, CPU, memory, traffic versus usual, and health.

    Args:
        service: the service name, such as checkout
    """
    return dict(world["metrics"][_service(world, service)])


def get_logs(world: dict, service: str) -> list[str]:
    """Show a service's most recent log lines, oldest first.

    Args:
        service: the service name, such as checkout
    """
    return list(world["logs"][_service(world, service)])


TOOLS = (list_services, list_alerts, list_deploys, get_dependencies, get_metrics, get_logs)
