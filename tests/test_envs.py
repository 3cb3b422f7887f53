"""Built-in worlds: hand-computed tool results, error observations, and generated tasks that
replay to 1.0 and fail when a required call or the answer is wrong."""

from __future__ import annotations

import dataclasses
import json

import pytest

from envace.backends.scripted import ScriptedGenerator, sequence_reply
from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS, WORLDS, get_world
from envace.envs.base import ToolError, ToolWorld, tool
from envace.envs.environment import WorldEnvironment
from envace.envs.tasks import builtin_tasks
from envace.registry import RegistryError
from envace.rewards import Context, compute_rewards
from envace.rollout import RolloutConfig, RolloutEngine
from envace.types import EndReason, Task

ALL_WORLDS = TRAIN_WORLDS + HELDOUT_WORLDS


def ok(world, name, **arguments):
    obs = world.call(name, arguments)
    assert "error" not in obs, obs
    return obs


def code(world, name, **arguments):
    return world.call(name, arguments)["error"]["code"]


def answer_for(task):
    return f"Done, the answer is {task.metadata['reference_answer']}." if "reference_answer" in task.metadata else "Done."


def keys_sorted(obj):
    if isinstance(obj, dict):
        return list(obj) == sorted(obj) and all(keys_sorted(v) for v in obj.values())
    return all(keys_sorted(v) for v in obj) if isinstance(obj, list) else True


def replay(task, calls):
    world = get_world(task.world)(task.initial_state)
    return world, [world.call(c["name"], c["arguments"]) for c in calls]


# ---- shop ----------------------------------------------------------------------------------

@pytest.fixture
def shop():
    return get_world("shop")({"products": {
        "P1": {"category": "kitchen", "name": "mug", "price": 12.5, "stock": 3},
        "P2": {"category": "home", "name": "lamp", "price": 30, "stock": 1},
        "P3": {"category": "kitchen", "name": "kettle", "price": 24, "stock": 2},
    }, "cart": {}, "coupon": None, "orders": {}})


def test_shop_tools(shop):
    assert [p["id"] for p in ok(shop, "search_products", query="KITCHEN")["products"]] == ["P1", "P3"]
    assert ok(shop, "get_product", product_id="P2") == {"category": "home", "id": "P2", "name": "lamp", "price": 30, "stock": 1}
    cart = ok(shop, "add_to_cart", product_id="P1", quantity=2)
    assert (cart["subtotal"], cart["discount"], cart["shipping"], cart["total"]) == (25, 0, 5, 30)
    assert ok(shop, "apply_coupon", code="FLAT5")["total"] == 25  # 25 - 5 + shipping 5
    cart = ok(shop, "add_to_cart", product_id="P2", quantity=1)
    assert (cart["subtotal"], cart["discount"], cart["shipping"], cart["total"]) == (55, 5, 0, 50)
    cart = ok(shop, "apply_coupon", code="SAVE10")  # 10% of 55 = 5.5; 49.5 < 50 so shipping comes back
    assert (cart["discount"], cart["shipping"], cart["total"]) == (5.5, 5, 54.5)
    assert list(cart) == sorted(cart) and ok(shop, "view_cart") == cart
    assert ok(shop, "checkout") == {"order_id": "O1", "total": 54.5}
    assert shop.state["orders"]["O1"] == {"coupon": "SAVE10", "items": {"P1": 2, "P2": 1}, "total": 54.5}
    assert (shop.state["products"]["P1"]["stock"], shop.state["products"]["P2"]["stock"]) == (1, 0)
    assert (shop.state["cart"], shop.state["coupon"]) == ({}, None)


def test_shop_errors(shop):
    assert code(shop, "add_to_cart", product_id="P2", quantity=2) == "OUT_OF_STOCK"
    assert code(shop, "add_to_cart", product_id="P9", quantity=1) == "NOT_FOUND"
    assert code(shop, "add_to_cart", product_id="P1", quantity=0) == "INVALID_ARGUMENTS"
    assert code(shop, "apply_coupon", code="FLAT5") == "COUPON_NOT_APPLICABLE"
    assert code(shop, "apply_coupon", code="BOGUS") == "INVALID_COUPON"
    assert code(shop, "checkout") == "EMPTY_CART"
    assert shop.state["orders"] == {} and shop.state["cart"] == {}


# ---- bank ----------------------------------------------------------------------------------

