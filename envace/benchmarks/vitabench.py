"""VitaBench (public part: delivery and in-store tasks), with envace's own tool worlds.

The public task files (meituan-longcat/vitabench, MIT) hold each task's database (`environment`:
stores/shops and products, orders, locations, weather, the user's history, the current time), the
simulated user (`user_scenario`, `instructions`) and the evaluation (`expected_states[]`:
`required_orders` and `state_rubrics`; `overall_rubrics`). The benchmark's own code (`vita`) is
not on PyPI: the worlds below implement its tool set (names, arguments) over the task database and
follow its behaviour where it changes an outcome: fuzzy address resolution and search (rapidfuzz),
the fields an agent sees, status rules, the calendar (`holidays`); docs/benchmarks.md lists them.

Scores:
  proxy   deterministic: replay the trajectory's calls on a fresh world; its final orders, seat
          bookings and reservations must equal the task's required ones (`proxy_score`).
  rubric  VitaBench's own metric: an LLM judge reads the conversation in sliding windows (its
          default evaluation), updating every rubric's state; 1 when all are met
          (`rubric_score`, with any `judge(prompt) -> str`).
`VitaBench.score` gives the rubric score when the benchmark has a judge, else the proxy.

Data directory (`load_tasks`): `data_dir`, else $ENVACE_VITABENCH_DIR, else the repository's
`../shared/data/vitabench`. Every *.json file under it that holds a list of tasks is read, so the
full data set (downloaded by the user) works the same; tasks of domains without a world here
(ota, cross-domain) are reported by `offline_status` and skipped.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable

from envace.benchmarks.base import BENCHMARKS, Benchmark, ChatFn, assistant_texts, completed, openai_chat, requirements
from envace.envs.base import ToolError, ToolWorld, tool
from envace.types import EpisodeRules, Task, ToolCall, Trajectory

PIP = "pip install --no-deps holidays==0.109 rapidfuzz==3.14.6"
DATA_ENV = "ENVACE_VITABENCH_DIR"
# What the benchmark shows an agent of an in-store shop and package: the task files also label
# targets and distractors (shop_type, product_type, target_reason), which must not leak.
SHOP_FIELDS = ("shop_id", "shop_name", "score", "location", "tags", "enable_book", "book_price", "enable_reservation")
PACKAGE_FIELDS = ("product_id", "shop_id", "name", "price", "quantity", "tags")
# The user_id argument of every tool that takes one.
USER_ID = {"type": "string", "description": "The current user's id (e.g. U000001), as given by get_user_historical_behaviors."}
REPO_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "vitabench"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
GREETING = "Hi! How can I help you today?"
STOP = "###STOP###"
# The task files spell the in-store domain several ways.
DOMAIN_NAMES = {"delivery": "delivery", "instore": "instore", "in-store": "instore", "in-store consumption": "instore"}

AGENT_PROMPT = """You are the assistant of a local-services app (food delivery, in-store services).
Current time: {time}

- Use the tools to look up anything you need; ask the user only for what the tools cannot tell you.
- Check every argument before a call; never invent information the conversation or tools did not give.
- Stay on the user's requests. When they are done, ask whether anything else is needed; if not, end with {stop}."""

USER_PROMPT = """You are a user of a local-services app, talking to its AI assistant. Stay in character.

Your profile: {profile}

What you want (reveal it step by step, as a real user would, not all at once):
{instructions}

Answer only what the assistant asks, from your profile and goals; never invent other facts.
When everything you want is done, or cannot be done, reply with only {stop}."""

JUDGE_PROMPT = """You grade an AI assistant of a local-services app (it calls tools to look things up and to act;
tool results are the lines starting with "tool") against scoring points (rubrics) that split up
what the user wanted.

Current time: {time}
What the user wanted, in full: {instructions}

The conversation is long, so you see it in windows of {window} messages that overlap by {overlap};
the rubrics' states carry over from window to window. This is window {index} of {total}. Every
rubric started as false (not met).

Update the states from this window only:
- false -> true only when the assistant achieved the rubric's goal in this window;
- true -> false only when the assistant undid an earlier correct result in this window (not when the
  user changed their mind, e.g. cancelled an order they had asked for);
- a rubric this window does not touch keeps its state; note undecided evidence in its justification.
Judge what the assistant said and did (its replies and tool calls); the user's words only guide it.
Query results are seen by the assistant alone: what counts is what it then told the user, and it
must not invent tool results. An order rubric needs an order the tools really created (a failed
call, or the user saying they will order themselves, does not count). Quantities and delivery
times must match the rubric exactly, whatever the user conceded. Addresses and order notes count
when they serve the same purpose, even if worded differently.
In each justification, append the key evidence with its message number [n]; when the state does
not change, repeat the previous reason.

Window:
{window_content}

Current rubrics:
{rubrics}

Answer with the updated JSON list only, one object per rubric:
[{{"rubric_idx": "rubric_0", "rubric": "<the rubric>", "justification": "<appended reasons>", "meetExpectation": true or false}}, ...]"""
# VitaBench's default evaluation ("trajectory"): windows of 10 messages overlapping by 2.
JUDGE_WINDOW, JUDGE_OVERLAP = 10, 2


# The holidays and festivals `get_holiday_date` knows, for the years of the tasks (the benchmark's
# coverage: other years and names are not found).
FESTIVALS = {
    "2023": {"Qingming Festival": "2023-04-05", "Father's Day": "2023-06-18", "Dragon Boat Festival": "2023-06-22",
             "Mid-Autumn Festival": "2023-09-29", "National Day": "2023-10-01", "Double Ninth Festival": "2023-10-23"},
    "2024": {"Valentine's Day": "2024-02-14", "Lantern Festival": "2024-02-24", "Qingming Festival": "2024-04-04",
             "Dragon Boat Festival": "2024-06-10", "Qixi Festival": "2024-08-10", "Mid-Autumn Festival": "2024-09-17",
             "Double Ninth Festival": "2024-10-11"},
    "2025": {"New Year's Day": "2025-01-01", "Laba Festival": "2025-01-07", "Lantern Festival": "2025-02-15",
             "Dragon Head Festival": "2025-03-01", "Women's Day": "2025-03-08", "Qingming Festival": "2025-04-04",
             "Labor Day": "2025-05-01", "Mother's Day": "2025-05-11", "Dragon Boat Festival": "2025-05-31",
             "Party Founding Day": "2025-07-01", "Start of Autumn": "2025-08-07", "Qixi Festival": "2025-08-29",
             "National Day": "2025-10-01", "Mid-Autumn Festival": "2025-10-06", "Double Ninth Festival": "2025-10-29",
             "Winter Solstice": "2025-12-21", "Christmas Day": "2025-12-25"},
}


