"""Public: the seeded generator and the tools. An agent's job may import this module.

A world is a small business's ledger: accounts with opening balances and a numbered list of transactions. Amounts are
whole units (integers). The kinds of transaction, and how each moves money:

- deposit: ``amount`` comes into ``to`` from outside.
- withdrawal: ``amount`` leaves ``from`` to the outside.
- transfer: ``amount`` moves from ``from`` to ``to``.
- fee: ``amount`` is charged to ``from`` by the bank.
- refund: undoes the transaction named in ``refunds``: its ``amount`` moves back, from ``from`` (if any) to ``to``.
- correction: the transaction named in ``corrects`` should have had ``new_amount`` instead of ``old_amount``; the
  difference moves the way that transaction moved money.

A transaction is refunded or corrected at most once, never both. The scratch journal (``post_entries``,
``read_journal``, ``clear_journal``) is per conversation: bind the tools with :func:`bind_tools`, which gives every
conversation a fresh journal.
"""

from __future__ import annotations

import random
from typing import Literal
from collections.abc import Callable

from aitrainsai import Item, bind

FAMILY = "ledger"

Kind = Literal["any", "deposit", "withdrawal", "transfer", "fee", "refund", "correction"]
BASE_KINDS = ("deposit", "withdrawal", "transfer", "fee")
QUESTION_KINDS = ("closing", "net_change", "fees", "transferred", "combined")


class Level:
    """How one difficulty level is generated."""

    def __init__(self, accounts: int, transactions: tuple[int, int], opening: tuple[int, int],
                 amounts: tuple[int, int], fees: tuple[int, int], refunds: int, corrections: int,
                 questions: tuple[str, ...], facts_in_question: bool):
        self.accounts = accounts
        self.transactions = transactions
        self.opening = opening
        self.amounts = amounts
        self.fees = fees
        self.refunds = refunds  # at least this many refunds in the history
        self.corrections = corrections  # at least this many corrections
        self.questions = questions
        self.facts_in_question = facts_in_question


LEVELS: dict[int, Level] = {
    # level 1: one small transaction, stated in the question (the untrained 135M base scores weakly, not 0)
    1: Level(accounts=2, transactions=(1, 1), opening=(3, 20), amounts=(1, 9), fees=(1, 5), refunds=0,
             corrections=0, questions=("closing",), facts_in_question=True),
    2: Level(accounts=3, transactions=(4, 6), opening=(200, 900), amounts=(10, 300), fees=(2, 25), refunds=1,
             corrections=0, questions=("closing",), facts_in_question=False),
    3: Level(accounts=4, transactions=(7, 10), opening=(200, 900), amounts=(10, 400), fees=(2, 25), refunds=1,
             corrections=1, questions=("closing", "net_change", "fees"), facts_in_question=False),
    4: Level(accounts=5, transactions=(12, 16), opening=(500, 3000), amounts=(10, 900), fees=(2, 40), refunds=2,
             corrections=2, questions=QUESTION_KINDS, facts_in_question=False),
}

ACCOUNTS = ("Cash", "Savings", "Payroll", "Rent", "Travel", "Supplies", "Marketing", "Taxes", "Reserve", "Utilities",
            "Insurance", "Equipment", "Petty", "Grants", "Sales", "Repairs", "Training", "Catering", "Shipping",
            "Software")
BUSINESSES = ("Kestrel Bakery", "Juniper Print Shop", "Harbor Bike Repair", "Willow Tea Room", "Granite Builders",
              "Comet Courier", "Orchid Florist", "Lantern Bookshop", "Summit Outfitters", "Ember Pottery",
              "Maple Dental", "Pioneer Garage", "Quill Stationers", "Birch Yoga Studio", "Copper Kettle Cafe",
              "Falcon Locksmiths", "Meadow Vet Clinic", "Tidewater Marina", "Cobalt Print Lab", "Saffron Kitchen")