@pytest.fixture
def bank():
    return get_world("bank")({"accounts": {
        "A1": {"balance": 1000, "name": "checking", "owner": "me"},
        "A2": {"balance": 500, "name": "savings", "owner": "me"},
        "E1": {"balance": 0, "name": "Bob", "owner": "Bob"},
    }, "transfers": {}})


def test_bank_tools(bank):
    assert ok(bank, "list_accounts") == {"accounts": [{"balance": 1000, "id": "A1", "name": "checking"},
                                                      {"balance": 500, "id": "A2", "name": "savings"}]}
    assert ok(bank, "get_fee_schedule")["external"] == {"max": 10, "min": 1, "percent": 1}
    assert ok(bank, "transfer", from_account="A1", to_account="E1", amount=100) == {"amount": 100, "balance": 899, "fee": 1, "id": "T1"}
    assert ok(bank, "transfer", from_account="A1", to_account="E1", amount=250)["balance"] == 646.5  # fee 2.5
    assert ok(bank, "transfer", from_account="A2", to_account="E1", amount=50)["fee"] == 1  # 0.5 -> minimum 1
    assert ok(bank, "transfer", from_account="A2", to_account="A1", amount=100)["fee"] == 0  # own accounts: free
    assert ok(bank, "transfer", from_account="A1", to_account="E1", amount=700)["fee"] == 7
    assert ok(bank, "get_balance", account_id="A1") == {"account_id": "A1", "balance": 39.5}  # 646.5 + 100 - 707
    assert bank.state["accounts"]["E1"]["balance"] == 1100
    assert list(bank.state["transfers"]) == ["T1", "T2", "T3", "T4", "T5"]
    bank.state["accounts"]["A2"]["balance"] = 2000
    assert ok(bank, "transfer", from_account="A2", to_account="E1", amount=1500)["fee"] == 10  # 15 -> maximum 10


def test_bank_errors(bank):
    assert code(bank, "transfer", from_account="A2", to_account="E1", amount=496) == "INSUFFICIENT_FUNDS"  # 496 + 4.96 > 500
    assert ok(bank, "transfer", from_account="A2", to_account="E1", amount=495)["balance"] == 0.05
    assert code(bank, "transfer", from_account="E1", to_account="A1", amount=5) == "FORBIDDEN"
    assert code(bank, "get_balance", account_id="E1") == "FORBIDDEN"
    assert code(bank, "transfer", from_account="A1", to_account="A1", amount=5) == "SAME_ACCOUNT"
    assert code(bank, "transfer", from_account="A1", to_account="A9", amount=5) == "NOT_FOUND"
    assert code(bank, "transfer", from_account="A1", to_account="E1", amount=0) == "INVALID_ARGUMENTS"


# ---- files ---------------------------------------------------------------------------------

@pytest.fixture
def files():
    return get_world("files")({"files": {"/docs/plan": "ship v2 on friday", "/docs/notes": "DRAFT ideas", "/tmp/x": "DRAFT"}})


def test_files_tools(files):
    assert ok(files, "list_dir", path="/") == {"entries": ["docs/", "tmp/"], "path": "/"}
    assert ok(files, "list_dir", path="/docs/") == {"entries": ["notes", "plan"], "path": "/docs"}
    assert ok(files, "read_file", path="/docs/plan") == {"content": "ship v2 on friday", "path": "/docs/plan"}
    assert ok(files, "search", text="DRAFT") == {"paths": ["/docs/notes", "/tmp/x"]}
    assert ok(files, "search", text="draft") == {"paths": []}
    assert ok(files, "write_file", path="/tmp/y", content="hello") == {"path": "/tmp/y", "size": 5}
    assert ok(files, "move", source="/docs/plan", destination="/archive/plan") == {"destination": "/archive/plan", "source": "/docs/plan"}
    assert ok(files, "delete_file", path="/tmp/x") == {"deleted": "/tmp/x"}
    assert files.state["files"] == {"/archive/plan": "ship v2 on friday", "/docs/notes": "DRAFT ideas", "/tmp/y": "hello"}


def test_files_errors(files):
    assert code(files, "list_dir", path="/nope") == "NOT_FOUND"
    assert code(files, "list_dir", path="docs") == "INVALID_PATH"
    assert code(files, "read_file", path="/docs/none") == "NOT_FOUND"
    assert code(files, "write_file", path="/docs/", content="x") == "INVALID_PATH"
    assert code(files, "move", source="/tmp/x", destination="/docs/plan") == "EXISTS"
    assert code(files, "move", source="/tmp/none", destination="/tmp/z") == "NOT_FOUND"
    assert code(files, "delete_file", path="/tmp/none") == "NOT_FOUND"
    assert len(files.state["files"]) == 3


