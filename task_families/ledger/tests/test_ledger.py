import json
import re

import pytest

from aitrainsai import Item, ToolSession, call_tool
from aitrainsai.testing import TaskFamilyConformance
from aitrainsai_family_ledger import world
from aitrainsai_family_ledger.family import LedgerFamily


class TestLedgerFamily(TaskFamilyConformance):
    family = LedgerFamily
    distribution = "aitrainsai-family-ledger"


# A hand-made ledger. Cash: 500 +200 -120 -5 -40, then +5 (T05 refunds fee T03) and +18 (T06 corrects T02 from 120
# to 102) = 558. Savings: 300 +120 -18 -60 -7 -2 (T09 corrects fee T08 from 7 to 9) = 333. Rent: 100 +40 +60 = 200.
WORLD = {
    "accounts": {"Cash": 500, "Savings": 300, "Rent": 100},
    "transactions": [
        {"id": "T01", "kind": "deposit", "amount": 200, "to": "Cash"},
        {"id": "T02", "kind": "transfer", "amount": 120, "from": "Cash", "to": "Savings"},
        {"id": "T03", "kind": "fee", "amount": 5, "from": "Cash"},
        {"id": "T04", "kind": "transfer", "amount": 40, "from": "Cash", "to": "Rent"},
        {"id": "T05", "kind": "refund", "refunds": "T03", "amount": 5, "to": "Cash"},
        {"id": "T06", "kind": "correction", "corrects": "T02", "old_amount": 120, "new_amount": 102},
        {"id": "T07", "kind": "transfer", "amount": 60, "from": "Savings", "to": "Rent"},
        {"id": "T08", "kind": "fee", "amount": 7, "from": "Savings"},
        {"id": "T09", "kind": "correction", "corrects": "T08", "old_amount": 7, "new_amount": 9},
    ],
}
EXPECTED = {
    "closing Cash": 558,
    "closing Savings": 333,
    "closing Rent": 200,
    "fees Cash": 0,
    "fees Savings": 9,
    "transferred Cash Savings": 102,
}


def _item(question: str, answer: int, level: int = 3) -> Item:
    return Item(family="ledger", level=level, seed=0, index=0, question=question, answer=str(answer), world=WORLD)


def test_tools_on_a_hand_made_ledger():
    tools = world.bind_tools(WORLD)
    assert json.loads(call_tool(tools, "list_accounts", {})) == ["Cash", "Savings", "Rent"]
    assert call_tool(tools, "read_opening_balance", {"account": " cash "}) == "500"
    rent = json.loads(call_tool(tools, "list_transactions", {"account": "Rent"}))
    assert [t["id"] for t in rent] == ["T04", "T07"]
    savings = json.loads(call_tool(tools, "list_transactions", {"account": "Savings"}))
    assert [t["id"] for t in savings] == ["T02", "T06", "T07", "T08", "T09"]  # corrections of its transactions too
    fees = json.loads(call_tool(tools, "list_transactions", {"kind": "fee"}))
    assert [t["id"] for t in fees] == ["T03", "T08"]
    assert json.loads(call_tool(tools, "get_transaction", {"transaction_id": "t06"}))["new_amount"] == 102
    assert call_tool(tools, "post_entries", {"amounts": [500, -120], "memo": "Cash"}) == (
        "posted +500, -120; journal total 380 from 2 entries")
    assert call_tool(tools, "post_entries", {"amounts": [18]}).endswith("journal total 398 from 3 entries")
    assert call_tool(tools, "read_journal", {}) == "journal total 398 from 3 entries\n+500 Cash\n-120 Cash\n+18"
    assert call_tool(tools, "clear_journal", {}) == "journal cleared; total 0"
    assert call_tool(tools, "read_journal", {}) == "journal total 0 from 0 entries"


def test_every_conversation_gets_its_own_journal():
    fam = LedgerFamily()
    item = fam.generate(4, 2, 1)[0]
    first = ToolSession(fam, item)
    first.call("post_entries", amounts=[1000])
    second = ToolSession(fam, item)
    assert second.call("read_journal") == "journal total 0 from 0 entries"
    assert "journal" not in item.world
    assert fam.score(item, fam.reference_transcript(item)) == 1.0
    assert fam.score(item, fam.reference_transcript(item)) == 1.0


