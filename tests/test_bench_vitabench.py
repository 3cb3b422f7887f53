"""VitaBench adapter on fixture tasks (tests/fixtures/vitabench, copied from the public MIT files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envace.benchmarks import BENCHMARKS
from envace.benchmarks.vitabench import DATA_ENV, STOP, VitaUserSimulator, default_data_dir, judge_windows, rubric_score, update_rubrics
from envace.types import EndReason, ToolCall, Trajectory

FIXTURES = Path(__file__).parent / "fixtures" / "vitabench"


@pytest.fixture(scope="module")
def bench():
    return BENCHMARKS.get("vitabench")(data_dir=FIXTURES)


@pytest.fixture(scope="module")
def tasks(bench):
    return {t.metadata["vita_id"]: t for t in bench.load_tasks()}


def run(bench, task, *calls: tuple[str, dict]) -> Trajectory:
    """Execute calls on a fresh world (as a real-mode rollout would) and return the trajectory."""
    world = bench.make_world(task)
    tool_calls = [ToolCall(name, args) for name, args in calls]
    observations = [world.execute(c) for c in tool_calls]
    return Trajectory(task_id=task.id, mode="real", tool_calls=tool_calls, observations=observations, final_answer="Done.")


def test_loads_fixture_tasks(bench, tasks):
    assert sorted(tasks) == ["10711001", "10826004", "G0721005"]
    assert [t.metadata["category"] for t in bench.load_tasks(categories=["instore"])] == ["instore"]
    delivery = tasks["10711001"]
    assert delivery.messages[0]["role"] == "system" and delivery.metadata["time"] in delivery.messages[0]["content"]
    names = {t["function"]["name"] for t in delivery.tools}
    assert {"create_delivery_order", "pay_delivery_order", "weather", "get_user_historical_behaviors"} <= names
    assert "instore_book" in {t["function"]["name"] for t in tasks["10826004"].tools}
    assert delivery.metadata["rubrics"] and delivery.rules.simulated_user
    assert bench.offline_status()["delivery"] == "ok" and "ota" in bench.offline_status()


def delivery_order(task, **change):
    order = {"user_id": "U000001", "store_id": "S85277471199200385_S98778", "product_ids": ["S26110520013660896_P88296"],
             "product_cnts": [1], "address": task.metadata["required_orders"][0]["location"]["address"], "dispatch_time": "2025-06-21 11:40:00"}
    return {**order, **change}


def test_proxy_accepts_the_required_order_and_rejects_a_wrong_one(bench, tasks):
    task = tasks["10711001"]
    right = run(bench, task, ("create_delivery_order", delivery_order(task)), ("pay_delivery_order", {"order_id": "10711001T01"}))
    assert right.observations[0]["order_id"] == "10711001T01" and right.observations[1]["status"] == "paid"
    score, details = bench.score(task, right)
    assert score == 1.0 and details["proxy"]["matched"] == 1

    wrong = run(bench, task, ("create_delivery_order", delivery_order(task, product_cnts=[2])), ("pay_delivery_order", {"order_id": "10711001T01"}))
    score, details = bench.score(task, wrong)
    assert score == 0.0 and details["proxy"]["missing"] and details["proxy"]["unexpected"]
    unpaid = run(bench, task, ("create_delivery_order", delivery_order(task)))
    assert bench.score(task, unpaid)[0] == 0.0


def test_proxy_with_existing_orders_and_in_store_visits(bench, tasks):
    task = tasks["G0721005"]  # pay the existing order and place the same one for a colleague
    existing = task.initial_state["orders"]["G0721005O01"]
    same = {"user_id": "U000035", "store_id": existing["store_id"], "product_ids": [p["product_id"] for p in existing["products"]],
            "product_cnts": [1], "address": existing["location"]["address"], "dispatch_time": "2025-11-19 11:30:00", "attributes": ["Mild Spicy"]}
    calls = [("pay_delivery_order", {"order_id": "G0721005O01"}), ("create_delivery_order", same), ("pay_delivery_order", {"order_id": "G0721005T01"})]
    traj = run(bench, task, *calls)
    assert bench.score(task, traj)[0] == 1.0

    task = tasks["10826004"]  # buy the body-shaping voucher, then a reservation moved to 17:30
    shop, user = "S17564420237542211_I00004", "U623530"
    calls = [("create_instore_product_order", {"user_id": user, "shop_id": shop, "product_id": "S17564420237542211_P00015"}),
             ("pay_instore_order", {"order_id": "10826004T001"}),
             ("instore_reservation", {"user_id": user, "shop_id": shop, "time": "2025-11-07 10:00:00"}),
             ("instore_modify_reservation", {"reservation_id": "10826004T002", "time": "2025-11-07 17:30:00", "customer_count": 1})]
    assert bench.score(task, run(bench, task, *calls))[0] == 1.0
    assert bench.score(task, run(bench, task, *calls[:3]))[0] == 0.0  # reservation left at 10:00
    # As in the benchmark, a modification without customer_count sets the count to 0.
    no_count = ("instore_modify_reservation", {"reservation_id": "10826004T002", "time": "2025-11-07 17:30:00"})
    assert bench.score(task, run(bench, task, *calls[:3], no_count))[0] == 0.0


def test_world_errors_are_observations(bench, tasks):
    task = tasks["10711001"]
    world = bench.make_world(task)
    assert world.call("create_delivery_order", delivery_order(task, dispatch_time="2025-06-21 09:00:00"))["error"]["code"] == "INVALID_TIME"
    assert world.call("create_delivery_order", delivery_order(task, store_id="nope"))["error"]["code"] == "NOT_FOUND"
    assert world.call("create_delivery_order", delivery_order(task, user_id="U9"))["error"]["code"] == "USER_MISMATCH"
    assert world.call("pay_delivery_order", {"order_id": "missing"})["error"]["code"] == "NOT_FOUND"
    assert world.call("weather", {"address": "Kunming", "date_start": "2025-06-21", "date_end": "2025-06-21"})["weather"][0]["category"] == "rainy"
    found = world.call("delivery_store_search_recommand", {"keywords": ["rice noodles"]})["stores"]
    assert found[0]["store_id"] == "S85277471199200385_S98778"


def judge_reply(met: dict[int, bool]) -> str:
    return "Verdicts:\n" + json.dumps([{"rubric_idx": f"rubric_{i}", "justification": "ok", "meetExpectation": m} for i, m in met.items()])


def test_rubric_judge(tasks):
    task = tasks["10711001"]
    n = len(task.metadata["rubrics"])
    prompts = []

    def judge(prompt: str) -> str:
        prompts.append(prompt)
        return judge_reply({i: True for i in range(n)})

    bench = BENCHMARKS.get("vitabench")(data_dir=FIXTURES, judge=judge)
    traj = run(bench, task, ("create_delivery_order", delivery_order(task)))
    score, details = bench.score(task, traj)
    assert score == 1.0 and details["metric"] == "rubric" and details["proxy_score"] == 0.0 and details["judge_calls"] == 1
    assert task.metadata["rubrics"][0] in prompts[0] and "create_delivery_order(" in prompts[0] and "window 1 of 1" in prompts[0]

    bench.judge = lambda prompt: judge_reply({i: i < n - 1 for i in range(n)})
    score, details = bench.score(task, traj)
    assert score == 0.0 and details["rubric_fraction"] == pytest.approx((n - 1) / n)
    cut = Trajectory(task_id=task.id, mode="real", tool_calls=traj.tool_calls, observations=traj.observations, end_reason=EndReason.MAX_TURNS)
    assert bench.score(task, cut) == (0.0, {"metric": "rubric", "premature_end": "max_turns"})  # unjudged, as VitaBench


def test_sliding_windows_carry_the_rubric_states(tasks):
    assert [(w.start, w.stop) for w in judge_windows(5)] == [(0, 5)]
    assert [(w.start, w.stop) for w in judge_windows(19)] == [(0, 10), (8, 18), (16, 19)]  # 10 per window, 2 overlapping
    task = tasks["10711001"]
    n = len(task.metadata["rubrics"])
    chat = [{"role": "user" if i % 2 else "assistant", "content": f"message {i}"} for i in range(19)]
    traj = Trajectory(task_id=task.id, mode="real", messages=chat)
    replies = iter([judge_reply({i: True for i in range(n)}),  # window 1: all met
                    "I cannot decide.",  # window 2: not JSON, nothing changes
                    judge_reply({0: False})])  # window 3: rubric 0 undone, the others left as they were
    prompts = []
    score, details = rubric_score(task, traj, lambda p: prompts.append(p) or next(replies))
    assert details["judge_calls"] == 3 and score == 0.0 and [r["met"] for r in details["rubrics"]] == [False] + [True] * (n - 1)
    assert "[9] assistant: message 8" in prompts[1] and "[19] assistant: message 18" in prompts[2] and "[8]" not in prompts[2]
    assert '"meetExpectation": true' in prompts[1]  # the states so far go into the next window
    assert update_rubrics("[]", [{"rubric_idx": "rubric_0", "justification": "j", "meetExpectation": True}])[0]["meetExpectation"]


def test_user_simulator_flips_roles_and_stops():
    seen = []
    replies = iter(["I want mild rice noodles delivered to my hospital.", f"Thanks! {STOP}"])

    def chat(messages):
        seen.append(messages)
        return next(replies)

    task = json.loads((FIXTURES / "delivery_tasks_en.json").read_text())[0]
    from envace.benchmarks.vitabench import to_task

    task = to_task(task, "delivery")
    sim = VitaUserSimulator(chat)
    first = sim.start(task)
    assert first.startswith("I want") and seen[0][0]["role"] == "system" and task.metadata["instructions"] in seen[0][0]["content"]
    chat_so_far = [*task.messages, {"role": "user", "content": first}, {"role": "assistant", "content": "call"},
                   {"role": "tool", "content": {}}, {"role": "assistant", "content": "Ordered. Anything else?"}]
    assert sim.respond(task, chat_so_far) is None
    roles = [m["role"] for m in seen[1][1:]]
    assert roles == ["user", "assistant", "user"]  # greeting, the user's own message, the agent's answer (tool turn hidden)


def test_data_dir_from_environment(monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(FIXTURES))
    assert default_data_dir() == FIXTURES
    assert len(BENCHMARKS.get("vitabench")().load_tasks(limit=1)) == 2  # one per domain


def test_calendar_tools(bench, tasks):
    world = bench.make_world(next(iter(tasks.values())))
    assert world.call("get_holiday_date", {"year": "2025", "holiday_name": "mid-autumn"}) == {"holiday": "Mid-Autumn Festival", "date": "2025-10-06"}
    assert world.call("get_holiday_date", {"year": "2025", "holiday_name": "Qixi"})["date"] == "2025-08-29"  # festival table
    assert world.call("get_date_holiday_info", {"date": "2024-10-01"}) == {"date": "2024-10-01", "holiday": "National Day"}  # statutory, any year
    assert world.call("get_date_holiday_info", {"date": "2025-06-03"}) == {"date": "2025-06-03", "holiday": None}
    for name, arguments, code in [("get_holiday_date", {"year": "2025", "holiday_name": "Halloween"}, "HOLIDAY_NOT_FOUND"),
                                  ("get_holiday_date", {"year": "2024", "holiday_name": "National Day"}, "HOLIDAY_NOT_FOUND"),  # not in the table
                                  ("get_holiday_date", {"year": "2026", "holiday_name": "National Day"}, "HOLIDAY_NOT_FOUND"),
                                  ("get_holiday_date", {"year": "25", "holiday_name": "National Day"}, "INVALID_YEAR"),
                                  ("get_date_holiday_info", {"date": "June 1"}, "INVALID_DATE")]:
        assert world.call(name, arguments)["error"]["code"] == code


def test_in_store_search_hides_the_target_labels_and_ranks_every_shop(bench, tasks):
    world = bench.make_world(tasks["10826004"])
    shops = world.call("instore_shop_search_recommend", {"keywords": ["Swimming Pool"]})["shops"]
    assert len(shops) == 4 and {s["shop_name"] for s in shops[:2]} <= {"Quanli Fitness Swimming Club", "Water Cube Swimming Pool", "Kangti Swimming Fitness Club"}
    products = world.call("instore_product_search_recommend", {"keywords": ["body shaping"]})["products"]
    leaked = {"shop_type", "product_type", "target_reason", "category"}
    assert not any(leaked & set(s) for s in shops) and not any(leaked & set(p) for p in products)
    assert "Body Shaping" in products[0]["name"]


def test_addresses_resolve_fuzzily_and_the_proxy_compares_places(bench, tasks):
    task = tasks["10711001"]
    full = task.metadata["required_orders"][0]["location"]["address"]
    short = "Yunnan University Affiliated Hospital, Wuhua District, Kunming"
    world = bench.make_world(task)
    assert world.call("address_to_longitude_latitude", {"address": short})["address"] == full
    assert world.call("address_to_longitude_latitude", {"address": "Eiffel Tower, Paris"})["error"]["code"] == "ADDRESS_NOT_FOUND"
    reworded = run(bench, task, ("create_delivery_order", delivery_order(task, address=short)), ("pay_delivery_order", {"order_id": "10711001T01"}))
    assert bench.score(task, reworded)[0] == 1.0  # the same place in other words


def test_cancellation_accepts_any_status_but_cancelled(bench, tasks):
    task = tasks["G0721005"]
    world = bench.make_world(task)
    world.state["orders"]["G0721005O01"]["status"] = "delivered"
    assert world.call("cancel_delivery_order", {"order_id": "G0721005O01"})["status"] == "cancelled"
    assert world.call("cancel_delivery_order", {"order_id": "G0721005O01"})["error"]["code"] == "INVALID_STATUS"


def test_the_required_orders_replayed_through_the_tools_pass_the_proxy(bench, tasks):
    from benchmarks.vitabench_oracle import replay

    for task in tasks.values():
        value, details, errors = replay(bench, task)
        assert value == 1.0 and not errors, (task.id, details, errors)