# ---- calendar ------------------------------------------------------------------------------

@pytest.fixture
def calendar():
    return get_world("calendar")({"events": {
        "E1": {"day": "mon", "end": 10, "start": 9, "status": "active", "title": "standup"},
        "E2": {"day": "mon", "end": 13, "start": 11, "status": "active", "title": "review"},
        "E3": {"day": "tue", "end": 10, "start": 9, "status": "cancelled", "title": "gym"},
    }})


def test_calendar_tools(calendar):
    assert [e["id"] for e in ok(calendar, "list_events", day="mon")["events"]] == ["E1", "E2"]
    assert ok(calendar, "list_events", day="tue") == {"day": "tue", "events": []}  # cancelled events are not listed
    assert ok(calendar, "find_free_slot", day="mon", duration=1) == {"day": "mon", "end": 11, "start": 10}
    assert ok(calendar, "find_free_slot", day="mon", duration=2) == {"day": "mon", "end": 15, "start": 13}
    assert ok(calendar, "find_free_slot", day="tue", duration=9)["start"] == 9
    assert ok(calendar, "create_event", title="demo", day="mon", start=13, end=14) == {"day": "mon", "end": 14, "id": "E4", "start": 13, "title": "demo"}
    assert ok(calendar, "move_event", event_id="E1", day="mon", start=10)["end"] == 11  # may overlap its old slot
    assert ok(calendar, "move_event", event_id="E2", day="tue", start=9) == {"day": "tue", "end": 11, "id": "E2", "start": 9, "title": "review"}
    assert ok(calendar, "cancel_event", event_id="E1") == {"cancelled": "E1"}
    assert calendar.state["events"]["E1"]["status"] == "cancelled"


def test_calendar_errors(calendar):
    assert code(calendar, "create_event", title="demo", day="mon", start=12, end=14) == "CONFLICT"
    assert "E2" in calendar.call("create_event", {"title": "d", "day": "mon", "start": 12, "end": 14})["error"]["message"]
    assert code(calendar, "create_event", title="demo", day="mon", start=17, end=19) == "INVALID_TIME"
    assert code(calendar, "create_event", title="demo", day="mon", start=15, end=15) == "INVALID_TIME"
    assert code(calendar, "create_event", title="demo", day="sat", start=9, end=10) == "INVALID_ARGUMENTS"
    assert code(calendar, "find_free_slot", day="mon", duration=9) == "NO_SLOT"
    assert code(calendar, "move_event", event_id="E1", day="mon", start=12) == "CONFLICT"
    assert code(calendar, "move_event", event_id="E3", day="wed", start=9) == "CANCELLED"
    assert code(calendar, "cancel_event", event_id="E3") == "CANCELLED"
    assert code(calendar, "cancel_event", event_id="E9") == "NOT_FOUND"


# ---- travel --------------------------------------------------------------------------------

@pytest.fixture
def travel():
    route = {"destination": "LON", "origin": "NYC", "day": "mon"}
    return get_world("travel")({"flights": {
        "F100": {**route, "depart": 9, "price": 245, "seats": 1},
        "F200": {**route, "depart": 7, "price": 300, "seats": 0},
        "F300": {"destination": "NYC", "origin": "LON", "day": "mon", "depart": 10, "price": 250, "seats": 3},
    }, "bookings": {}})


def test_travel_tools(travel):
    assert ok(travel, "search_flights", origin="NYC", destination="LON", day="mon") == {"flights": [
        {"depart": 7, "id": "F200", "price": 300, "seats": 0}, {"depart": 9, "id": "F100", "price": 245, "seats": 1}]}
    assert ok(travel, "get_flight", flight_id="F300")["origin"] == "LON"
    assert ok(travel, "book_flight", flight_id="F100", passenger="Ana") == {"booking_id": "B1", "flight_id": "F100", "passenger": "Ana", "price": 245}
    assert travel.state["flights"]["F100"]["seats"] == 0
    assert ok(travel, "cancel_booking", booking_id="B1") == {"booking_id": "B1", "refund": 196}  # 80% of 245
    assert travel.state["flights"]["F100"]["seats"] == 1
    assert ok(travel, "book_flight", flight_id="F100", passenger="Bo")["booking_id"] == "B2"  # cancelled B1 keeps its id
    assert [b["status"] for b in ok(travel, "list_bookings")["bookings"]] == ["cancelled", "booked"]


