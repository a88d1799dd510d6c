import json

import pytest

from aitrainsai import Item, ToolSession, call_tool
from aitrainsai.testing import TaskFamilyConformance
from aitrainsai_family_triage import world
from aitrainsai_family_triage.family import TriageFamily, parse_reply


class TestTriageFamily(TaskFamilyConformance):
    family = TriageFamily
    distribution = "aitrainsai-family-triage"


def metrics(error_rate, **extra):
    return {"error_rate_pct": error_rate, "p99_ms": 200, "cpu_pct": 40, "memory_pct": 50, "traffic_vs_usual": 1.0,
            "health": "failing" if error_rate >= 5 else "ok", **extra}


@pytest.fixture
def hand_world():
    """web-frontend -> checkout -> payments (out of memory, silent); a recent deploy on checkout and a certificate
    warning on search are red herrings."""
    return {
        "start": "14:05", "root": "payments", "cause": "memory_leak",
        "chain": ["web-frontend", "checkout", "payments"],
        "services": ["web-frontend", "checkout", "search", "payments", "postgres-orders"],
        "calls": {"web-frontend": ["checkout", "search"], "checkout": ["search", "payments"],
                  "search": ["postgres-orders"], "payments": ["postgres-orders"], "postgres-orders": []},
        "failing": ["web-frontend", "checkout", "payments"],
        "metrics": {"web-frontend": metrics(12.0), "checkout": metrics(20.0), "search": metrics(0.4),
                    "payments": metrics(33.0, memory_pct=98), "postgres-orders": metrics(0.2)},
        "alerts": [
            {"service": "search", "severity": "warning", "since": "2 days ago",
             "summary": "TLS certificate expires in 9 days"},
            {"service": "checkout", "severity": "critical", "since": "14:05", "summary": "error rate 20%"},
            {"service": "web-frontend", "severity": "critical", "since": "14:05", "summary": "error rate 12%"},
        ],
        "deploys": [{"service": "checkout", "version": "v3.2.0", "at": "13:55"}],
        "logs": {
            "web-frontend": ["14:05 ERROR upstream dependency call failed: deadline exceeded"],
            "checkout": ["13:55 INFO checkout started version v3.2.0",
                         "14:05 ERROR call to payments failed: timeout after 3000ms"],
            "search": ["13:50 WARN certificate expires in 9 days"],
            "payments": ["14:05 WARN heap usage 97% and rising",
                         "14:06 ERROR java.lang.OutOfMemoryError: Java heap space"],
            "postgres-orders": ["14:00 INFO GET /health 200 (3ms)"],
        },
    }


def hand_item(world_dict, level=4):
    return Item(family="triage", level=level, seed=0, index=0, question="Incident INC-12345 started at 14:05.",
                answer="payments restart", world=world_dict)


def reply(family, item, text):
    return family.initial_messages(item) + [{"role": "assistant", "content": text}]


def test_hand_checked_tool_results(hand_world):
    tools = TriageFamily().tools(hand_item(hand_world))
    assert json.loads(call_tool(tools, "get_dependencies", {"service": "Checkout"})) == {
        "service": "checkout", "health": "failing",
        "calls": [{"service": "search", "health": "ok"}, {"service": "payments", "health": "failing"}]}
    assert json.loads(call_tool(tools, "get_metrics", {"service": "payments"}))["memory_pct"] == 98
    assert json.loads(call_tool(tools, "get_logs", {"service": "payments"}))[1].endswith("Java heap space")
    assert json.loads(call_tool(tools, "list_deploys", {})) == hand_world["deploys"]
    assert len(json.loads(call_tool(tools, "list_alerts", {}))) == 3
    assert json.loads(call_tool(tools, "list_services", {}))[-1] == "postgres-orders"


def test_reference_solver_skips_noise_and_follows_failing_dependencies(hand_world):
    family = TriageFamily()
    transcript = family.reference_transcript(hand_item(hand_world))
    assert transcript[-1]["content"] == "<answer>payments restart</answer>"
    visited = [json.loads(m["tool_calls"][0]["function"]["arguments"]).get("service")
               for m in transcript if m.get("tool_calls")]
    assert visited == [None, "search", "checkout", "payments", "payments"]