def test_tools_report_bad_input_as_errors():
    tools = world.bind_tools(WORLD)
    cases = [
        ("read_opening_balance", {"account": "Nowhere"}, "not found"),
        ("read_opening_balance", {"account": "x" * 1_000}, "at most"),
        ("read_opening_balance", {"account": ["Cash"]}, "must be a string"),
        ("list_transactions", {"account": "Nowhere"}, "not found"),
        ("list_transactions", {"kind": "loan"}, "must be one of"),
        ("get_transaction", {"transaction_id": "T99"}, "not found"),
        ("get_transaction", {"transaction_id": 3}, "not found"),
        ("post_entries", {"amounts": []}, "at least one"),
        ("post_entries", {"amounts": "12"}, "must be a list"),
        ("post_entries", {"amounts": [1, "x"]}, "must be an integer"),
        ("post_entries", {"amounts": [10**30]}, "between"),
        ("post_entries", {"amounts": list(range(51))}, "at most 50"),
        ("read_journal", {"extra": 1}, "unknown argument"),
    ]
    for name, arguments, expected in cases:
        result = call_tool(tools, name, arguments)
        assert result.startswith("error:") and expected in result, (name, arguments, result)
    long_memo = call_tool(tools, "post_entries", {"amounts": [1], "memo": "m" * 1_500})
    assert long_memo.startswith("posted")
    assert len(call_tool(tools, "read_journal", {})) < 200  # the memo is capped
    for _ in range(10):
        call_tool(tools, "post_entries", {"amounts": list(range(50))})
    assert "at most 500 entries" in call_tool(tools, "post_entries", {"amounts": list(range(50))})


@pytest.mark.parametrize("kind, accounts", [
    ("closing", ["Cash"]), ("closing", ["Savings"]), ("closing", ["Rent"]), ("fees", ["Cash"]),
    ("fees", ["Savings"]), ("transferred", ["Cash", "Savings"]),
])
def test_reference_solver_on_the_hand_made_ledger(kind, accounts):
    fam = LedgerFamily()
    question = "Ledger 12345 of Test Shop: " + world.QUESTION_TEMPLATES[kind].format(a=accounts[0], b=accounts[-1])
    item = _item(question, EXPECTED[" ".join([kind, *accounts])])
    assert fam.score(item, fam.reference_transcript(item)) == 1.0
    assert item.world["accounts"]["Cash"] == 500  # the solver never changes the world


def test_derived_figures_on_the_hand_made_ledger():
    fam = LedgerFamily()
    cases = {"net_change": (["Cash"], 58), "combined": (["Savings", "Rent"], 333 + 200)}
    for kind, (accounts, answer) in cases.items():
        question = "Ledger 5 of Test Shop: " + world.QUESTION_TEMPLATES[kind].format(a=accounts[0], b=accounts[-1])
        item = _item(question, answer, level=4)
        assert fam.score(item, fam.reference_transcript(item)) == 1.0


def test_level_one_states_the_transactions():
    fam = LedgerFamily()
    sentence = re.compile(r"(\d+) is deposited into (\w+)|(\d+) is withdrawn from (\w+)|"
                          r"(\d+) is transferred from (\w+) to (\w+)|a fee of (\d+) is charged to (\w+)")
    for item in fam.generate(2, 1, 60):
        opening = dict((name, int(value)) for name, value in re.findall(r"(\w+) starts with (\d+)", item.question))
        assert opening == item.world["accounts"]
        balance = dict(opening)
        for match in sentence.finditer(item.question):
            d, d_to, w, w_from, t, t_from, t_to, f, f_from = match.groups()
            if d:
                balance[d_to] += int(d)
            elif w:
                balance[w_from] -= int(w)
            elif t:
                balance[t_from] -= int(t)
                balance[t_to] += int(t)
            else:
                balance[f_from] -= int(f)
        asked = re.search(r"What is the balance of (\w+) now\?$", item.question).group(1)
        assert str(balance[asked]) == item.answer
        assert len(item.world["transactions"]) == 1 and 0 < int(item.answer) < 30


def test_levels_have_their_refunds_and_corrections():
    fam = LedgerFamily()
    for level, spec in world.LEVELS.items():
        for item in fam.generate(6, level, 20):
            kinds = [t["kind"] for t in item.world["transactions"]]
            assert kinds.count("refund") >= spec.refunds and kinds.count("correction") >= spec.corrections
            assert len(item.world["accounts"]) == spec.accounts
            assert len(kinds) <= spec.transactions[1]
            if level > 1:
                assert item.question.startswith("Ledger ") and "starts with" not in item.question


def test_numbers_compare_as_numbers():
    fam = LedgerFamily()
    item = _item("Ledger 1 of Test Shop: " + world.QUESTION_TEMPLATES["closing"].format(a="Cash"), 1204)
    reply = lambda text: fam.initial_messages(item) + [{"role": "assistant", "content": text}]  # noqa: E731
    assert fam.score(item, reply("<answer>1,204</answer>")) == 1.0
    assert fam.score(item, reply("Cash ends with 1204.")) == 1.0
    assert fam.score(item, reply("<answer>1205</answer>")) == 0.0


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_questions_are_distinct(level):
    items = LedgerFamily().generate(0, level, 200)
    assert len({item.question for item in items}) >= 198


def test_reference_transcripts_fit_the_turn_limit():
    fam = LedgerFamily()
    for level in fam.levels:
        for item in fam.generate(13, level, 30):
            calls = sum(1 for m in fam.reference_transcript(item) if m.get("tool_calls"))
            assert 1 <= calls < fam.turn_limit
