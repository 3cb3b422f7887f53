"""Bank: your accounts and other people's, transfers with a documented fee, insufficient funds."""

from __future__ import annotations

import random
from typing import Any

from envace.envs._common import Script, World, arg, lookup, money, next_id, ordered
from envace.envs.base import WORLDS, ToolError, tool
from envace.types import Task

FEES = {"external": {"max": 10, "min": 1, "percent": 1}, "internal": 0}
MINE = "me"
SPARE_ACCOUNTS = ("holiday", "bills", "car", "kids")
PEOPLE = ("Bob", "Ann", "Cy", "Dee", "Eve")


def transfer_fee(amount: float, external: bool) -> int | float:
    rule = FEES["external"]
    return money(min(max(amount * rule["percent"] / 100, rule["min"]), rule["max"])) if external else 0


@WORLDS.register("bank")
class Bank(World):
    name = "bank"
    description = (
        "Bank. Your accounts have ids A<n>; other people's accounts have ids E<n> and their balances are private "
        "(get_balance gives FORBIDDEN). list_accounts lists your accounts by id. A transfer between two of your "
        "accounts is free; to someone else's account it costs a fee of 1% of the amount, at least 1 and at most 10, "
        "taken from the source account on top of the amount. The source must be yours (FORBIDDEN), the two accounts "
        "must differ (SAME_ACCOUNT), and amount + fee must not exceed the source balance (INSUFFICIENT_FUNDS). "
        "Transfer ids are T<n>, numbered from 1; transfer returns the source balance after it. Amounts are rounded "
        "to cents. Transfers cannot be undone. Unknown ids give NOT_FOUND."
    )
    irreversible_tools = frozenset({"transfer"})

    def default_state(self) -> dict[str, Any]:
        return {"accounts": {}, "transfers": {}}

    def _own(self, account_id: str) -> dict[str, Any]:
        account = lookup(self.state["accounts"], account_id, "account")
        if account["owner"] != MINE:
            raise ToolError("FORBIDDEN", f"{account_id} belongs to {account['owner']}")
        return account

    @tool("List your accounts with their balances.")
    def list_accounts(self) -> dict[str, Any]:
        return {"accounts": [{"balance": a["balance"], "id": i, "name": a["name"]}
                             for i, a in ordered(self.state["accounts"]) if a["owner"] == MINE]}

    @tool("Balance of one of your accounts.", {"account_id": arg("string", "e.g. A1")}, ["account_id"])
    def get_balance(self, account_id: str) -> dict[str, Any]:
        return {"account_id": account_id, "balance": self._own(account_id)["balance"]}

    @tool("The transfer fee rules.")
    def get_fee_schedule(self) -> dict[str, Any]:
        return FEES

    @tool("Send money from one of your accounts to any account. Cannot be undone.",
          {"from_account": arg("string"), "to_account": arg("string"), "amount": arg("number", minimum=0.01)},
          ["from_account", "to_account", "amount"])
    def transfer(self, from_account: str, to_account: str, amount: float) -> dict[str, Any]:
        source = self._own(from_account)
        target = lookup(self.state["accounts"], to_account, "account")
        if from_account == to_account:
            raise ToolError("SAME_ACCOUNT", "source and target are the same account")
        amount = money(amount)
        fee = transfer_fee(amount, external=target["owner"] != MINE)
        if amount + fee > source["balance"]:
            raise ToolError("INSUFFICIENT_FUNDS", f"{from_account} has {source['balance']}; needs {money(amount + fee)}")
        source["balance"] = money(source["balance"] - amount - fee)
        target["balance"] = money(target["balance"] + amount)
        transfer_id = next_id(self.state["transfers"], "T")
        self.state["transfers"][transfer_id] = {"amount": amount, "fee": fee, "from": from_account, "to": to_account}
        return {"amount": amount, "balance": source["balance"], "fee": fee, "id": transfer_id}

    @classmethod
    def facts(cls, state: dict[str, Any]) -> str:
        accounts = ordered(state["accounts"])
        mine = ", ".join(f"{i} {a['name']} balance {a['balance']}" for i, a in accounts if a["owner"] == MINE)
        others = ", ".join(f"{i} {a['owner']}" for i, a in accounts if a["owner"] != MINE) or "none"
        return f"My accounts: {mine}. Other accounts: {others}. Transfers so far: {len(state['transfers'])}."


# ---- task families -------------------------------------------------------------------------