QUESTION_TEMPLATES = {
    "closing": "What is the closing balance of the {a} account after every entry in the ledger?",
    "net_change": "By how much did the balance of the {a} account change over the ledger (negative if it fell)?",
    "fees": "What is the total of the fees charged to the {a} account, after refunds and corrections?",
    "transferred": "How much was transferred in total from {a} to {b}, after refunds and corrections?",
    "combined": "What is the combined closing balance of the {a} and {b} accounts?",
}
LEVEL_ONE_QUESTION = "What is the balance of {a} now?"
STATEMENTS = {
    "deposit": "{amount} is deposited into {to}",
    "withdrawal": "{amount} is withdrawn from {from}",
    "transfer": "{amount} is transferred from {from} to {to}",
    "fee": "a fee of {amount} is charged to {from}",
}
MAX_ID_CHARS = 40
MAX_MEMO_CHARS = 60
MAX_BATCH = 50
MAX_JOURNAL = 500
MAX_AMOUNT = 10**9


def generate(seed: int, level: int, n: int) -> list[Item]:
    """``n`` items at ``level``; the same seed and level give the same items."""
    if level not in LEVELS:
        raise ValueError(f"level {level} is not one of {tuple(LEVELS)}")
    return [_item(random.Random(f"{FAMILY}:{seed}:{level}:{index}"), seed, level, index) for index in range(n)]


class _Books:
    """A ledger being written: running balances, and what each base transaction finally counts for."""

    def __init__(self, accounts: dict[str, int]):
        self.opening = dict(accounts)
        self.balance = dict(accounts)
        self.transactions: list[dict] = []
        self.effective: dict[str, int] = {}  # base transaction id -> amount after any correction
        self.refunded: set[str] = set()
        self.referenced: set[str] = set()

    def post(self, entry: dict) -> None:
        entry = {"id": f"T{len(self.transactions) + 1:02d}", **entry}
        self.transactions.append(entry)
        if entry["kind"] == "correction":
            original = self.find(entry["corrects"])
            self._move(original, entry["new_amount"] - entry["old_amount"])
            self.effective[original["id"]] = entry["new_amount"]
            self.referenced.add(original["id"])
            return
        self._move(entry, entry["amount"])
        if entry["kind"] == "refund":
            self.refunded.add(entry["refunds"])
            self.referenced.add(entry["refunds"])
        else:
            self.effective[entry["id"]] = entry["amount"]

    def _move(self, entry: dict, amount: int) -> None:
        if "from" in entry:
            self.balance[entry["from"]] -= amount
        if "to" in entry:
            self.balance[entry["to"]] += amount

    def find(self, transaction_id: str) -> dict:
        return next(t for t in self.transactions if t["id"] == transaction_id)

    def fees(self, account: str) -> int:
        return sum(self.effective[t["id"]] for t in self.transactions
                   if t["kind"] == "fee" and t["from"] == account and t["id"] not in self.refunded)

    def transferred(self, source: str, target: str) -> int:
        return sum(self.effective[t["id"]] for t in self.transactions if t["kind"] == "transfer"
                   and t["from"] == source and t["to"] == target and t["id"] not in self.refunded)


def _item(rng: random.Random, seed: int, level: int, index: int) -> Item:
    spec = LEVELS[level]
    while True:
        names = rng.sample(ACCOUNTS, spec.accounts)
        books = _Books({name: rng.randint(*spec.opening) for name in names})
        for _ in range(rng.randint(*spec.transactions)):
            _post_one(rng, books, spec)
        kinds = [t["kind"] for t in books.transactions]
        if not kinds or kinds.count("refund") < spec.refunds or kinds.count("correction") < spec.corrections:
            continue
        kind, accounts, answer = _question(rng, books, spec)
        if answer != 0 or rng.random() < 0.2:  # keep zero answers rare
            break
    if spec.facts_in_question:
        question = _level_one_question(books, accounts[0])
    else:
        code = rng.randint(10_000, 99_999)
        ask = QUESTION_TEMPLATES[kind].format(a=accounts[0], b=accounts[-1])
        question = f"Ledger {code} of {rng.choice(BUSINESSES)}: {ask}"
    world = {"accounts": books.opening, "transactions": books.transactions}
    return Item(family=FAMILY, level=level, seed=seed, index=index, question=question, answer=str(answer),
                world=world)


def _post_one(rng: random.Random, books: _Books, spec: Level) -> None:
    """Post one random transaction that keeps every balance at zero or above."""
    names = sorted(books.balance)
    options = list(BASE_KINDS)
    if spec.refunds:
        options.append("refund")
    if spec.corrections:
        options.append("correction")
    for _ in range(10):
        kind = rng.choice(options)
        if kind in ("refund", "correction"):
            entry = _reference(rng, books, kind)
        else:
            entry = _base(rng, books, kind, names, spec)
        if entry is not None:
            books.post(entry)
            return