def test_travel_errors(travel):
    assert code(travel, "book_flight", flight_id="F200", passenger="Ana") == "NO_SEATS"
    assert code(travel, "book_flight", flight_id="F999", passenger="Ana") == "NOT_FOUND"
    assert code(travel, "search_flights", origin="NYC", destination="LON", day="someday") == "INVALID_ARGUMENTS"
    ok(travel, "book_flight", flight_id="F100", passenger="Ana")
    ok(travel, "cancel_booking", booking_id="B1")
    assert code(travel, "cancel_booking", booking_id="B1") == "CANCELLED"
    assert code(travel, "cancel_booking", booking_id="B7") == "NOT_FOUND"


# ---- every world, every tool ---------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_WORLDS)
def test_bad_calls_become_error_observations(name):
    cls = get_world(name)
    world = cls()
    assert world.call("nope", {})["error"]["code"] == "TOOL_NOT_FOUND"
    assert cls.irreversible_tools and cls.irreversible_tools <= set(cls.tool_names())
    assert cls.description and name in WORLDS
    for schema in cls.tool_schemas():
        fn = schema["function"]
        params = fn["parameters"]["properties"]
        if fn["parameters"]["required"]:
            assert code(world, fn["name"]) == "INVALID_ARGUMENTS", fn["name"]  # missing argument
        for prop in params:
            assert world.call(fn["name"], {prop: ["wrong", "type"]})["error"]["code"] == "INVALID_ARGUMENTS"
        assert world.call(fn["name"], {"unexpected": 1})["error"]["code"] == "INVALID_ARGUMENTS"
        assert world.call(fn["name"], "not an object")["error"]["code"] == "INVALID_ARGUMENTS"
    assert world.state == cls().state  # no bad call changed anything


# ---- generated tasks -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def generated():
    return {name: [t for d in (1, 2, 3) for t in get_world(name).generate_tasks(4, "train", seed=7, difficulty=d)]
            for name in ALL_WORLDS}


@pytest.mark.parametrize("name", ALL_WORLDS)
def test_reference_solutions_score_one_and_broken_ones_zero(name, generated):
    for task in generated[name]:
        world, observations = replay(task, task.reference_calls)
        assert all("error" not in o for o in observations), (task.id, observations)
        assert keys_sorted(observations), task.id  # one textual form per response
        assert world.verify(task, answer_for(task)).success, task.id
        if "answer" in task.success:
            assert world.verify(task, "I could not find it.").success is False, task.id
        states = [task.initial_state] + [None] * len(task.reference_calls)
        probe = get_world(name)(task.initial_state)
        for i, call in enumerate(task.reference_calls, 1):
            probe.call(call["name"], call["arguments"])
            states[i] = probe.snapshot()
        changed = [i for i in range(1, len(states)) if states[i] != states[i - 1]]
        if changed:  # drop the last call that changed the state
            broken, _ = replay(task, task.reference_calls[: changed[-1] - 1] + task.reference_calls[changed[-1]:])
            assert broken.verify(task, answer_for(task)).success is False, task.id


@pytest.mark.parametrize("name, family, tool, key, wrong", [
    ("bank", "pay", "transfer", "amount", lambda v: v + 5),
    ("shop", "buy", "add_to_cart", "quantity", lambda v: v + 1),
    ("calendar", "cancel", "cancel_event", "event_id", lambda v: "E2" if v == "E1" else "E1"),
    ("travel", "cheapest", "book_flight", "passenger", lambda v: v + "a"),
])
def test_one_wrong_argument_scores_zero(name, family, tool, key, wrong):
    tasks = [t for t in get_world(name).generate_tasks(40, "train", seed=1, difficulty=2) if t.metadata["family"] == family]
    for task in tasks[:3]:
        calls = json.loads(json.dumps(task.reference_calls))
        target = [c for c in calls if c["name"] == tool][-1]["arguments"]
        target[key] = wrong(target[key])
        world, _ = replay(task, calls)
        assert world.verify(task, answer_for(task)).success is False, task.id