@pytest.mark.parametrize("text, expected", [
    ("<answer>payments restart</answer>", 1.0),
    ("I would restart it. <answer>Service: payments, action: RESTART.</answer>", 1.0),
    ("<answer>payments rollback</answer>", 0.5),
    ("<answer>payments</answer>", 0.5),
    ("<answer>payments restart or rollback</answer>", 0.5),
    ("<answer>checkout restart</answer>", 0.0),
    ("<answer>checkout payments restart</answer>", 0.0),
    ("<answer>restart</answer>", 0.0),
    ("", 0.0),
])
def test_partial_credit(hand_world, text, expected):
    family = TriageFamily()
    item = hand_item(hand_world)
    assert family.score(item, reply(family, item, text)) == expected


def test_action_spellings():
    assert parse_reply("orders scale up") == ({"orders"}, {"scale_up"})
    assert parse_reply("redis-cache: clear-cache") == ({"redis-cache"}, {"clear_cache"})
    assert parse_reply("auth, renew certificate") == ({"auth"}, {"renew_certificate"})
    assert parse_reply("roll back billing") == ({"billing"}, {"rollback"})


def test_generated_incidents_are_consistent():
    for level in world.LEVELS:
        for item in world.generate(17, level, 40):
            w = item.world
            root, action = item.answer.split()
            assert action == world.CAUSE_ACTION[w["cause"]] and root == w["root"] == w["chain"][-1]
            failing = {s for s, m in w["metrics"].items() if m["health"] == "failing"}
            assert failing == set(w["failing"])
            assert not any(dep in failing for dep in w["calls"][root])
            assert all(any(d in failing for d in w["calls"][s]) for s in failing - {root})
            assert (w["cause"] == "primary_down") == (root in world.STORES)
            if level > 1:
                assert root not in parse_reply(item.question)[0]


def test_level_one_states_alerts_and_one_deploy():
    for item in world.generate(4, 1, 40):
        (deploy,) = item.world["deploys"]
        assert f"Recent deploy: {deploy['service']} {deploy['version']}" in item.question
        assert all(f"- {a['service']} (" in item.question for a in item.world["alerts"])
        assert item.world["root"] in item.question
        assert len(parse_reply(item.question)[0]) >= 2  # echoing the question names several services


def test_higher_levels_are_harder():
    def mean(level, measure):
        return sum(measure(i.world) for i in world.generate(8, level, 60)) / 60
    def depth(w):
        return len(w["chain"]) - 1
    def root_alerts(w):
        return any(a["service"] == w["root"] for a in w["alerts"])
    def noise(w):
        return sum(a["service"] not in w["failing"] for a in w["alerts"])
    assert mean(1, depth) < mean(3, depth) < mean(4, depth)
    assert mean(2, root_alerts) == 1.0 > mean(3, root_alerts) > mean(4, root_alerts) == 0.0
    assert mean(2, noise) < mean(3, noise) < mean(4, noise)


@pytest.mark.parametrize("name, arguments", [
    ("get_logs", {"service": "no-such-service"}),
    ("get_logs", {"service": "s" * 5000}),
    ("get_metrics", {"service": ["payments"]}),
    ("get_dependencies", {}),
    ("get_dependencies", {"service": "payments", "depth": 2}),
    ("list_alerts", {"service": "payments"}),
])
def test_bad_tool_input_is_an_error_string(hand_world, name, arguments):
    session = ToolSession(TriageFamily(), hand_item(hand_world))
    result = call_tool(session.tools, name, json.dumps(arguments))
    assert result.startswith("error: "), result
    assert len(result) < 600


def test_constant_answers_score_low():
    family = TriageFamily()
    hidden = family.hidden_eval()
    for text in ("<answer>checkout rollback</answer>", "<answer>redis-cache failover</answer>"):
        assert sum(family.score(i, reply(family, i, text)) for i in hidden) / len(hidden) < 0.1
