"""Private: the family's hidden eval, scorer and reference solver."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from aitrainsai import Item, TaskFamily, ToolSession
from aitrainsai_family_ledger import world


def _pattern(template: str) -> re.Pattern:
    """A question template as a regex that captures its account names as ``a`` and ``b``."""
    text = re.escape(template)
    return re.compile(text.replace(re.escape("{a}"), r"(?P<a>\w+)").replace(re.escape("{b}"), r"(?P<b>\w+)"))


_QUESTION_PATTERNS = {kind: _pattern(template) for kind, template in
                      {**world.QUESTION_TEMPLATES, "level_one": world.LEVEL_ONE_QUESTION}.items()}
_TOTAL = re.compile(r"journal total (-?\d+)")


class LedgerFamily(TaskFamily):
    """Bookkeeping over a ledger of deposits, withdrawals, transfers, fees, refunds and corrections.

    The answer is one integer (a balance, a change, or a total); it is compared as a number, so "1,204" equals
    "1204". No partial credit.
    """

    name = world.FAMILY
    description = "Stateful bookkeeping: apply a ledger's transactions, refunds and corrections to find a figure."
    levels = tuple(world.LEVELS)
    default_level = 1
    eval_seed = 708120563
    turn_limit = 8
    goal = (
        "Teach the model to keep books: from accounts' opening balances and a list of transactions (deposits, "
        "withdrawals, transfers, bank fees, refunds that undo an earlier transaction, corrections that change an "
        "earlier transaction's amount), work out an integer figure: an account's closing balance, how much its "
        "balance changed, the fees it paid, the total moved from one account to another, or two accounts' combined "
        "balance. Level 1 states two accounts with balances up to 20 and one small transaction in the question; "
        "level 2 needs the "
        "tools to read a history of 4-6 transactions with a refund; levels 3-4 have longer histories (7-16) with "
        "refunds and corrections and ask for derived figures too. The tools read opening balances and transactions; "
        "a scratch journal (post_entries, read_journal) adds signed amounts so the model need not add in its head. "
        "The answer is one integer, e.g. <answer>1204</answer>."
    )
    system_prompt = (
        "You are a bookkeeper. Amounts are whole numbers. A deposit adds money to an account; a withdrawal or a fee "
        "takes money out; a transfer moves money from one account to another; a refund undoes an earlier "
        "transaction, moving its amount back; a correction changes an earlier transaction's amount from old_amount "
        "to new_amount, so only the difference moves, in the same direction as that transaction. If the question "
        "gives the numbers, work from them; otherwise use the tools: read_opening_balance, list_transactions and "
        "get_transaction read the ledger, and post_entries adds signed amounts (money in positive, money out "
        "negative) to a scratch journal and reports its total. End your reply with the number as "
        "<answer>NUMBER</answer>, for example <answer>1204</answer>."
    )
    answer_format = (
        "End your final reply with <answer>NUMBER</answer>: one integer, negative for a fall, e.g. "
        "<answer>-35</answer>. It is compared as a number; without the tags the last number in the reply is taken."
    )
    answer_fallback = "last_number"
    public_modules = ("aitrainsai_family_ledger", "aitrainsai_family_ledger.world")
    tool_functions = world.TOOLS

    def generate(self, seed: int, level: int, n: int) -> list[Item]:
        return world.generate(seed, level, n)

    def tools(self, item: Item) -> dict[str, Callable]:
        """A fresh scratch journal for every conversation."""
        return world.bind_tools(item.world)

    def solve(self, item: Item, session: ToolSession) -> str:
        ask = item.question.split(": ", 1)[-1] if item.level > 1 else item.question
        kind, match = next((kind, match) for kind, pattern in _QUESTION_PATTERNS.items()
                           if (match := pattern.search(ask)))
        first = match.group("a")
        second = match.groupdict().get("b")
        if kind in ("level_one", "closing", "net_change"):
            amounts = [] if kind == "net_change" else [int(session.call("read_opening_balance", account=first))]
            ledger = json.loads(session.call("list_transactions", account=first))
            amounts += _movements(ledger, first)
        elif kind == "combined":
            assert second is not None  # the combined question names two accounts
            amounts = [int(session.call("read_opening_balance", account=name)) for name in (first, second)]
            ledger = json.loads(session.call("list_transactions"))
            amounts += _movements(ledger, first) + _movements(ledger, second)
        elif kind == "fees":
            ledger = json.loads(session.call("list_transactions", account=first))
            amounts = _totals(ledger, lambda t: t["kind"] == "fee" and t["from"] == first)
        else:
            ledger = json.loads(session.call("list_transactions", account=first))
            amounts = _totals(ledger, lambda t: t["kind"] == "transfer" and (t["from"], t["to"]) == (first, second))
        if not amounts:
            return "0"
        memo = " ".join(filter(None, (kind, first, second)))
        total = _TOTAL.search(session.call("post_entries", amounts=amounts, memo=memo))
        assert total is not None, "post_entries reports the journal total"
        return total.group(1)


def _movements(ledger: list[dict], account: str) -> list[int]:
    """Every signed amount that moved money in or out of ``account``, corrections as differences."""
    by_id = {t["id"]: t for t in ledger}
    amounts: list[int] = []
    for transaction in ledger:
        if transaction["kind"] == "correction":
            moved, amount = by_id[transaction["corrects"]], transaction["new_amount"] - transaction["old_amount"]
        else:
            moved, amount = transaction, transaction["amount"]
        if moved.get("to") == account:
            amounts.append(amount)
        if moved.get("from") == account:
            amounts.append(-amount)
    return amounts


def _totals(ledger: list[dict], counts: Callable[[dict], bool]) -> list[int]:
    """Amounts of the transactions ``counts`` selects, with their corrections added and their refunds taken off."""
    by_id = {t["id"]: t for t in ledger}
    amounts = []
    for transaction in ledger:
        if transaction["kind"] == "correction" and counts(by_id[transaction["corrects"]]):
            amounts.append(transaction["new_amount"] - transaction["old_amount"])
        elif transaction["kind"] == "refund" and counts(by_id[transaction["refunds"]]):
            amounts.append(-transaction["amount"])
        elif counts(transaction):
            amounts.append(transaction["amount"])
    return amounts