@pytest.mark.parametrize("name", ALL_WORLDS)
def test_task_shape(name):
    cls = get_world(name)
    tasks = [t for d in (1, 2, 3) for t in cls.generate_tasks(12, "train", seed=5, difficulty=d)]
    assert {t.metadata["family"] for t in tasks} == {f.__name__ for f in cls.families}
    assert [t.hidden_state for t in tasks[:8]] == [False, False, False, True] * 2  # every 4th task
    for task in tasks:
        (message,) = task.messages
        assert message["role"] == "user"
        facts = cls.facts(task.initial_state)
        assert message["content"].startswith(facts) != task.hidden_state
        assert ("answer" in task.success) == ("reference_answer" in task.metadata)
        assert task.checklist and all(c["weight"] > 0 for c in task.checklist)
        prompt = cls.description + json.dumps(cls.tool_schemas()) + message["content"]
        assert len(prompt) < 5000, (task.id, len(prompt))  # ~1500 tokens for a small model
        json.dumps(dataclasses.asdict(task))
    calls = {d: [len(t.reference_calls) for t in tasks if t.difficulty == d] for d in (1, 2, 3)}
    assert min(calls[1]) >= 1 and sum(calls[3]) > sum(calls[1])


def test_generation_is_deterministic():
    for name in ALL_WORLDS:
        cls = get_world(name)
        first = [dataclasses.asdict(t) for t in cls.generate_tasks(6, "train", seed=3, difficulty=2)]
        assert first == [dataclasses.asdict(t) for t in cls.generate_tasks(6, "train", seed=3, difficulty=2)]
        assert first != [dataclasses.asdict(t) for t in cls.generate_tasks(6, "train", seed=4, difficulty=2)]


def test_long_tasks_exist():
    longest = max(len(t.reference_calls) for name in TRAIN_WORLDS for t in get_world(name).generate_tasks(12, "train", 0, 3))
    assert longest >= 6


# ---- user worlds ---------------------------------------------------------------------------

def test_custom_world_by_module_path():
    spec = "tests.fixtures_worlds:Library"
    cls = get_world(spec)
    assert cls.__name__ == "Library"
    tasks = builtin_tasks("train", 3, worlds=[spec])
    assert [t.world for t in tasks] == [spec] * 3
    for task in tasks:
        world, _ = replay(task, task.reference_calls)
        assert world.verify(task, None).success
    with pytest.raises(RegistryError, match="not a ToolWorld"):
        get_world("tests.fixtures_worlds:TITLES")
    with pytest.raises(RegistryError, match="no attribute"):
        get_world("tests.fixtures_worlds:Missing")
    with pytest.raises(RegistryError, match="unknown environment"):
        get_world("nosuchworld")


class Shelf(ToolWorld):
    """A user world whose default state holds books, and whose tool has a bug: an unknown title
    raises KeyError instead of a ToolError."""

    name = "shelf"
    description = "A shelf of books. borrow(title) takes a book that is in."

    def default_state(self):
        return {"books": {"Dune": "in", "Emma": "in"}}

    @tool("Borrow a book.", {"title": {"type": "string"}}, ["title"])
    def borrow(self, title):
        if self.state["books"][title] != "in":
            raise ToolError("UNAVAILABLE", f"{title} is out")
        self.state["books"][title] = "out"
        return {"borrowed": title}


SHELF = "tests.test_envs:Shelf"
SHELF_DEFAULT = {"books": {"Dune": "in", "Emma": "in"}}
UNKNOWN_TITLE_ERROR = {"error": {"code": "TOOL_EXCEPTION", "message": "borrow raised KeyError: 'Ulysses'"}}


def shelf_task(**kw):
    return Task(id="shelf-0", world=SHELF, messages=[{"role": "user", "content": "Borrow Ulysses, or Dune if there is none."}], **kw)


def test_task_without_initial_state_starts_from_the_world_default():
    assert shelf_task().initial_state == {}  # what a task line without the key loads as
    assert WorldEnvironment().make_world(shelf_task()).state == SHELF_DEFAULT
    own = {"books": {"Ulysses": "out"}}
    assert WorldEnvironment().make_world(shelf_task(initial_state=own)).state == own  # replaced, not merged
    world = Shelf(own)
    world.reset({})
    assert world.state == SHELF_DEFAULT


