"""Travel (held-out world): flight search, irreversible booking, and cancellation with a partial refund."""

from __future__ import annotations

import random
from typing import Any

from envace.envs._common import Script, World, arg, lookup, money, next_id, ordered
from envace.envs.base import WORLDS, ToolError, tool
from envace.types import Task

AIRPORTS = ("NYC", "LON", "PAR", "ROM", "BER", "MAD")
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
PASSENGERS = ("Ana", "Bo", "Cara", "Dev", "Eli")
REFUND_RATE = 0.8


@WORLDS.register("travel")
class Travel(World):
    name = "travel"
    description = (
        "Flight booking. Airports are 3-letter codes; days are mon to sun; depart is the hour. Flight ids are "
        "F<3 digits>. search_flights lists every flight of a route and day, full ones included, by depart hour. "
        "book_flight books one seat for one passenger at the flight's price and cannot be undone: booking ids "
        "are B<n>, numbered from 1; a flight with 0 seats gives NO_SEATS. cancel_booking cannot be undone either: "
        "it frees the seat and refunds 80% of the price, rounded to cents; cancelled bookings keep their id and "
        "cancelling again gives CANCELLED. list_bookings lists bookings by id. Unknown ids give NOT_FOUND."
    )
    irreversible_tools = frozenset({"book_flight", "cancel_booking"})

    def default_state(self) -> dict[str, Any]:
        return {"flights": {}, "bookings": {}}

    @tool("Flights of a route on a day.", {"origin": arg("string", "e.g. NYC"), "destination": arg("string"), "day": arg("string", enum=list(DAYS))},
          ["origin", "destination", "day"])
    def search_flights(self, origin: str, destination: str, day: str) -> dict[str, Any]:
        hits = [{"depart": f["depart"], "id": i, "price": f["price"], "seats": f["seats"]} for i, f in ordered(self.state["flights"])
                if (f["origin"], f["destination"], f["day"]) == (origin, destination, day)]
        return {"flights": sorted(hits, key=lambda f: f["depart"])}

    @tool("Details of one flight.", {"flight_id": arg("string", "e.g. F123")}, ["flight_id"])
    def get_flight(self, flight_id: str) -> dict[str, Any]:
        return {"id": flight_id, **lookup(self.state["flights"], flight_id, "flight")}

    @tool("Book one seat for a passenger. Cannot be undone.", {"flight_id": arg("string"), "passenger": arg("string")},
          ["flight_id", "passenger"])
    def book_flight(self, flight_id: str, passenger: str) -> dict[str, Any]:
        flight = lookup(self.state["flights"], flight_id, "flight")
        if flight["seats"] < 1:
            raise ToolError("NO_SEATS", f"{flight_id} is full")
        flight["seats"] -= 1
        booking_id = next_id(self.state["bookings"], "B")
        self.state["bookings"][booking_id] = {"flight_id": flight_id, "passenger": passenger, "price": flight["price"], "status": "booked"}
        return {"booking_id": booking_id, "flight_id": flight_id, "passenger": passenger, "price": flight["price"]}

    @tool("Cancel a booking for an 80% refund. Cannot be undone.", {"booking_id": arg("string", "e.g. B1")}, ["booking_id"])
    def cancel_booking(self, booking_id: str) -> dict[str, Any]:
        booking = lookup(self.state["bookings"], booking_id, "booking")
        if booking["status"] == "cancelled":
            raise ToolError("CANCELLED", f"{booking_id} is already cancelled")
        booking["status"] = "cancelled"
        self.state["flights"][booking["flight_id"]]["seats"] += 1
        return {"booking_id": booking_id, "refund": money(booking["price"] * REFUND_RATE)}

    @tool("All bookings.")
    def list_bookings(self) -> dict[str, Any]:
        return {"bookings": [{"id": i, **b} for i, b in ordered(self.state["bookings"])]}

    @classmethod
    def facts(cls, state: dict[str, Any]) -> str:
        flights = "; ".join(f"{i} {f['origin']}-{f['destination']} {f['day']} depart {f['depart']} price {f['price']} seats {f['seats']}"
                            for i, f in ordered(state["flights"]))
        bookings = "; ".join(f"{i} {b['passenger']} on {b['flight_id']} price {b['price']} {b['status']}"
                             for i, b in ordered(state["bookings"])) or "none"
        return f"Flights: {flights}. Bookings: {bookings}."


# ---- task families -------------------------------------------------------------------------

def _flights(rng: random.Random, n: int, legs: list[tuple[tuple[str, str], str]]) -> dict[str, Any]:
    """n flights for each (route, day) leg, plus a distractor on the reverse of the first leg.
    Prices and depart hours are distinct within a leg; the first flight of each leg has 2+ seats."""
    ids = iter(rng.sample(range(100, 1000), n * len(legs) + 1))
    flights: dict[str, Any] = {}
    for (origin, destination), day in legs:
        for k, (depart, price) in enumerate(zip(rng.sample(range(6, 23), n), rng.sample(range(80, 600, 5), n))):
            seats = rng.randint(2, 9) if k == 0 else rng.choice((0, 1, 2, 5, 9))
            flights[f"F{next(ids)}"] = {"day": day, "depart": depart, "destination": destination, "origin": origin,
                                        "price": price, "seats": seats}
    (origin, destination), day = legs[0]
    flights[f"F{next(ids)}"] = {"day": day, "depart": rng.randrange(6, 23), "destination": origin, "origin": destination,
                                "price": rng.randrange(80, 600, 5), "seats": 5}
    return flights