@functools.lru_cache(maxsize=1)
def tool_libraries() -> tuple[Any, Any]:
    """(holidays, rapidfuzz): the calendar and the benchmark's fuzzy matching (addresses, search,
    holiday names), imported once; checked when tasks load."""
    with requirements(PIP):
        import holidays
        import rapidfuzz

        return holidays, rapidfuzz


def default_data_dir() -> Path | None:
    path = os.environ.get(DATA_ENV)
    if path:
        return Path(path)
    return REPO_DATA if REPO_DATA.is_dir() else None


def _now(state: dict[str, Any]) -> datetime:
    return datetime.strptime(state["time"], TIME_FORMAT)


def _parse_time(value: str, name: str) -> datetime:
    try:
        return datetime.strptime(value, TIME_FORMAT)
    except (TypeError, ValueError):
        raise ToolError("INVALID_TIME", f"{name} {value!r} must have the form yyyy-mm-dd HH:MM:SS") from None


def _parse_date(value: str, name: str) -> datetime:
    try:
        return datetime.strptime(value, "%Y-%m-%d")
    except (TypeError, ValueError):
        raise ToolError("INVALID_DATE", f"{name} {value!r} must have the form yyyy-mm-dd") from None


def _distance_m(lon1: float, lat1: float, lon2: float, lat2: float) -> int:
    """Great-circle distance in meters, rounded as the benchmark rounds it."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return round(2 * 6_371_000 * math.asin(math.sqrt(a)))


def _best_match(query: str, choices: list[str]) -> tuple[str, float] | None:
    """The choice with the highest fuzzy partial-match score (case and punctuation ignored, the
    benchmark's matching) and that score; None without choices."""
    _, rapidfuzz = tool_libraries()
    found = rapidfuzz.process.extractOne(query, choices, scorer=rapidfuzz.fuzz.partial_ratio, processor=rapidfuzz.utils.default_process)
    return None if found is None else (found[0], found[1])


def _rank(items: list[dict[str, Any]], keywords: list[str], text: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """All items, best first by the fuzzy partial-match score of their text against the keywords
    (joined as the benchmark joins them); ties keep the database order."""
    _, rapidfuzz = tool_libraries()
    query = "".join(keywords)
    scores = rapidfuzz.process.cdist([query], [text(i) for i in items], scorer=rapidfuzz.fuzz.partial_ratio,
                                     processor=rapidfuzz.utils.default_process)[0] if items else []
    order = sorted(range(len(items)), key=lambda i: -scores[i])
    return [items[i] for i in order]


# ---- the worlds --------------------------------------------------------------------------------

class VitaWorld(ToolWorld):
    """Tools shared by every VitaBench domain. State: the task's `environment` plus `id_prefix`
    (the task id: new orders are numbered <task id>T<n>, as in the benchmark)."""

    name = "vitabench"
    places_key = ""  # "stores" or "shops": the domain's businesses
    id_digits = 2

    def _places(self) -> list[dict[str, Any]]:
        return list(self.state[self.places_key].values())

    def _check_user(self, user_id: str) -> None:
        if user_id != self.state["user_id"]:
            raise ToolError("USER_MISMATCH", f"user {user_id!r} is not the current user")

    def _new_id(self) -> str:
        """The next free <task id>T<n> (tasks may start with orders already numbered that way)."""
        taken = set(_entries(self.state))
        n = 1
        while (new := f"{self.state['id_prefix']}T{n:0{self.id_digits}d}") in taken:
            n += 1
        return new

    def _known_locations(self) -> list[dict[str, Any]]:
        """Every location of the task: its address book, the businesses', the existing orders'."""
        orders = [o["location"] for o in self.state.get("orders", {}).values() if o.get("location")]
        return list(self.state.get("location", [])) + [p["location"] for p in self._places() if p.get("location")] + orders

    def _locate(self, address: str) -> dict[str, Any]:
        """The known location that best matches `address`, as the benchmark resolves addresses: the
        best fuzzy partial match, accepted at a score >= 30 when the plain similarity is >= 20."""
        _, rapidfuzz = tool_libraries()
        locations = {loc["address"]: loc for loc in self._known_locations()}
        best = _best_match(str(address), list(locations))
        if best is None or best[1] < 30 or rapidfuzz.fuzz.ratio(str(address), best[0]) < 20:
            raise ToolError("ADDRESS_NOT_FOUND", f"no coordinates known for {address!r}")
        return locations[best[0]]

    def _entry(self, collection: str, key: str, entry_id: str) -> dict[str, Any]:
        entry = self.state[collection].get(entry_id)
        if entry is None:
            raise ToolError("NOT_FOUND", f"{key} {entry_id!r} not found")
        return entry

    def _set_status(self, collection: str, key: str, entry_id: str, new: str, allowed_from: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Set `new`; `allowed_from` None: from any status but `new` itself (the benchmark cancels anything not cancelled)."""
        entry = self._entry(collection, key, entry_id)
        blocked = entry["status"] == new if allowed_from is None else entry["status"] not in allowed_from
        if blocked:
            needs = f"a status other than {new}" if allowed_from is None else f"status {' or '.join(allowed_from)}"
            raise ToolError("INVALID_STATUS", f"{key} {entry_id} is {entry['status']}; this needs {needs}")
        entry["status"] = new
        entry["update_time"] = self.state["time"]
        return entry

    @tool("Straight-line (great-circle) distance between two points given as longitude/latitude in decimal degrees. Returns a whole number of meters; useful e.g. to feed delivery_distance_to_time.",
          {"longitude1": {"type": "number", "description": "Longitude of the first point, decimal degrees."},
           "latitude1": {"type": "number", "description": "Latitude of the first point, decimal degrees."},
           "longitude2": {"type": "number", "description": "Longitude of the second point, decimal degrees."},
           "latitude2": {"type": "number", "description": "Latitude of the second point, decimal degrees."}},
          ["longitude1", "latitude1", "longitude2", "latitude2"])
    def longitude_latitude_to_distance(self, longitude1: float, latitude1: float, longitude2: float, latitude2: float) -> dict[str, Any]:
        return {"distance_m": _distance_m(longitude1, latitude1, longitude2, latitude2)}

    @tool("Looks up the coordinates of an address. The text is fuzzily matched against the addresses known to this task (user's addresses, businesses, existing orders); returns the matched address with its longitude and latitude, or an error when nothing matches well enough.",
          {"address": {"type": "string", "description": "Address text to look up; need not be exact, close wording of a known address matches."}},
          ["address"])
    def address_to_longitude_latitude(self, address: str) -> dict[str, Any]:
        loc = self._locate(address)
        return {"address": loc["address"], "longitude": loc["longitude"], "latitude": loc["latitude"]}

    @tool("Daily weather for the city containing an address over a date range (both ends included). The address is fuzzily matched to a city with weather data; errors if the city or dates are unknown.",
          {"address": {"type": "string", "description": "Address or city name whose weather is wanted."},
           "date_start": {"type": "string", "description": "First day of the range, formatted yyyy-mm-dd."},
           "date_end": {"type": "string", "description": "Last day of the range (included), formatted yyyy-mm-dd."}},
          ["address", "date_start", "date_end"])
    def weather(self, address: str, date_start: str, date_end: str) -> dict[str, Any]:
        _parse_date(date_start, "date_start")
        _parse_date(date_end, "date_end")
        cities = list(dict.fromkeys(w["city"] for w in self.state.get("weather", [])))
        best = _best_match(str(address), cities)  # the benchmark's city lookup: fuzzy, score >= 50
        if best is None or best[1] < 50:
            raise ToolError("NO_WEATHER", f"no weather known for {address!r}; known cities: {', '.join(cities)}")
        days = [w for w in self.state["weather"] if w["city"] == best[0] and date_start <= w["datetime"] <= date_end]
        if not days:
            raise ToolError("NO_WEATHER", f"no weather for {best[0]} from {date_start} to {date_end}")
        return {"weather": days}

    @tool("Tells whether a given day is a public holiday in mainland China and, if so, gives the holiday's name (null otherwise).",
          {"date": {"type": "string", "description": "Day to check, formatted yyyy-mm-dd."}},
          ["date"])
    def get_date_holiday_info(self, date: str) -> dict[str, Any]:
        day = _parse_date(date, "date").date()
        holidays, _ = tool_libraries()
        return {"date": date, "holiday": holidays.China(years=day.year).get(day)}

    @tool("Finds the calendar date of a named holiday or festival (e.g. Mid-Autumn Festival, Qixi Festival) in a given year. Names are English and matched loosely; only 2023-2025 are covered. Returns the matched name and its yyyy-mm-dd date.",
          {"year": {"type": "string", "description": "Four-digit year as a string, e.g. \"2025\"."},
           "holiday_name": {"type": "string", "description": "English holiday name, e.g. \"Dragon Boat Festival\"; partial or slightly different spellings are accepted."}},
          ["year", "holiday_name"])
    def get_holiday_date(self, year: str, holiday_name: str) -> dict[str, Any]:
        if not re.fullmatch(r"\d{4}", str(year)):
            raise ToolError("INVALID_YEAR", f"year {year!r} must be four digits, e.g. 2025")
        dates = FESTIVALS.get(str(year))
        if dates is None:
            raise ToolError("HOLIDAY_NOT_FOUND", f"no holiday data for {year}; known years: {', '.join(FESTIVALS)}")
        # Partial matching as the benchmark does ("Mid-Autumn" finds "Mid-Autumn Festival"), case-insensitive.
        match = _best_match(holiday_name, list(dates))
        if match is None or match[1] < 80:
            raise ToolError("HOLIDAY_NOT_FOUND", f"no holiday named {holiday_name!r} in {year}; known: {', '.join(dates)}")
        return {"holiday": match[0], "date": dates[match[0]]}

    @tool("Returns the current user's profile: user id, home and work addresses, and past behaviour per scenario (usual spending, favourite categories, price range, rating expectations, preferred times). Use it to personalise suggestions and to obtain the user_id other tools need.")
    def get_user_historical_behaviors(self) -> dict[str, Any]:
        return {"user_id": self.state["user_id"], **self.state.get("user_historical_behaviors", {})}

    @tool("Lists every order the current user has in this task (any type and status), with full details.")
    def get_user_all_orders(self) -> dict[str, Any]:
        return {"orders": list(self.state.get("orders", {}).values())}

    @tool("Lists the businesses of this domain (delivery stores or in-store shops) lying within a radius of a point, closest first, each with id, name, distance in meters and address.",
          {"longitude": {"type": "number", "description": "Longitude of the centre point, decimal degrees."},
           "latitude": {"type": "number", "description": "Latitude of the centre point, decimal degrees."},
           "range": {"type": "number", "description": "Search radius around the point, in meters."}},
          ["longitude", "latitude", "range"])
    def get_nearby(self, longitude: float, latitude: float, range: float) -> dict[str, Any]:
        near = []
        for place in self._places():
            loc = place["location"]
            d = _distance_m(longitude, latitude, loc["longitude"], loc["latitude"])
            if d <= range:
                near.append({"id": place.get("store_id") or place.get("shop_id"), "name": place.get("name") or place.get("shop_name"),
                             "distance_m": d, "address": loc["address"]})
        return {"nearby": sorted(near, key=lambda p: p["distance_m"])}


class DeliveryWorld(VitaWorld):
    places_key = "stores"
    id_digits = 2

    def _store(self, store_id: str) -> dict[str, Any]:
        store = self.state["stores"].get(store_id)
        if store is None:
            raise ToolError("NOT_FOUND", f"store {store_id!r} not found")
        return store

    def _products(self) -> list[dict[str, Any]]:
        return [p for s in self._places() for p in s["products"]]

    def _delivery_order(self, order_id: str) -> dict[str, Any]:
        order = self._entry("orders", "order", order_id)
        if order.get("order_type") != "delivery":
            raise ToolError("NOT_FOUND", f"order {order_id!r} is not a delivery order")
        return order

    @tool("Estimates how long a rider needs to bring food over a given store-to-customer distance. Returns whole minutes; add them to a dispatch time to get the arrival time.",
          {"distance": {"type": "number", "description": "Distance from store to delivery address, in meters (e.g. from longitude_latitude_to_distance)."}},
          ["distance"])
    def delivery_distance_to_time(self, distance: float) -> dict[str, Any]:
        return {"minutes": round(25 + round(distance) * 0.00651)}

    @tool("Full details of one delivery store: id, name, rating, address with coordinates, tags and its complete product list (with prices and selectable attributes).",
          {"store_id": {"type": "string", "description": "Store id, e.g. S85277471199200385_S98778, as shown in search results."}},
          ["store_id"])
    def get_delivery_store_info(self, store_id: str) -> dict[str, Any]:
        return self._store(store_id)

    @tool("Full details of one delivery product (dish): name, id, owning store's id and name, price, tags and selectable attributes/options.",
          {"product_id": {"type": "string", "description": "Product id, e.g. S26110520013660896_P88296, as shown in search results or store info."}},
          ["product_id"])
    def get_delivery_product_info(self, product_id: str) -> dict[str, Any]:
        for p in self._products():
            if p["product_id"] == product_id:
                return p
        raise ToolError("NOT_FOUND", f"product {product_id!r} not found")

    @tool("Delivery: find or recommend stores. Pull keywords describing the wanted store (cuisine, name, features) out of what the user said; returns all stores ranked by fuzzy match on name and tags, best first, without product lists. Then help the user settle on one store.",
          {"keywords": {"type": "array", "items": {"type": "string"}, "description": "Short words or phrases describing the store wanted, e.g. [\"rice noodles\", \"quick service\"]."}},
          ["keywords"])
    def delivery_store_search_recommand(self, keywords: list[str]) -> dict[str, Any]:
        stores = [{k: v for k, v in s.items() if k != "products"} for s in self._places()]  # details: get_delivery_store_info
        return {"stores": _rank(stores, keywords, lambda s: s["name"] + "".join(s["tags"]))}

    @tool("Delivery: find or recommend dishes. Pull keywords describing the wanted food out of the user's words; returns all products ranked by fuzzy match on store name, product name and tags, best first. Then help the user choose items and place an order.",
          {"keywords": {"type": "array", "items": {"type": "string"}, "description": "Short words or phrases describing the food wanted, e.g. [\"crayfish\", \"spicy\"]."}},
          ["keywords"])
    def delivery_product_search_recommand(self, keywords: list[str]) -> dict[str, Any]:
        return {"products": _rank(self._products(), keywords, lambda p: f"{p.get('store_name', '')}, {p['name']}, {p.get('tags', [])}")}

    @tool("Places an unpaid delivery order from exactly one store, for one or more of its products. Settle the store, items, counts, options, address and timing first, and record the user's dietary restrictions in the note. Computes delivery duration and arrival time. Returns the order (with order_id); afterwards ask whether the user wants to pay.",
          {"user_id": USER_ID,
           "store_id": {"type": "string", "description": "Id of the single store being ordered from."},
           "product_ids": {"type": "array", "items": {"type": "string"}, "description": "Ids of the products to order, all from that store."},
           "product_cnts": {"type": "array", "items": {"type": "integer"}, "description": "Quantity for each product, same order and length as product_ids; each must be positive."},
           "address": {"type": "string", "description": "Delivery destination address; fuzzily matched to a known address to compute distance."},
           "dispatch_time": {"type": "string", "description": "When the rider leaves the store with the food, yyyy-mm-dd HH:MM:SS; not earlier than now."},
           "attributes": {"type": "array", "items": {"type": "string"}, "description": "Optional chosen option/specification per product (e.g. \"Mild Spicy\"), aligned with product_ids; use \"\" for none."},
           "note": {"type": "string", "description": "Optional remark for the store, e.g. dietary restrictions; never put timing requests here (use dispatch_time)."}},
          ["user_id", "store_id", "product_ids", "product_cnts", "address", "dispatch_time"])
    def create_delivery_order(self, user_id: str, store_id: str, product_ids: list[str], product_cnts: list[int], address: str,
                              dispatch_time: str, attributes: list[str] | None = None, note: str = "") -> dict[str, Any]:
        self._check_user(user_id)
        store = self._store(store_id)
        # Any known product, as the benchmark accepts (it does not check the store sells it).
        catalog = {p["product_id"]: p for p in self._products()}
        if len(product_ids) != len(product_cnts) or any(c <= 0 for c in product_cnts):
            raise ToolError("INVALID_ARGUMENTS", "give one positive count per product id")
        missing = [p for p in product_ids if p not in catalog]
        if missing:
            raise ToolError("NOT_FOUND", f"unknown products {', '.join(missing)}")
        dispatch = _parse_time(dispatch_time, "dispatch_time")
        if dispatch < _now(self.state):
            raise ToolError("INVALID_TIME", f"dispatch_time {dispatch_time} is in the past (now {self.state['time']})")
        where = self._locate(address)
        distance = _distance_m(where["longitude"], where["latitude"], store["location"]["longitude"], store["location"]["latitude"])
        minutes = self.delivery_distance_to_time(distance)["minutes"]
        attrs = list(attributes or []) + [""] * len(product_ids)
        products = [{"product_id": p, "name": catalog[p]["name"], "price": catalog[p]["price"], "quantity": c, "attributes": a}
                    for p, c, a in zip(product_ids, product_cnts, attrs)]
        order = {
            "order_id": self._new_id(), "order_type": "delivery", "user_id": user_id, "store_id": store_id, "note": note,
            "location": {"address": address, "longitude": where["longitude"], "latitude": where["latitude"]},
            "dispatch_time": dispatch_time, "shipping_time": minutes, "delivery_time": (dispatch + timedelta(minutes=minutes)).strftime(TIME_FORMAT),
            "total_price": round(sum(p["price"] * p["quantity"] for p in products), 2), "create_time": self.state["time"],
            "update_time": self.state["time"], "status": "unpaid", "products": products,
        }
        self.state["orders"][order["order_id"]] = order
        return order

    @tool("Pays a delivery order once the user has explicitly agreed to pay for an order just discussed. Works only while the order is unpaid; it then becomes paid.",
          {"order_id": {"type": "string", "description": "Id of the delivery order to pay, as returned when it was created."}},
          ["order_id"])
    def pay_delivery_order(self, order_id: str) -> dict[str, Any]:
        self._delivery_order(order_id)
        return self._set_status("orders", "order", order_id, "paid", ("unpaid",))

    @tool("Returns the current status (e.g. unpaid, paid, cancelled) of one delivery order.",
          {"order_id": {"type": "string", "description": "Id of the delivery order."}},
          ["order_id"])
    def get_delivery_order_status(self, order_id: str) -> dict[str, Any]:
        return {"order_id": order_id, "status": self._delivery_order(order_id)["status"]}

    @tool("Cancels a delivery order, or withdraws an unpaid one, when the user asks. Check its status first: an order that is already cancelled must not be cancelled again (this fails).",
          {"order_id": {"type": "string", "description": "Id of the delivery order to cancel."}},
          ["order_id"])
    def cancel_delivery_order(self, order_id: str) -> dict[str, Any]:
        self._delivery_order(order_id)
        return self._set_status("orders", "order", order_id, "cancelled")

    @tool("Replaces the note (remark) of one clearly identified delivery order when the user wants it changed. Returns the updated order; if it is still unpaid, ask the user to confirm payment.",
          {"order_id": {"type": "string", "description": "Id of the delivery order to change."},
           "note": {"type": "string", "description": "The new note, replacing the old one entirely."}},
          ["order_id", "note"])
    def modify_delivery_order(self, order_id: str, note: str) -> dict[str, Any]:
        order = self._delivery_order(order_id)
        order["note"] = note
        order["update_time"] = self.state["time"]
        return order

    @tool("Lists the current user's delivery orders that have a given status (unpaid when no status is given), with id, type, store, total price, creation/update times, status and items.",
          {"user_id": USER_ID,
           "status": {"type": "string", "description": "Order status to filter by, e.g. unpaid, paid, cancelled; defaults to unpaid."}},
          ["user_id"])
    def search_delivery_orders(self, user_id: str, status: str = "unpaid") -> dict[str, Any]:
        self._check_user(user_id)
        return {"orders": [o for o in self.state["orders"].values() if o.get("order_type") == "delivery" and o["status"] == status]}

    @tool("Full record of one clearly identified delivery order: id, type, store, address, dispatch time, delivery duration (minutes), arrival time, total price, creation/update times, status, note and items.",
          {"order_id": {"type": "string", "description": "Id of the delivery order."}},
          ["order_id"])
    def get_delivery_order_detail(self, order_id: str) -> dict[str, Any]:
        return self._delivery_order(order_id)


class InstoreWorld(VitaWorld):
    places_key = "shops"
    id_digits = 3

    def _shop(self, shop_id: str) -> dict[str, Any]:
        shop = self.state["shops"].get(shop_id)
        if shop is None:
            raise ToolError("NOT_FOUND", f"shop {shop_id!r} not found")
        return shop

    def _user_entries(self, collection: str, user_id: str, key: str = "customer_id") -> list[dict[str, Any]]:
        self._check_user(user_id)
        return [e for e in self.state[collection].values() if e.get(key) == user_id]

    def _instore_order(self, order_id: str) -> dict[str, Any]:
        order = self._entry("orders", "order", order_id)
        if order.get("order_type") != "instore":
            raise ToolError("NOT_FOUND", f"order {order_id!r} is not an in-store order")
        return order

    @tool("In-store services: when the user's wish is vague (no specific shop or package named), recommend shops. Build keywords from the request and the user's preferences; returns shops ranked by fuzzy match on name and tags, with rating, location, booking/reservation support and booking fee. Then have the user pick a shop, then a package.",
          {"keywords": {"type": "array", "items": {"type": "string"}, "description": "Short words or phrases describing the shop or service wanted, e.g. [\"hot pot\", \"private room\"]."}},
          ["keywords"])
    def instore_shop_search_recommend(self, keywords: list[str]) -> dict[str, Any]:
        shops = [{k: s[k] for k in SHOP_FIELDS if k in s} for s in self._places()]
        return {"shops": _rank(shops, keywords, lambda s: f"{s['shop_name']},{s['tags']}")}

    @tool("In-store services: find or recommend packages (vouchers/set deals) from keywords taken from the user's words; returns packages of all shops ranked by fuzzy match on name and tags, with price and shop id. Then help the user pick one and order it.",
          {"keywords": {"type": "array", "items": {"type": "string"}, "description": "Short words or phrases describing the package wanted, e.g. [\"massage\", \"60 minutes\"]."}},
          ["keywords"])
    def instore_product_search_recommend(self, keywords: list[str]) -> dict[str, Any]:
        products = [{k: p[k] for k in PACKAGE_FIELDS if k in p} for s in self._places() for p in s["products"]]
        return {"products": _rank(products, keywords, lambda p: f"{p['name']},{p['tags']}")}

    @tool("Places an unpaid in-store order for one package of one shop (several copies allowed). Settle the shop and package first. Returns the order with its order_id; then ask whether the user wants to pay.",
          {"user_id": USER_ID,
           "shop_id": {"type": "string", "description": "Id of the shop, e.g. S17564420237542211_I00001."},
           "product_id": {"type": "string", "description": "Id of a package sold by that shop, e.g. S17564420237542211_P00001."},
           "quantity": {"type": "integer", "description": "How many of the package to buy; positive, defaults to 1."}},
          ["user_id", "shop_id", "product_id"])
    def create_instore_product_order(self, user_id: str, shop_id: str, product_id: str, quantity: int = 1) -> dict[str, Any]:
        self._check_user(user_id)
        product = next((p for p in self._shop(shop_id)["products"] if p["product_id"] == product_id), None)
        if product is None:
            raise ToolError("NOT_FOUND", f"shop {shop_id} has no package {product_id!r}")
        if quantity <= 0:
            raise ToolError("INVALID_ARGUMENTS", "quantity must be positive")
        order = {
            "order_id": self._new_id(), "order_type": "instore", "user_id": user_id, "store_id": shop_id, "note": "", "location": None,
            "total_price": round(product["price"] * quantity, 2), "create_time": self.state["time"], "update_time": self.state["time"],
            "status": "unpaid", "products": [{"product_id": product_id, "name": product["name"], "price": product["price"], "quantity": quantity}],
        }
        self.state["orders"][order["order_id"]] = order
        return order

    @tool("Pays an in-store order already shown in the conversation, once the user confirms payment. Only an unpaid order can be paid; it then becomes paid.",
          {"order_id": {"type": "string", "description": "Id of the in-store order to pay."}},
          ["order_id"])
    def pay_instore_order(self, order_id: str) -> dict[str, Any]:
        self._instore_order(order_id)
        return self._set_status("orders", "order", order_id, "paid", ("unpaid",))

    @tool("Cancels an in-store order, or withdraws an unpaid one, at the user's request. Check its status first; an order that is already cancelled must not be cancelled again (this fails).",
          {"order_id": {"type": "string", "description": "Id of the in-store order to cancel."}},
          ["order_id"])
    def instore_cancel_order(self, order_id: str) -> dict[str, Any]:
        self._instore_order(order_id)
        return self._set_status("orders", "order", order_id, "cancelled")

    @tool("Reserves physical seats or a table at a chosen shop that accepts seat bookings (enable_book). Returns the booking with its book_id. If the shop charges a booking fee the booking starts unpaid and you should ask the user about paying; with no fee it is paid at once.",
          {"user_id": USER_ID,
           "shop_id": {"type": "string", "description": "Id of the shop to book at."},
           "time": {"type": "string", "description": "Arrival time for the booking, yyyy-mm-dd HH:MM:SS."},
           "customer_count": {"type": "integer", "description": "Number of people to seat; positive, defaults to 1."}},
          ["user_id", "shop_id", "time"])
    def instore_book(self, user_id: str, shop_id: str, time: str, customer_count: int = 1) -> dict[str, Any]:
        self._check_user(user_id)
        shop = self._shop(shop_id)
        _parse_time(time, "time")
        if not shop.get("enable_book"):
            raise ToolError("NOT_SUPPORTED", f"shop {shop_id} does not take seat bookings")
        if customer_count <= 0:
            raise ToolError("INVALID_ARGUMENTS", "customer_count must be positive")
        price = shop.get("book_price") or 0
        book = {"book_id": self._new_id(), "shop_id": shop_id, "book_time": time, "customer_count": customer_count, "book_price": price,
                "customer_id": user_id, "status": "unpaid" if price > 0 else "paid", "update_time": self.state["time"]}
        self.state["books"][book["book_id"]] = book
        return book

    @tool("Pays the booking fee of one clearly identified seat booking. Only an unpaid booking can be paid; it then becomes paid.",
          {"book_id": {"type": "string", "description": "Id of the seat booking, as returned by instore_book."}},
          ["book_id"])
    def pay_instore_book(self, book_id: str) -> dict[str, Any]:
        return self._set_status("books", "booking", book_id, "paid", ("unpaid",))

    @tool("Cancels one clearly identified seat booking. Fails if it is already cancelled.",
          {"book_id": {"type": "string", "description": "Id of the seat booking to cancel."}},
          ["book_id"])
    def instore_cancel_book(self, book_id: str) -> dict[str, Any]:
        return self._set_status("books", "booking", book_id, "cancelled")

    @tool("Reserves a time slot for a service at a chosen shop that offers reservations (check enable_reservation first). Returns the reservation with its reservation_id, status unconsumed; tell the user to arrive at the shop at that time.",
          {"user_id": USER_ID,
           "shop_id": {"type": "string", "description": "Id of the shop providing the service."},
           "time": {"type": "string", "description": "Service time, yyyy-mm-dd HH:MM:SS."},
           "customer_count": {"type": "integer", "description": "Number of people for the service; positive, defaults to 1."}},
          ["user_id", "shop_id", "time"])
    def instore_reservation(self, user_id: str, shop_id: str, time: str, customer_count: int = 1) -> dict[str, Any]:
        self._check_user(user_id)
        self._shop(shop_id)
        _parse_time(time, "time")
        if customer_count <= 0:
            raise ToolError("INVALID_ARGUMENTS", "customer_count must be positive")
        reservation = {"reservation_id": self._new_id(), "shop_id": shop_id, "reservation_time": time, "customer_id": user_id,
                       "customer_count": customer_count, "status": "unconsumed", "update_time": self.state["time"]}
        self.state["reservations"][reservation["reservation_id"]] = reservation
        return reservation

    @tool("Changes the time and party size of one existing reservation (look it up first to get its id). Both are overwritten: always pass customer_count, or it becomes 0. Fails for consumed or cancelled reservations. Returns the updated reservation; remind the user of the new time.",
          {"reservation_id": {"type": "string", "description": "Id of the reservation to change."},
           "time": {"type": "string", "description": "New service time, yyyy-mm-dd HH:MM:SS."},
           "customer_count": {"type": "integer", "description": "New number of people (0 or more); defaults to 0 if omitted, so always give it."}},
          ["reservation_id", "time"])
    def instore_modify_reservation(self, reservation_id: str, time: str, customer_count: int = 0) -> dict[str, Any]:
        reservation = self._entry("reservations", "reservation", reservation_id)
        if reservation["status"] in ("consumed", "cancelled"):
            raise ToolError("INVALID_STATUS", f"reservation {reservation_id} is already {reservation['status']}")
        _parse_time(time, "time")
        if customer_count < 0:
            raise ToolError("INVALID_ARGUMENTS", "customer_count must not be negative")
        reservation["reservation_time"] = time
        reservation["customer_count"] = customer_count  # the benchmark writes it always: leaving it out sets 0
        reservation["update_time"] = self.state["time"]
        return reservation

    @tool("Cancels one clearly identified service reservation. Fails if it is already cancelled.",
          {"reservation_id": {"type": "string", "description": "Id of the reservation to cancel."}},
          ["reservation_id"])
    def instore_cancel_reservation(self, reservation_id: str) -> dict[str, Any]:
        return self._set_status("reservations", "reservation", reservation_id, "cancelled")

    @tool("Lists all in-store orders (packages bought) of the given user, with full details and status.",
          {"user_id": USER_ID},
          ["user_id"])
    def get_instore_orders(self, user_id: str) -> dict[str, Any]:
        return {"orders": [o for o in self._user_entries("orders", user_id, "user_id") if o.get("order_type") == "instore"]}

    @tool("Lists all service reservations of the given user, with shop, time, party size and status.",
          {"user_id": USER_ID},
          ["user_id"])
    def get_instore_reservations(self, user_id: str) -> dict[str, Any]:
        return {"reservations": self._user_entries("reservations", user_id)}

    @tool("Lists all seat bookings of the given user, with shop, time, party size, fee and status.",
          {"user_id": USER_ID},
          ["user_id"])
    def get_instore_books(self, user_id: str) -> dict[str, Any]:
        return {"books": self._user_entries("books", user_id)}

    @tool("Looks up the user's seat bookings: all of them when book_id is omitted, or only the one with that id. Use it to identify a booking before paying or cancelling it.",
          {"user_id": USER_ID,
           "book_id": {"type": "string", "description": "Optional id of one seat booking; omit to list all of the user's bookings."}},
          ["user_id"])
    def search_instore_book(self, user_id: str, book_id: str | None = None) -> dict[str, Any]:
        return {"books": [b for b in self._user_entries("books", user_id) if book_id in (None, b["book_id"])]}

    @tool("Looks up the user's service reservations: all of them when reservation_id is omitted, or only the one with that id. Use it to identify a reservation before changing or cancelling it.",
          {"user_id": USER_ID,
           "reservation_id": {"type": "string", "description": "Optional id of one reservation; omit to list all of the user's reservations."}},
          ["user_id"])
    def search_instore_reservation(self, user_id: str, reservation_id: str | None = None) -> dict[str, Any]:
        return {"reservations": [r for r in self._user_entries("reservations", user_id) if reservation_id in (None, r["reservation_id"])]}


WORLDS_BY_DOMAIN: dict[str, type[VitaWorld]] = {"delivery": DeliveryWorld, "instore": InstoreWorld}


# ---- scoring ------------------------------------------------------------------------------------

def status_class(status: str) -> str:
    """The task files name a committed order paid, processed, in-progress, delivered, unconsumed
    or consumed (annotators differ); the proxy tells apart only unpaid, cancelled and committed."""
    return status if status in ("unpaid", "cancelled") else "committed"


def canonical(entry: dict[str, Any], place: Callable[[str], str] = str) -> list[tuple]:
    """What the proxy compares of an order (type, store, products and counts, the delivery place,
    status), a seat booking or a reservation (shop, time, party size, status). An in-store order counts
    as one item per product: the in-store tool orders one package at a time, while the task files
    often list a visit's packages as one order. `place` maps an address to the known location it
    resolves to, so two wordings of one place compare equal."""
    status = status_class(entry.get("status", ""))
    if "order_id" in entry:
        lines = [(p.get("product_id"), p.get("quantity", 1)) for p in entry.get("products", [])]
        if entry.get("order_type") == "instore":
            return [("order", "instore", entry.get("store_id"), (line,), status) for line in lines]
        address = place((entry.get("location") or {}).get("address") or "")
        return [("order", entry.get("order_type"), entry.get("store_id"), tuple(sorted(lines, key=repr)), address, status)]
    if "book_id" in entry:
        return [("book", entry["shop_id"], entry.get("book_time"), entry.get("customer_count"), status)]
    return [("reservation", entry["shop_id"], entry.get("reservation_time"), entry.get("customer_count"), status)]


def _entries(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: e for c in ("orders", "books", "reservations") for k, e in state.get(c, {}).items()}


def proxy_score(task: Task, final_state: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """1 when the world's orders/bookings/reservations that were created, changed, or are required
    equal the required ones (as multisets of `canonical` forms); untouched old ones are ignored.
    Addresses compare as the known location the task's own world resolves them to."""
    world = WORLDS_BY_DOMAIN[task.metadata["category"]](task.initial_state)

    def place(address: str) -> str:
        try:
            return world._locate(address)["address"]
        except ToolError:
            return " ".join(address.lower().split())

    required = task.metadata["required_orders"]
    initial, final = _entries(task.initial_state), _entries(final_state)
    required_ids = {r.get("order_id") or r.get("book_id") or r.get("reservation_id") for r in required}
    relevant = [e for k, e in final.items() if k not in initial or e != initial[k] or k in required_ids]
    want = Counter(item for e in required for item in canonical(e, place))
    got = Counter(item for e in relevant for item in canonical(e, place))
    details = {"required": sum(want.values()), "matched": sum((want & got).values()),
               "missing": [list(k) for k in (want - got).elements()], "unexpected": [list(k) for k in (got - want).elements()]}
    return (1.0 if want == got else 0.0), details


def _format_call(call: ToolCall, observation: dict[str, Any] | None) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
    return f"{call.name}({args}) -> {json.dumps(observation, ensure_ascii=False)}"


def conversation_lines(trajectory: Trajectory) -> list[str]:
    """The chat for the judge, one line per message: user and assistant texts and each tool call
    with its result."""
    calls = iter(zip(trajectory.tool_calls, trajectory.observations + [None] * len(trajectory.tool_calls)))
    lines = []
    for m in trajectory.messages:
        if m["role"] == "user":
            lines.append(f"user: {m['content']}")
        elif m["role"] == "assistant" and m.get("content"):
            lines.append(f"assistant: {m['content']}")
        elif m["role"] == "tool":
            lines.append("tool: " + _format_call(*next(calls)))
    if not trajectory.messages:  # hand-built trajectories: calls, then the answer
        lines = ["tool: " + _format_call(c, o) for c, o in calls] + [f"assistant: {t}" for t in assistant_texts(trajectory)]
    return lines


def judge_windows(n: int, size: int = JUDGE_WINDOW, overlap: int = JUDGE_OVERLAP) -> list[range]:
    """Message index ranges of VitaBench's sliding windows: `size` messages, starting every
    `size - overlap`, until one reaches the end (a conversation that fits is one window)."""
    windows, start = [], 0
    while True:
        windows.append(range(start, min(start + size, n)))
        if start + size >= n:
            return windows
        start += size - overlap


def update_rubrics(reply: str, states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The judge's JSON list applied to the rubric states (by "rubric_<k>", or k); rubrics the reply
    leaves out, and every rubric when it is not JSON, keep their state."""
    states = [dict(s) for s in states]
    found = re.search(r"\[.*\]", reply, re.DOTALL)
    try:
        items = json.loads(found.group(0)) if found else []
    except json.JSONDecodeError:
        items = []
    for item in items if isinstance(items, list) else []:
        idx = item.get("rubric_idx") if isinstance(item, dict) else None
        k = int(idx.removeprefix("rubric_")) if isinstance(idx, str) and re.fullmatch(r"(rubric_)?\d+", idx) else idx
        if isinstance(k, int) and 0 <= k < len(states):
            states[k]["justification"] = str(item.get("justification", states[k]["justification"]))
            states[k]["meetExpectation"] = item.get("meetExpectation", states[k]["meetExpectation"]) is True
    return states


def rubric_score(task: Task, trajectory: Trajectory, judge: Callable[[str], str]) -> tuple[float, dict[str, Any]]:
    """VitaBench's metric as its default evaluation computes it: the judge reads the conversation
    window by window, updating every rubric's state; 1 when all are met at the end (and when the
    task has no rubric). Details hold each final verdict and the met fraction."""
    rubrics = task.metadata["rubrics"]
    states = [{"rubric_idx": f"rubric_{i}", "rubric": r, "justification": "Not evaluated yet", "meetExpectation": False} for i, r in enumerate(rubrics)]
    lines = conversation_lines(trajectory)
    windows = judge_windows(len(lines)) if rubrics else []
    time = task.metadata["time"]
    for index, window in enumerate(windows, 1):
        prompt = JUDGE_PROMPT.format(
            time=f"{time} ({datetime.strptime(time, TIME_FORMAT):%A})", instructions=task.metadata["instructions"],
            window=JUDGE_WINDOW, overlap=JUDGE_OVERLAP, index=index, total=len(windows),
            window_content="\n".join(f"[{i + 1}] {lines[i]}" for i in window), rubrics=json.dumps(states, ensure_ascii=False, indent=2),
        )
        states = update_rubrics(judge(prompt), states)
    met = sum(s["meetExpectation"] for s in states)
    details = {"rubrics": [{"rubric": s["rubric"], "met": s["meetExpectation"], "justification": s["justification"]} for s in states],
               "rubric_fraction": met / len(rubrics) if rubrics else 1.0, "judge_calls": len(windows)}
    return (1.0 if met == len(rubrics) else 0.0), details


# ---- tasks and the benchmark ---------------------------------------------------------------------

def _rubrics(criteria: dict[str, Any]) -> list[str]:
    """State rubrics then overall rubrics, each once (as VitaBench's judge lists them)."""
    listed = [r for s in criteria.get("expected_states", []) for r in s.get("state_rubrics", [])] + list(criteria.get("overall_rubrics", []))
    return list(dict.fromkeys(listed))


def to_task(raw: dict[str, Any], domain: str) -> Task:
    env = raw["environment"]
    states = raw["evaluation_criteria"].get("expected_states") or [{}]
    world = WORLDS_BY_DOMAIN[domain]
    return Task(
        id=f"vitabench-{domain}-{raw['id']}", world=VitaBench.name, split="test",
        messages=[{"role": "system", "content": AGENT_PROMPT.format(time=env["time"], stop=STOP)}, {"role": "assistant", "content": GREETING}],
        initial_state={**env, "id_prefix": str(raw["id"])}, tools=world.tool_schemas(),
        rules=EpisodeRules(simulated_user=True),
        metadata={
            "benchmark": VitaBench.name, "category": domain, "vita_id": raw["id"], "time": env["time"],
            "user_scenario": raw.get("user_scenario", {}), "instructions": raw.get("instructions", ""),
            # Every expected state of the public tasks lists the same orders: the last is the final state.
            "required_orders": states[-1].get("required_orders", []), "rubrics": _rubrics(raw["evaluation_criteria"]),
        },
    )


def read_tasks(data_dir: Path) -> list[dict[str, Any]]:
    """Every task in the JSON files under `data_dir` (files holding anything else are skipped)."""
    tasks = []
    for path in sorted(data_dir.rglob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, list) and all(isinstance(t, dict) and "environment" in t and "evaluation_criteria" in t for t in data):
            tasks.extend(data)
    return tasks


@BENCHMARKS.register("vitabench")
class VitaBench(Benchmark):
    name = "vitabench"
    categories = tuple(WORLDS_BY_DOMAIN)
    uses_judge = True
    judge_tokens = 1024  # a JSON verdict with a justification for each of up to ~10 rubrics

    def __init__(self, data_dir: str | Path | None = None, judge: Callable[[str], str] | None = None, user_simulator: Any = None):
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.judge = judge
        self.user_simulator = user_simulator

    def make_user_simulator(self, base_url: str, model: str) -> VitaUserSimulator:
        return VitaUserSimulator(openai_chat(base_url, model))

    def _raw(self) -> list[dict[str, Any]]:
        if self.data_dir is None or not self.data_dir.is_dir():
            raise FileNotFoundError(f"VitaBench data not found: pass data_dir (envace eval: --data-dir) or set {DATA_ENV} (docs/benchmarks.md)")
        return read_tasks(self.data_dir)

    def load_tasks(self, split: str = "test", limit: int | None = None, categories: list[str] | None = None) -> list[Task]:
        """Tasks of the given domains (default: all with a world here), `limit` per domain."""
        tool_libraries()  # a missing package fails here, naming the pip command
        wanted = categories or list(self.categories)
        unknown = [c for c in wanted if c not in self.categories]
        if unknown:
            raise ValueError(f"VitaBench domains {unknown} have no world here; known: {', '.join(self.categories)}")
        by_domain: dict[str, list[Task]] = {c: [] for c in wanted}
        for raw in self._raw():
            domain = DOMAIN_NAMES.get(raw.get("domain", ""))
            if domain in by_domain and (limit is None or len(by_domain[domain]) < limit):
                by_domain[domain].append(to_task(raw, domain))
        return [t for c in wanted for t in by_domain[c]]

    def make_world(self, task: Task) -> ToolWorld:
        return WORLDS_BY_DOMAIN[task.metadata["category"]](task.initial_state)

    def final_state(self, task: Task, trajectory: Trajectory) -> dict[str, Any]:
        """The world after replaying the trajectory's calls (deterministic tools)."""
        world = self.make_world(task)
        for call in trajectory.tool_calls:
            world.execute(call)
        return world.state

    def score(self, task: Task, trajectory: Trajectory) -> tuple[float, dict[str, Any]]:
        metric = "proxy" if self.judge is None else "rubric"
        if not completed(trajectory):
            # VitaBench scores a conversation cut short (step or error limit, invalid message) 0, unjudged.
            return 0.0, {"metric": metric, "premature_end": trajectory.end_reason.value}
        proxy, proxy_details = proxy_score(task, self.final_state(task, trajectory))
        if self.judge is None:
            return proxy, {"metric": "proxy", "proxy": proxy_details}
        value, details = rubric_score(task, trajectory, self.judge)
        return value, {"metric": "rubric", **details, "proxy_score": proxy, "proxy": proxy_details}

    def aggregate(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean over tasks, naming the metric behind it (proxy, or rubric with a judge)."""
        summary = super().aggregate(results)
        metric = "/".join(sorted({r["details"].get("metric", "proxy") for r in results})) or "proxy"
        return {**summary, "metric": metric, "weighting": f"mean over tasks of the {metric} score"}

    def offline_status(self) -> dict[str, str]:
        status = {c: "ok" for c in self.categories}
        if self.data_dir is None or not self.data_dir.is_dir():
            status = {c: f"needs the task files: pass data_dir (envace eval: --data-dir) or set {DATA_ENV}" for c in self.categories}
        return {**status, "ota": "no world here: the OTA tools are not part of the public files", "cross-domain": "no world here (needs the OTA world)"}


# ---- the simulated user ------------------------------------------------------------------------

class VitaUserSimulator:
    """Plays the task's user (profile + instructions) with any chat function, e.g.
    `openai_chat(base_url, model)`; replies "###STOP###" to end, which returns None."""

    def __init__(self, chat: ChatFn):
        self.chat = chat

    def _system(self, task: Task) -> dict[str, str]:
        profile = json.dumps(task.metadata["user_scenario"].get("user_profile", {}), ensure_ascii=False)
        return {"role": "system", "content": USER_PROMPT.format(profile=profile, instructions=task.metadata["instructions"], stop=STOP)}

    def _reply(self, task: Task, turns: list[dict[str, str]]) -> str | None:
        reply = self.chat([self._system(task), *turns]).strip()
        return None if STOP in reply else reply

    def start(self, task: Task, world: ToolWorld | None = None) -> str | None:
        return self._reply(task, [{"role": "user", "content": GREETING}])  # None: the user ends at once

    def respond(self, task: Task, messages: list[dict[str, Any]], world: ToolWorld | None = None) -> str | None:
        """Roles flipped: the agent's texts are the simulator's input, the user's messages its own."""
        turns = []
        for i, m in enumerate(messages):
            if m["role"] == "user":
                turns.append({"role": "assistant", "content": m["content"]})
            elif m["role"] == "assistant" and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool"):
                turns.append({"role": "user", "content": m["content"]})
        return self._reply(task, turns)