def test_unexpected_tool_exception_is_an_error_observation_logged_and_counted(caplog):
    world = Shelf()
    with caplog.at_level("WARNING", logger="envace.envs.base"):
        assert world.call("borrow", {"title": "Ulysses"}) == UNKNOWN_TITLE_ERROR
    [record] = caplog.records
    assert "'borrow'" in record.getMessage() and "Shelf" in record.getMessage()
    assert record.levelname == "WARNING" and record.exc_info[0] is KeyError  # the traceback is logged
    assert world.tool_exceptions == 1
    ok(world, "borrow", title="Dune")
    assert code(world, "borrow", title="Dune") == "UNAVAILABLE"  # a ToolError keeps its own code...
    assert world.tool_exceptions == 1 and len(caplog.records) == 1  # ...and is neither counted nor logged

    def interrupted(title):
        raise KeyboardInterrupt

    world.borrow = interrupted
    with pytest.raises(KeyboardInterrupt):  # stopping a run by hand must still stop it
        world.call("borrow", {"title": "Emma"})


def test_rollout_and_replay_reward_go_on_past_a_tool_exception(tokenizer, caplog):
    """Real mode: the KeyError is the first call's observation, ACT goes on to borrow Dune; the
    replay reward replays both calls on a fresh world and scores the task."""
    task = shelf_task(success={"state": [{"path": "books.Dune", "equals": "out"}]})
    replies = ['<tool_call>{"name": "borrow", "arguments": {"title": "Ulysses"}}</tool_call>',
               '<tool_call>{"name": "borrow", "arguments": {"title": "Dune"}}</tool_call>', "I borrowed Dune."]
    engine = RolloutEngine(ScriptedGenerator(tokenizer, sequence_reply(replies)), WorldEnvironment(), RolloutConfig(mode="real"))
    with caplog.at_level("WARNING", logger="envace.envs.base"):
        [[traj]] = engine.run([task], progress=False)
        compute_rewards("replay", [[traj]], [task], Context(env=WorldEnvironment()))
    assert traj.end_reason == EndReason.ANSWERED and traj.final_answer == "I borrowed Dune."
    assert traj.observations == [UNKNOWN_TITLE_ERROR, {"borrowed": "Dune"}] and traj.real_env_calls == 2
    assert traj.reward == 1.0 and traj.real_observations == traj.observations
    assert len(caplog.records) == 2  # once in the rollout, once in the replay


# ---- world-free tasks ----------------------------------------------------------------------

def world_free_counter_task(**kw):
    from tests.worlds import Counter

    return Task(id="free-1", world=None, messages=[{"role": "user", "content": "Add 5 to the counter and tell me the value."}],
                tools=Counter.tool_schemas(), documentation="Counter rules: add(n) returns the new value.",
                reference_calls=[{"name": "add", "arguments": {"n": 5}}], **kw)


def test_a_world_free_task_is_described_by_itself_and_has_no_world():
    from envace.envs.base import NoWorldError

    env, task = WorldEnvironment(), world_free_counter_task()
    assert env.describe(task) == ("Counter rules: add(n) returns the new value.", task.tools)
    assert env.describe(dataclasses.replace(task, documentation=None)) == ("", task.tools)
    with pytest.raises(NoWorldError, match=r"world-free task free-1 has no executable world: roll it out with --mode rehearse") as info:
        env.make_world(task)
    assert isinstance(info.value, ValueError) and "judge, reference" in str(info.value)


def test_a_tasks_documentation_replaces_its_worlds_description():
    env, bank = WorldEnvironment(), get_world("bank")
    task = Task(id="b", world="bank", messages=[])
    assert env.describe(task) == (bank.description, bank.tool_schemas())
    assert env.describe(dataclasses.replace(task, documentation="Be brief.")) == ("Be brief.", bank.tool_schemas())


def test_rehearse_mode_and_the_reference_reward_never_need_a_world(tokenizer):
    """A world-free task rolls out in rehearse mode and is scored by the reference reward; the
    fidelity replay after it is skipped (there is no world to replay on)."""
    from tests.test_rollout import agent

    task = world_free_counter_task()
    engine = RolloutEngine(ScriptedGenerator(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode="rehearse"))
    [[traj]] = engine.run([task], progress=False)
    compute_rewards("reference", [[traj]], [task], Context(env=WorldEnvironment()))
    assert traj.end_reason == EndReason.ANSWERED and traj.observations == [{"value": 5}] and traj.real_env_calls == 0
    assert traj.reward == 1.0 and traj.real_observations is None
    assert "Counter rules: add(n) returns the new value." in tokenizer.decode(traj.token_ids)  # the task's documentation is the system prompt


