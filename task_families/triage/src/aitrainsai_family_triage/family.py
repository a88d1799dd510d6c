"""Private: the family's hidden eval, scorer and reference solver."""

from __future__ import annotations

import json
from collections.abc import Sequence

from aitrainsai import Item, Message, TaskFamily, ToolSession, extract_answer, final_reply
from aitrainsai_family_triage import world
from aitrainsai_family_triage.world import parse_reply

LOG_MARKERS = {  # log text that identifies what broke, and so the action
    "rollback": ("NullPointerException", "500 Internal Server Error", "unhandled exception"),
    "restart": ("OutOfMemoryError", "OOMKilled"),
    "scale_up": ("worker pool exhausted", "request queue full"),
    "failover": ("primary", "replica"),
    "renew_certificate": ("certificate has expired", "expired certificate"),
    "clear_cache": ("checksum mismatch", "stale entries"),
}


class TriageFamily(TaskFamily):
    """Find the root-cause service of an incident and the action that fixes it.

    The answer is ``<answer>SERVICE ACTION</answer>``, e.g. ``<answer>payments restart</answer>``, with ACTION one of
    rollback, restart, scale_up, failover, renew_certificate, clear_cache (``scale up`` and ``scale-up`` also count).
    Scoring is deterministic, with partial credit:
      1.0  the answer names exactly one service, the root cause, and exactly one action, the right one;
      0.5  it names exactly one service, the root cause, but the action is wrong, missing or not unique;
      0.0  otherwise (a wrong service, no service, or several services).
    """

    name = world.FAMILY
    description = "On-call incident triage: the root-cause service and its remediation action."
    held_out = True
    levels = world.LEVELS
    default_level = 1
    eval_seed = 169577176
    turn_limit = 12
    goal = (
        "Teach the model on-call incident triage: name the service that caused the incident and the one remediation "
        "action that fixes it. The root cause is the failing service none of whose dependencies fail; services that "
        "call it fail too and alert, so follow the failing dependencies down. Its own symptoms give the action: new "
        "code errors right after its deploy -> rollback; out of memory / OOMKilled -> restart; CPU saturated, "
        "traffic far above usual, queue full -> scale_up; primary node down with a healthy replica -> failover; "
        "expired TLS certificate -> renew_certificate; stale or mismatching cached data -> clear_cache. Level 1 "
        "states the alerts and the one recent deploy in the question; levels 2-4 give only the incident and need the "
        "tools (list_alerts, list_deploys, get_dependencies, get_logs, get_metrics), with longer dependency chains, a "
        "silent root cause, unrelated warning alerts and deploys that are not the cause."
    )
    system_prompt = (
        "You are the on-call engineer triaging an incident. Use the tools to read alerts, recent deploys, the "
        "services each service calls (with their health), logs and metrics. The root cause is the failing service "
        "none of whose dependencies fail; alerts on services that call it are symptoms, and some alerts and deploys "
        "are unrelated. Pick one action from its own symptoms: rollback (new errors in its code right after its "
        "deploy), restart (out of memory, OOMKilled), scale_up (CPU saturated, traffic far above usual, queue full), "
        "failover (primary node down, replica healthy), renew_certificate (TLS certificate expired), clear_cache "
        "(stale or mismatching cached data). End your final reply with <answer>SERVICE ACTION</answer>, for example "
        "<answer>payments restart</answer>."
    )
    answer_format = ("End your final reply with <answer>SERVICE ACTION</answer>, e.g. "
                     "<answer>payments restart</answer>; ACTION is one of rollback, restart, scale_up, failover, "
                     "renew_certificate, clear_cache. Scores: 1.0 right service and action, 0.5 right service only, "
                     "0 otherwise (naming several services counts as wrong).")
    public_modules = ("aitrainsai_family_triage", "aitrainsai_family_triage.world")
    tool_functions = world.TOOLS

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        return world.generate(seed, level, n)

    def score(self, item: Item, transcript: Sequence[Message]) -> float:
        services, actions = parse_reply(extract_answer(final_reply(transcript), self.answer_fallback))
        root, action = item.answer.split()
        if services != {root}:
            return 0.0
        return 1.0 if actions == {action} else 0.5

    def solve(self, item: Item, session: ToolSession) -> str:
        alerts = json.loads(session.call("list_alerts"))
        node: dict | None = None
        for alert in alerts:
            node = json.loads(session.call("get_dependencies", service=alert["service"]))
            if node["health"] == "failing":
                break
        assert node is not None, "no alerts"
        failing = [dep["service"] for dep in node["calls"] if dep["health"] == "failing"]
        while failing:
            node = json.loads(session.call("get_dependencies", service=failing[0]))
            failing = [dep["service"] for dep in node["calls"] if dep["health"] == "failing"]
        root = node["service"]
        logs = "\n".join(json.loads(session.call("get_logs", service=root)))
        action = max(world.ACTIONS, key=lambda a: sum(marker in logs for marker in LOG_MARKERS[a]))
        if action == "rollback":  # code errors: confirm that the root was deployed just before
            deploys = json.loads(session.call("list_deploys"))
            assert any(d["service"] == root for d in deploys)
        return f"{root} {action}"