def _base(rng: random.Random, books: _Books, kind: str, names: list[str], spec: Level) -> dict | None:
    source, target = rng.sample(names, 2)
    low, high = spec.fees if kind == "fee" else spec.amounts
    if kind == "deposit":
        return {"kind": kind, "amount": rng.randint(low, high), "to": target}
    high = min(high, books.balance[source] - 1)
    if high < low:
        return None
    amount = rng.randint(low, high)
    if kind == "transfer":
        return {"kind": kind, "amount": amount, "from": source, "to": target}
    return {"kind": kind, "amount": amount, "from": source}


def _reference(rng: random.Random, books: _Books, kind: str) -> dict | None:
    """A refund or a correction of an earlier transaction that nothing has referenced yet."""
    allowed = ("withdrawal", "transfer", "fee") if kind == "refund" else BASE_KINDS
    candidates = [t for t in books.transactions if t["kind"] in allowed and t["id"] not in books.referenced]
    if not candidates:
        return None
    original = rng.choice(candidates)
    if kind == "refund":
        entry = {"kind": "refund", "refunds": original["id"], "amount": original["amount"], "to": original["from"]}
        if original["kind"] == "transfer":
            entry["from"] = original["to"]
            if books.balance[original["to"]] < original["amount"]:
                return None
        return entry
    old = original["amount"]
    digits = str(old)
    swapped = int(digits[::-1]) if len(digits) > 1 and digits[-1] != "0" else old
    if swapped != old and rng.random() < 0.5:  # a typing slip: digits reversed
        new = swapped
    else:
        new = old + rng.choice((-1, 1)) * rng.randint(1, max(1, old // 3))
    if new <= 0 or new == old:
        return None
    delta = new - old
    if "from" in original and books.balance[original["from"]] < delta:
        return None
    if "to" in original and books.balance[original["to"]] < -delta:
        return None
    return {"kind": "correction", "corrects": original["id"], "old_amount": old, "new_amount": new}


def _touches(books: _Books, transaction: dict) -> set[str]:
    if transaction["kind"] == "correction":
        transaction = books.find(transaction["corrects"])
    return {transaction[key] for key in ("from", "to") if key in transaction}


def _question(rng: random.Random, books: _Books, spec: Level) -> tuple[str, list[str], int]:
    """A question kind, the accounts it names, and its answer; prefers accounts that refunds or corrections touch."""
    touched = sorted({a for t in books.transactions for a in _touches(books, t)})
    amended = sorted({a for t in books.transactions if t["kind"] in ("refund", "correction")
                      for a in _touches(books, t)})
    focus = amended or touched
    fee_payers = sorted({t["from"] for t in books.transactions if t["kind"] == "fee"})
    routes = sorted({(t["from"], t["to"]) for t in books.transactions if t["kind"] == "transfer"})
    feasible = [k for k in spec.questions if (k != "fees" or fee_payers) and (k != "transferred" or routes)
                and (k != "combined" or len(touched) >= 2)]
    kind = rng.choice(feasible)
    if kind == "closing":
        account = rng.choice(focus)
        return kind, [account], books.balance[account]
    if kind == "net_change":
        account = rng.choice(focus)
        return kind, [account], books.balance[account] - books.opening[account]
    if kind == "fees":
        account = rng.choice([a for a in fee_payers if a in focus] or fee_payers)
        return kind, [account], books.fees(account)
    if kind == "transferred":
        source, target = rng.choice([r for r in routes if set(r) & set(focus)] or routes)
        return kind, [source, target], books.transferred(source, target)
    first, second = rng.sample(touched, 2)
    return kind, [first, second], books.balance[first] + books.balance[second]


def _level_one_question(books: _Books, account: str) -> str:
    first, second = sorted(books.opening, key=lambda name: name != account)
    steps = [STATEMENTS[t["kind"]].format(**t) for t in books.transactions]
    story = steps[0] if len(steps) == 1 else f"{steps[0]}, and then {steps[1]}"
    return (f"{first} starts with {books.opening[first]} and {second} starts with {books.opening[second]}. "
            f"Then {story}. " + LEVEL_ONE_QUESTION.format(a=account))


# -- tools ---------------------------------------------------------------------------------------------------------
def _account(world: dict, name: str) -> str:
    if len(name) > MAX_ID_CHARS:
        raise ValueError(f"an account name has at most {MAX_ID_CHARS} characters")
    wanted = name.strip().casefold()
    for account in world["accounts"]:
        if account.casefold() == wanted:
            return account
    raise KeyError(f"no account named {name!r}; accounts: {', '.join(world['accounts'])}")


def _transaction(world: dict, transaction_id: str) -> dict:
    if len(transaction_id) > MAX_ID_CHARS:
        raise ValueError(f"a transaction id has at most {MAX_ID_CHARS} characters")
    wanted = transaction_id.strip().upper()
    for transaction in world["transactions"]:
        if transaction["id"] == wanted:
            return transaction
    raise KeyError(f"no transaction {transaction_id!r}; ids run from T01 to T{len(world['transactions']):02d}")


def _journal(world: dict) -> list:
    return world.setdefault("journal", [])


def list_accounts(world: dict) -> list[str]:
    """List the names of the ledger's accounts."""
    return list(world["accounts"])


def read_opening_balance(world: dict, account: str) -> int:
    """Read an account's opening balance: its balance before the first transaction in the ledger.

    Args:
        account: the account's name, such as "Cash"
    """
    return world["accounts"][_account(world, account)]


def list_transactions(world: dict, account: str = "", kind: Kind = "any") -> list[dict]:
    """List the ledger's transactions in order, optionally only those of one account or one kind.

    Args:
        account: only transactions that move money in or out of this account (corrections of them included); leave
            empty for every account
        kind: only transactions of this kind, or "any"
    """
    name = _account(world, account) if account.strip() else None
    chosen = []
    for transaction in world["transactions"]:
        if kind != "any" and transaction["kind"] != kind:
            continue
        moved = _transaction(world, transaction["corrects"]) if transaction["kind"] == "correction" else transaction
        if name is None or name in (moved.get("from"), moved.get("to")):
            chosen.append(transaction)
    return chosen


def get_transaction(world: dict, transaction_id: str) -> dict:
    """Read one transaction by its id.

    Args:
        transaction_id: the transaction's id, such as "T03"
    """
    return _transaction(world, transaction_id)


def post_entries(world: dict, amounts: list[int], memo: str = "") -> str:
    """Post signed amounts to your scratch journal (money in positive, money out negative) and get its new total.

    Args:
        amounts: the amounts to post, such as [120, -45, -3]
        memo: an optional note kept with the entries
    """
    if not amounts:
        raise ValueError("give at least one amount")
    if len(amounts) > MAX_BATCH:
        raise ValueError(f"post at most {MAX_BATCH} amounts at a time")
    if any(abs(amount) > MAX_AMOUNT for amount in amounts):
        raise ValueError(f"amounts must lie between -{MAX_AMOUNT} and {MAX_AMOUNT}")
    journal = _journal(world)
    if len(journal) + len(amounts) > MAX_JOURNAL:
        raise ValueError(f"the journal holds at most {MAX_JOURNAL} entries; call clear_journal")
    note = " ".join(memo.split())[:MAX_MEMO_CHARS]
    journal.extend([amount, note] for amount in amounts)
    posted = ", ".join(f"{amount:+d}" for amount in amounts)
    return f"posted {posted}; journal total {sum(a for a, _ in journal)} from {len(journal)} entries"


def read_journal(world: dict) -> str:
    """Read your scratch journal: its total, then every entry with its memo."""
    journal = _journal(world)
    lines = [f"{amount:+d} {note}".rstrip() for amount, note in journal]
    return f"journal total {sum(a for a, _ in journal)} from {len(journal)} entries" + "".join(
        f"\n{line}" for line in lines)


def clear_journal(world: dict) -> str:
    """Remove every entry from your scratch journal."""
    _journal(world).clear()
    return "journal cleared; total 0"


TOOLS = (list_accounts, read_opening_balance, list_transactions, get_transaction, post_entries, read_journal,
         clear_journal)


def bind_tools(world: dict) -> dict[str, Callable]:
    """The tools bound to a copy of ``world`` with an empty journal: call once per conversation."""
    session = {**world, "journal": []}
    return {fn.__name__: bind(fn, session) for fn in TOOLS}