def test_export_no_world_records_each_reference_call_executed_once(tmp_path, capsys):
    from envace.envs.export import ExportConfig, export_tasks
    from envace.envs.tasks import load_tasks, scenario_key
    from envace.references import recorded_exchanges

    output = tmp_path / "free.jsonl"
    provenance = export_tasks(ExportConfig(output=str(output), worlds=["bank", "shop"], n_per_world=2, world=False))
    originals = builtin_tasks("train", 2, worlds=["bank", "shop"])  # what the export's defaults draw
    exported = load_tasks(output)
    assert [t.id for t in exported] == [t.id for t in originals]
    for free, task in zip(exported, originals):
        cls = get_world(task.world)
        assert free.world is None and free.success == {} and free.initial_state == {}
        assert free.tools == cls.tool_schemas() and free.documentation == cls.description
        assert free.reference_calls == task.reference_calls and free.checklist == task.checklist and free.messages == task.messages
        assert free.metadata == {**task.metadata, "exported_from": task.world, "source_scenario": scenario_key(task)}
        _, real = replay(task, task.reference_calls)  # a fresh world of the task, the calls in order
        assert [response for _, response in recorded_exchanges(free.reference)] == real
        assert free.reference[-1] == {"role": "assistant", "content": task.metadata["reference_answer"]}
    executions = sum(len(t.reference_calls) for t in originals)
    assert executions > len(originals)  # some task makes more than one call
    assert provenance == {"tasks": 4, "world_executions": executions, "source": "builtin:train seed=0 difficulty=mixed worlds=bank,shop"}
    assert json.loads((tmp_path / "free.jsonl.export.json").read_text()) == provenance
    assert f"exported 4 tasks; {executions} tool executions at export time" in capsys.readouterr().out


def test_tasks_command_no_world_flag(tmp_path):
    from envace.cli import main
    from envace.envs.tasks import load_tasks

    assert main(["tasks", "--no-world", "--worlds", "files", "--n-per-world", "1", "--output", str(tmp_path / "f.jsonl")]) == 0
    assert [t.world for t in load_tasks(tmp_path / "f.jsonl")] == [None]
    assert (tmp_path / "f.jsonl.export.json").exists()
    # Overwritten with world tasks, the file no longer has a recording's cost: the sidecar goes.
    assert main(["tasks", "--worlds", "files", "--n-per-world", "1", "--output", str(tmp_path / "f.jsonl")]) == 0
    assert [t.world for t in load_tasks(tmp_path / "f.jsonl")] == ["files"] and not (tmp_path / "f.jsonl.export.json").exists()


def test_a_checkpoint_trained_on_exported_world_free_tasks_refuses_their_world_tasks(tmp_path):
    """Leakage through the export: the manifest keeps the source scenario of a world-free task."""
    from envace.envs.export import world_free_tasks
    from envace.envs.tasks import builtin_tasks
    from envace.manifest import build_manifest, overlap, write_manifest

    train = builtin_tasks("train", 3, worlds=["bank"], difficulty=1)
    free, _ = world_free_tasks(train)
    write_manifest(build_manifest(free, None), tmp_path)
    renamed = [dataclasses.replace(t, id=f"renamed-{i}") for i, t in enumerate(train)]
    assert overlap(tmp_path, renamed) == [t.id for t in renamed]  # caught by scenario, not by id
    assert overlap(tmp_path, builtin_tasks("test", 3, worlds=["bank"], difficulty=1)) == []


# ---- the verifier: partial credit, side-effect guards, the answer caps ------------------------

from envace.envs.base import check_success  # noqa: E402

START = {"accounts": {"A1": {"balance": 100}, "A2": {"balance": 40}, "E1": {"balance": 0}}, "transfers": {}}
SPEC = {"state": [{"path": "accounts.A1.balance", "equals": 50, "weight": 2},  # goal: 100 -> 50
                  {"path": "accounts.E1.balance", "equals": 50},              # goal: 0 -> 50
                  {"path": "accounts.A2.balance", "equals": 40},              # guard: it already held 40
                  {"path": "transfers", "unchanged": True}],                  # guard
        "answer": {"number": 50, "tol": 0.01}}                                # goal, weight 1


def with_balances(a1, e1, a2=40, transfers=None):
    return {"accounts": {"A1": {"balance": a1}, "A2": {"balance": a2}, "E1": {"balance": e1}}, "transfers": transfers or {}}