def _start(rng: random.Random, n_mine: int, n_others: int) -> dict[str, Any]:
    """Always a checking and a savings account; ids shuffled so names must be looked up."""
    names = ["checking", "savings", *rng.sample(SPARE_ACCOUNTS, n_mine - 2)]
    rng.shuffle(names)
    accounts = {f"A{i}": {"balance": rng.randrange(100, 3000, 10), "name": name, "owner": MINE}
                for i, name in enumerate(names, 1)}
    accounts.update({f"E{i}": {"balance": rng.randrange(0, 2000, 10), "name": who, "owner": who}
                     for i, who in enumerate(rng.sample(PEOPLE, n_others), 1)})
    return {"accounts": accounts, "transfers": {}}


def _mine(s: Script) -> dict[str, dict[str, Any]]:
    """Reference step: list_accounts, indexed by account name."""
    return {a["name"]: a for a in s("list_accounts")["accounts"]}


def _set_balance(state: dict[str, Any], name: str, balance: float) -> None:
    next(a for a in state["accounts"].values() if a["name"] == name and a["owner"] == MINE)["balance"] = balance


def pay(rng: random.Random, difficulty: int) -> Task:
    state = _start(rng, 1 + difficulty, difficulty + 1)
    others = [(i, a["owner"]) for i, a in ordered(state["accounts"]) if a["owner"] != MINE]
    payees = [(i, who, rng.randrange(20, 400, 5)) for i, who in others[:difficulty]]  # the last one is a distractor
    _set_balance(state, "checking", sum(amount for *_, amount in payees) + rng.randrange(50, 900, 10))
    s = Script(Bank, state)
    checking = _mine(s)["checking"]["id"]
    for account_id, _, amount in payees:
        last = s("transfer", from_account=checking, to_account=account_id, amount=amount)
    sends = " and ".join(f"{amount} to {who} (account {i})" for i, who, amount in payees)
    return s.task(f"From my checking account send {sends}. Then tell me the checking balance.",
                  check=("accounts",), answer=last["balance"],
                  checklist=(("Finds the id of the checking account", 1.0), ("Sends each payment once with the exact amount", 2.0)))


def top_up(rng: random.Random, difficulty: int) -> Task:
    state = _start(rng, 2 + difficulty, 1)
    target = rng.randrange(600, 1500, 100)
    names = ["checking", *sorted(a["name"] for a in state["accounts"].values() if a["name"] in SPARE_ACCOUNTS)][:difficulty]
    for name in names:
        _set_balance(state, name, rng.randrange(0, target - 50, 10))
    _set_balance(state, "savings", len(names) * target + rng.randrange(0, 2000, 10))
    s = Script(Bank, state)
    mine = _mine(s)
    for name in names:
        s("transfer", from_account=mine["savings"]["id"], to_account=mine[name]["id"], amount=target - mine[name]["balance"])
    which = f"{' and '.join(names)} accounts each hold" if len(names) > 1 else "checking account holds"
    return s.task(f"Move money from my savings so that my {which} exactly {target}.", check=("accounts",),
                  checklist=(("Reads the current balances before moving money", 1.0),
                             (f"Moves exactly {target} minus the balance into each named account", 2.0)))


def total(rng: random.Random, difficulty: int) -> Task:
    s = Script(Bank, _start(rng, 1 + difficulty, 1))
    balance = money(sum(a["balance"] for a in _mine(s).values()))
    return s.task("What is the total balance across all my accounts?", answer=balance,
                  checklist=(("Lists the accounts and adds up every balance", 1.0), ("Makes no transfer", 1.0)))


def rent(rng: random.Random, difficulty: int) -> Task:
    state = _start(rng, 1 + difficulty, 2)
    landlord, who = "E1", state["accounts"]["E1"]["owner"]
    amount = rng.randrange(500, 1500, 50)
    due = amount + transfer_fee(amount, external=True)
    _set_balance(state, "checking", due + rng.choice((-1, 1)) * rng.randrange(10, 300, 10))
    _set_balance(state, "savings", rng.randrange(400, 3000, 10))
    s = Script(Bank, state)
    mine = _mine(s)
    shortfall = money(due - mine["checking"]["balance"])
    if shortfall > 0:
        s("transfer", from_account=mine["savings"]["id"], to_account=mine["checking"]["id"], amount=shortfall)
    s("transfer", from_account=mine["checking"]["id"], to_account=landlord, amount=amount)
    return s.task(f"Pay my rent of {amount} to my landlord {who} (account {landlord}) from checking. If checking cannot "
                  "cover the rent plus the fee, first move exactly the missing amount from savings to checking.",
                  check=("accounts",),
                  checklist=(("Works out the fee (1%, min 1, max 10) and compares rent + fee with the checking balance", 2.0),
                             ("Tops up checking only by the exact shortfall, and only if needed", 2.0),
                             ("Pays the landlord exactly once", 1.0)))


Bank.families = (pay, top_up, total, rent)
