"""Replay VitaBench's required orders through envace's VitaBench worlds and score them with the
proxy: how many public tasks can be solved through the tools at all (the rest contradict their own
databases). Prints the pass rate per domain and the reasons of the failures.

    python benchmarks/vitabench_oracle.py                      # the public tasks (../shared/data/vitabench)
    python benchmarks/vitabench_oracle.py --data-dir DIR --show 5
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from envace.benchmarks.vitabench import VitaBench, status_class, proxy_score
from envace.types import Task, ToolCall


def status_calls(kind: str, entry_id: str, status: str, current: str) -> list[ToolCall]:
    """Calls that take an entry from `current` to `status` as the proxy tells statuses apart:
    cancel for cancelled, pay for a committed status."""
    if status_class(status) == status_class(current):
        return []
    pay = {"order": "pay_delivery_order", "instore_order": "pay_instore_order", "book": "pay_instore_book"}
    cancel = {"order": "cancel_delivery_order", "instore_order": "instore_cancel_order", "book": "instore_cancel_book",
              "reservation": "instore_cancel_reservation"}
    key = {"order": "order_id", "instore_order": "order_id", "book": "book_id", "reservation": "reservation_id"}[kind]
    if status == "cancelled":
        return [ToolCall(cancel[kind], {key: entry_id})]
    return [ToolCall(pay[kind], {key: entry_id})] if kind in pay else []


def creation_call(entry: dict[str, Any], kind: str, user: str, now: str) -> list[ToolCall]:
    """The calls that create a required entry (an in-store order: one per package)."""
    if kind == "order":
        products = entry.get("products", [])
        return [ToolCall("create_delivery_order", {
            "user_id": user, "store_id": entry["store_id"], "product_ids": [p.get("product_id", "") for p in products],
            "product_cnts": [p.get("quantity", 1) for p in products], "address": (entry.get("location") or {}).get("address", ""),
            "dispatch_time": entry.get("dispatch_time") or now, "attributes": [p.get("attributes") or "" for p in products],
            "note": entry.get("note", "")})]
    if kind == "instore_order":
        return [ToolCall("create_instore_product_order", {"user_id": user, "shop_id": entry["store_id"], "product_id": p.get("product_id", ""),
                                                          "quantity": p.get("quantity", 1)}) for p in entry.get("products", [])]
    if kind == "book":
        return [ToolCall("instore_book", {"user_id": user, "shop_id": entry["shop_id"], "time": entry.get("book_time", ""),
                                          "customer_count": entry.get("customer_count", 1)})]
    return [ToolCall("instore_reservation", {"user_id": user, "shop_id": entry["shop_id"], "time": entry.get("reservation_time", ""),
                                             "customer_count": entry.get("customer_count", 1)})]


def replay(bench: VitaBench, task: Task) -> tuple[float, dict[str, Any], list[str]]:
    """Create (or, for entries the task starts with, update) every required entry through the
    tools, then score the world with the proxy. Returns the score, its details and the tool errors."""
    world = bench.make_world(task)
    initial = {k: e for c in ("orders", "books", "reservations") for k, e in task.initial_state.get(c, {}).items()}
    errors = []

    def execute(call: ToolCall) -> dict[str, Any]:
        observation = world.execute(call)
        if "error" in observation:
            errors.append(f"{call.name}: {observation['error']['code']}: {observation['error']['message'][:160]}")
        return observation

    for entry in task.metadata["required_orders"]:
        kind = "order" if entry.get("order_type") == "delivery" else "instore_order" if "order_id" in entry else "book" if "book_id" in entry else "reservation"
        key = "book_id" if kind == "book" else "reservation_id" if kind == "reservation" else "order_id"
        status = entry.get("status", "")
        if entry.get(key) in initial:
            for call in status_calls(kind, entry[key], status, current=initial[entry[key]]["status"]):
                execute(call)
            continue
        for call in creation_call(entry, kind, task.initial_state["user_id"], task.metadata["time"]):
            created = execute(call)
            if key in created:  # the id the world gave it; its status starts as the tool sets it
                for follow in status_calls(kind, created[key], status, current=created["status"]):
                    execute(follow)
    value, details = proxy_score(task, world.state)
    return value, details, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="VitaBench task folder (default: the public tasks)")
    parser.add_argument("--show", type=int, default=3, help="failures to print per domain")
    args = parser.parse_args()
    bench = VitaBench(data_dir=args.data_dir)
    tasks = bench.load_tasks()
    passed: Counter[str] = Counter()
    total: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    shown: Counter[str] = Counter()
    for task in tasks:
        domain = task.metadata["category"]
        value, details, errors = replay(bench, task)
        total[domain] += 1
        passed[domain] += value == 1.0
        if value < 1.0:
            reasons[errors[0].split(":")[0] + ": " + errors[0].split(":")[1].strip() if errors else "no tool error; proxy mismatch"] += 1
            if shown[domain] < args.show:
                shown[domain] += 1
                print(f"{task.metadata['vita_id']} ({domain}): {errors[:2] or details}")
    print("\n| domain | tasks | required orders reproduced through the tools |\n|---|---|---|")
    for domain in total:
        print(f"| {domain} | {total[domain]} | {passed[domain]} ({passed[domain] / total[domain]:.1%}) |")
    print(f"| all | {sum(total.values())} | {sum(passed.values())} ({sum(passed.values()) / sum(total.values()):.1%}) |")
    print("\nfirst failure per task:", dict(reasons.most_common()))


if __name__ == "__main__":
    main()