@pytest.mark.parametrize("state, answer, success, partial", [
    (with_balances(50, 50), "50", True, 1.0),
    (with_balances(50, 50), "I do not know", False, 3 / 4),      # goals A1 (2) + E1 (1) of 4
    (with_balances(50, 0), "50", False, 3 / 4),                  # A1 (2) + answer (1)
    (with_balances(100, 50), "nothing", False, 1 / 4),           # E1 only
    (START, "nothing", False, 0.0),                              # doing nothing earns nothing: guards give no credit
    (with_balances(50, 50, a2=30), "50", False, 0.0),            # a side effect: A2 touched
    (with_balances(50, 50, transfers={"T1": {}}), "50", False, 0.0),
])
def test_partial_credit_hand_computed(state, answer, success, partial):
    verdict = check_success(SPEC, state, answer, START)
    assert verdict.success is success
    assert verdict.partial == pytest.approx(partial)
    assert [c.guard for c in verdict.checks] == [False, False, True, True, False]


def test_a_spec_of_guards_only_scores_one_when_they_hold():
    spec = {"state": [{"path": "transfers", "unchanged": True}, {"path": "files./tmp/x", "absent": True}]}
    assert check_success(spec, START, None, START).partial == 1.0
    assert check_success(spec, {**START, "transfers": {"T1": {}}}, None, START).partial == 0.0


def test_unchanged_needs_the_initial_state():
    with pytest.raises(ValueError, match="initial state"):
        check_success({"state": [{"path": "transfers", "unchanged": True}]}, START, None)


def answer_only_task(name, family, difficulty=1):
    return next(t for t in get_world(name).generate_tasks(40, "train", seed=2, difficulty=difficulty) if t.metadata["family"] == family)


@pytest.mark.parametrize("name, family", [("bank", "total"), ("travel", "seats_left"), ("files", "lookup_setting"), ("calendar", "hours")])
def test_answer_only_tasks_fail_on_a_side_effect(name, family):
    """Tasks graded on the answer also assert that the world is as the task found it."""
    task = answer_only_task(name, family)
    effects = {"bank": lambda w: w.call("transfer", {"from_account": next(i for i, a in w.state["accounts"].items() if a["owner"] == "me"),
                                                   "to_account": "E1", "amount": 1}),
               "travel": lambda w: w.call("book_flight", {"flight_id": sorted(w.state["flights"])[0], "passenger": "Zed"}),
               "files": lambda w: w.call("write_file", {"path": "/notes/x", "content": "y"}),
               "calendar": lambda w: w.call("cancel_event", {"event_id": sorted(w.state["events"])[0]})}
    world, _ = replay(task, task.reference_calls)
    clean = world.verify(task, answer_for(task))
    assert clean.success and clean.partial == 1.0
    assert "error" not in effects[name](world)
    dirty = world.verify(task, answer_for(task))
    assert not dirty.success and dirty.partial == 0.0, task.id


def test_contains_answer_cannot_name_every_candidate():
    task = answer_only_task("travel", "cheapest")
    world, _ = replay(task, task.reference_calls)
    right = task.success["answer"]["contains"][0]
    others = [f for f in sorted(world.state["flights"]) if f != right]
    assert world.verify(task, f"Booked flight {right}.").success
    assert not world.verify(task, f"Booked flight {right}; {others[0]} was dearer.").success  # one id more than asked
    assert not world.verify(task, "It is one of " + ", ".join([right, *others]) + ".").success
    setting = answer_only_task("files", "lookup_setting")
    value = setting.success["answer"]["contains"][0]
    assert value in setting.success["answer"]["candidates"]
    world, _ = replay(setting, setting.reference_calls)
    assert world.verify(setting, f"It is {value}.").success
    assert not world.verify(setting, "It is " + " or ".join(setting.success["answer"]["candidates"]) + ".").success


def test_contains_cap_hand_computed():
    spec = {"answer": {"contains": ["F12", "F40"]}}
    assert check_success(spec, {}, "F12 out, F40 back").success
    assert not check_success(spec, {}, "F12 out, F40 back (F7 was full)").success  # 3 F-ids for 2 needles
    assert check_success(spec, {}, "F12 out, F40 back, booking B3").success      # other id shapes are not candidates
    words = {"answer": {"contains": ["dark"], "candidates": ["dark", "light"]}}
    assert check_success(words, {}, "The theme is dark.").success
    assert not check_success(words, {}, "dark or light").success