def _search(s: Script, route: tuple[str, str], day: str) -> list[dict[str, Any]]:
    return s("search_flights", origin=route[0], destination=route[1], day=day)["flights"]


def cheapest(rng: random.Random, difficulty: int) -> Task:
    route, day = tuple(rng.sample(AIRPORTS, 2)), rng.choice(DAYS)
    party = rng.sample(PASSENGERS, 2 if difficulty == 3 else 1)
    s = Script(Travel, {"flights": _flights(rng, 1 + difficulty, [(route, day)]), "bookings": {}})
    best = min((f for f in _search(s, route, day) if f["seats"] >= len(party)), key=lambda f: f["price"])
    for who in party:
        s("book_flight", flight_id=best["id"], passenger=who)
    return s.task(f"Book {' and '.join(party)} on the cheapest {route[0]} to {route[1]} flight on {day} with a seat for "
                  f"{'each of them' if len(party) > 1 else 'them'}. Tell me the flight id.",
                  check=("bookings",), answer=best["id"],
                  checklist=(("Searches the route and day before booking", 1.0),
                             ("Skips flights without enough free seats", 1.0), (f"Books exactly {len(party)} seat(s)", 2.0)))


def earliest(rng: random.Random, difficulty: int) -> Task:
    """Harder levels add a return leg (more calls) and a second passenger."""
    route, days = tuple(rng.sample(AIRPORTS, 2)), rng.sample(DAYS, 2)
    legs = [(route, days[0]), (route[::-1], days[1])][: 1 if difficulty == 1 else 2]
    party = rng.sample(PASSENGERS, 2 if difficulty == 3 else 1)
    s = Script(Travel, {"flights": _flights(rng, 1 + difficulty, legs), "bookings": {}})
    fits = [[f for f in s.world.search_flights(*leg_route, day)["flights"] if f["seats"] >= len(party)] for leg_route, day in legs]
    floor = max(min(f["price"] for f in leg) for leg in fits)
    budget = rng.choice(sorted({f["price"] for leg in fits for f in leg if f["price"] >= floor}))
    chosen = []
    for leg_route, day in legs:
        best = next(f for f in _search(s, leg_route, day) if f["seats"] >= len(party) and f["price"] <= budget)
        chosen.append(best["id"])
        for who in party:
            s("book_flight", flight_id=best["id"], passenger=who)
    back = f", and on the earliest {route[1]} to {route[0]} flight on {days[1]} under the same rules" if len(legs) > 1 else ""
    return s.task(f"Book {' and '.join(party)} on the earliest {route[0]} to {route[1]} flight on {days[0]} that has a free "
                  f"seat for each of them and costs at most {budget}{back}. Tell me the flight id(s).",
                  check=("bookings",), answer=chosen,
                  checklist=(("Compares depart hours, prices and seats from search_flights", 1.0),
                             ("Books the earliest flight within budget on every leg, one seat per passenger", 2.0)))


def rebook(rng: random.Random, difficulty: int) -> Task:
    route, (old_day, new_day) = tuple(rng.sample(AIRPORTS, 2)), rng.sample(DAYS, 2)
    who = rng.choice(PASSENGERS)
    flights = _flights(rng, 1 + difficulty, [(route, old_day), (route, new_day)])
    old_id = next(i for i, f in flights.items() if f["day"] == old_day)
    bookings = {"B1": {"flight_id": old_id, "passenger": who, "price": flights[old_id]["price"], "status": "booked"}}
    s = Script(Travel, {"flights": flights, "bookings": bookings})
    mine = next(b for b in s("list_bookings")["bookings"] if b["passenger"] == who and b["status"] == "booked")
    refund = s("cancel_booking", booking_id=mine["id"])["refund"]
    best = min((f for f in _search(s, route, new_day) if f["seats"]), key=lambda f: f["price"])
    s("book_flight", flight_id=best["id"], passenger=who)
    return s.task(f"{who} has a {route[0]} to {route[1]} booking on {old_day}. Cancel it and book {who} on the cheapest "
                  f"flight with a free seat on the same route on {new_day}. Tell me the refund.",
                  check=("bookings",), answer=refund,
                  checklist=(("Finds the booking id with list_bookings", 1.0), ("Cancels the old booking once", 1.0),
                             ("Books the cheapest flight with a free seat on the new day", 2.0)))


def seats_left(rng: random.Random, difficulty: int) -> Task:
    route, days = tuple(rng.sample(AIRPORTS, 2)), rng.sample(DAYS, difficulty)
    s = Script(Travel, {"flights": _flights(rng, 2, [(route, day) for day in days]), "bookings": {}})
    seats = sum(_search(s, route, day)[0]["seats"] for day in days)
    which = f"on {days[0]}" if difficulty == 1 else f"of each of these days, added up: {', '.join(days)}"
    return s.task(f"How many free seats are left on the earliest {route[0]} to {route[1]} flight {which}?",
                  answer=seats, checklist=(("Searches the route for every day asked", 1.0), ("Books nothing", 1.0)))


Travel.families = (cheapest, earliest, rebook, seats_left)
