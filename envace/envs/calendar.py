"""Calendar: one work week of events in whole hours, with a documented conflict rule."""

from __future__ import annotations

import random
from typing import Any

from envace.envs._common import Script, World, arg, lookup, next_id, ordered
from envace.envs.base import WORLDS, ToolError, tool
from envace.types import Task

DAYS = ("mon", "tue", "wed", "thu", "fri")
OPEN, CLOSE = 9, 18
TITLES = ("standup", "review", "lunch", "planning", "demo", "sync", "retro", "interview", "gym", "training")
DAY = arg("string", enum=list(DAYS))


def clash(events: dict[str, Any], day: str, start: int, end: int, skip: str | None = None) -> str | None:
    """Id of the first active event on `day` overlapping [start, end), ignoring `skip`."""
    return next((i for i, e in ordered(events) if i != skip and e["status"] == "active" and e["day"] == day
                 and start < e["end"] and e["start"] < end), None)


def free_slot(events: dict[str, Any], day: str, duration: int) -> int | None:
    return next((h for h in range(OPEN, CLOSE - duration + 1) if clash(events, day, h, h + duration) is None), None)


def _view(event_id: str, event: dict[str, Any]) -> dict[str, Any]:
    return {"day": event["day"], "end": event["end"], "id": event_id, "start": event["start"], "title": event["title"]}


@WORLDS.register("calendar")
class Calendar(World):
    name = "calendar"
    description = (
        "Work calendar for one week: days mon, tue, wed, thu, fri; whole hours from 9 to 18 (an event from 9 to 10 "
        "lasts one hour). Event ids are E<n>: a new event gets E<number of events ever created + 1>; cancelled "
        "events keep their id. Two active events on the same day conflict when they overlap (start < other end "
        "and other start < end); create_event and move_event then fail with CONFLICT naming the other event. "
        "find_free_slot gives the earliest start hour from 9 where an event of that many hours fits, ending by 18 "
        "(NO_SLOT otherwise). list_events lists a day's active events by start hour. move_event keeps the duration. "
        "cancel_event cannot be undone. Times outside 9-18 or end <= start give INVALID_TIME; unknown ids NOT_FOUND; "
        "cancelled events CANCELLED."
    )
    irreversible_tools = frozenset({"cancel_event"})

    def default_state(self) -> dict[str, Any]:
        return {"events": {}}

    def _active(self, event_id: str) -> dict[str, Any]:
        event = lookup(self.state["events"], event_id, "event")
        if event["status"] != "active":
            raise ToolError("CANCELLED", f"{event_id} is cancelled")
        return event

    def _check_free(self, day: str, start: int, end: int, skip: str | None = None) -> None:
        if not OPEN <= start < end <= CLOSE:
            raise ToolError("INVALID_TIME", f"{start}-{end} is not within {OPEN}-{CLOSE} with end after start")
        other = clash(self.state["events"], day, start, end, skip)
        if other:
            e = self.state["events"][other]
            raise ToolError("CONFLICT", f"clashes with {other} {e['title']} {e['start']}-{e['end']}")

    @tool("A day's active events by start hour.", {"day": DAY}, ["day"])
    def list_events(self, day: str) -> dict[str, Any]:
        events = [_view(i, e) for i, e in ordered(self.state["events"]) if e["day"] == day and e["status"] == "active"]
        return {"day": day, "events": sorted(events, key=lambda e: e["start"])}

    @tool("Earliest start hour on a day where an event of this many hours fits.",
          {"day": DAY, "duration": arg("integer", "hours", minimum=1, maximum=CLOSE - OPEN)}, ["day", "duration"])
    def find_free_slot(self, day: str, duration: int) -> dict[str, Any]:
        start = free_slot(self.state["events"], day, duration)
        if start is None:
            raise ToolError("NO_SLOT", f"no free {duration}-hour slot on {day}")
        return {"day": day, "end": start + duration, "start": start}

    @tool("Create an event.", {"title": arg("string"), "day": DAY, "start": arg("integer", "hour"), "end": arg("integer", "hour")},
          ["title", "day", "start", "end"])
    def create_event(self, title: str, day: str, start: int, end: int) -> dict[str, Any]:
        self._check_free(day, start, end)
        event_id = next_id(self.state["events"], "E")
        self.state["events"][event_id] = {"day": day, "end": end, "start": start, "status": "active", "title": title}
        return _view(event_id, self.state["events"][event_id])

    @tool("Move an event to a day and start hour, keeping its duration.",
          {"event_id": arg("string"), "day": DAY, "start": arg("integer", "hour")}, ["event_id", "day", "start"])
    def move_event(self, event_id: str, day: str, start: int) -> dict[str, Any]:
        event = self._active(event_id)
        end = start + event["end"] - event["start"]
        self._check_free(day, start, end, skip=event_id)
        event.update(day=day, start=start, end=end)
        return _view(event_id, event)

    @tool("Cancel an event. Cannot be undone.", {"event_id": arg("string")}, ["event_id"])
    def cancel_event(self, event_id: str) -> dict[str, Any]:
        self._active(event_id)["status"] = "cancelled"
        return {"cancelled": event_id}

    @classmethod
    def facts(cls, state: dict[str, Any]) -> str:
        events = "; ".join(f"{i} {e['title']} {e['day']} {e['start']}-{e['end']}" + ("" if e["status"] == "active" else " cancelled")
                           for i, e in ordered(state["events"]))
        return f"My events: {events or 'none'}."


# ---- task families -------------------------------------------------------------------------

def _place(rng: random.Random, events: dict[str, Any], day: str, title: str) -> None:
    """Add a 1-2 hour event at a random free time of `day`, keeping each day at most 6 hours busy."""
    busy = sum(e["end"] - e["start"] for e in events.values() if e["day"] == day)
    options = [(h, h + d) for d in (1, 2) for h in range(OPEN, CLOSE - d + 1)
               if busy + d <= 6 and clash(events, day, h, h + d) is None]
    if options:
        start, end = rng.choice(options)
        events[next_id(events, "E")] = {"day": day, "end": end, "start": start, "status": "active", "title": title}


def _week(rng: random.Random, n: int, days: tuple[str, ...] = DAYS, fixed: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """The `fixed` (day, title) events, then n more with distinct titles on the given days; ids shuffled."""
    events: dict[str, Any] = {}
    taken = {title for _, title in fixed}
    extra = [(rng.choice(days), title) for title in rng.sample([t for t in TITLES if t not in taken], n)]
    for day, title in (*fixed, *extra):
        _place(rng, events, day, title)
    return {f"E{i}": e for i, e in enumerate(rng.sample(list(events.values()), len(events)), 1)}


def _find(s: Script, day: str, title: str) -> dict[str, Any]:
    """Reference step: list the day and pick the event by title."""
    return next(e for e in s("list_events", day=day)["events"] if e["title"] == title)


def book(rng: random.Random, difficulty: int) -> Task:
    day = rng.choice(DAYS)
    events = _week(rng, 2 + 2 * difficulty, (day, day, rng.choice(DAYS)))  # the asked day is busier
    duration = next(d for d in (rng.randint(1, 3), 1) if free_slot(events, day, d) is not None)
    title = rng.choice([t for t in TITLES if all(e["title"] != t for e in events.values())])
    s = Script(Calendar, {"events": events})
    slot = s("find_free_slot", day=day, duration=duration)
    s("create_event", title=title, day=day, start=slot["start"], end=slot["end"])
    return s.task(f"Book a {duration}-hour '{title}' on {day} at the earliest free time. Tell me the start hour.",
                  check=("events",), answer=slot["start"],
                  checklist=(("Uses find_free_slot or the day's events to find the earliest free time", 1.0),
                             (f"Creates exactly one '{title}' event of {duration} hours", 2.0)))


def cancel(rng: random.Random, difficulty: int) -> Task:
    title = rng.choice(TITLES)
    days = rng.sample(DAYS, 1 if difficulty < 3 else 3)
    s = Script(Calendar, {"events": _week(rng, 2 * difficulty, fixed=tuple((day, title) for day in days))})
    if difficulty < 3:
        s("cancel_event", event_id=_find(s, days[0], title)["id"])
        request = f"Cancel my '{title}' on {days[0]}."
    else:  # the title recurs: every day must be checked
        for day in DAYS:
            for event in s("list_events", day=day)["events"]:
                if event["title"] == title:
                    s("cancel_event", event_id=event["id"])
        request = f"Cancel every '{title}' event this week."
    return s.task(request, check=("events",), checklist=(("Looks the event ids up with list_events", 1.0),
                                                         (f"Cancels exactly the '{title}' events asked for", 3.0)))


def move(rng: random.Random, difficulty: int) -> Task:
    source, target = rng.sample(DAYS, 2)
    title = rng.choice(TITLES)
    events = _week(rng, 2 * difficulty, (target, target, source), fixed=((source, title),))
    duration = next(e["end"] - e["start"] for e in events.values() if e["title"] == title)
    target = next(d for d in (target, *DAYS) if d != source and free_slot(events, d, duration) is not None)
    wanted = rng.randint(OPEN, CLOSE - duration)
    s = Script(Calendar, {"events": events})
    event_id = _find(s, source, title)["id"]
    start = wanted
    if any(wanted < e["end"] and e["start"] < wanted + duration for e in s("list_events", day=target)["events"]):
        start = s("find_free_slot", day=target, duration=duration)["start"]
    s("move_event", event_id=event_id, day=target, start=start)
    return s.task(f"Move my '{title}' from {source} to {target} starting at {wanted}. If that time is taken, "
                  f"move it to the earliest free slot on {target} instead.", check=("events",),
                  checklist=(("Checks the target day's events before moving", 1.0),
                             ("Keeps the duration and only falls back to the earliest free slot on a clash", 2.0),
                             ("Moves the event instead of cancelling and re-creating it", 1.0)))


def hours(rng: random.Random, difficulty: int) -> Task:
    days = tuple(rng.sample(DAYS, 1 if difficulty < 3 else 2))
    s = Script(Calendar, {"events": _week(rng, 2 + difficulty, days + (rng.choice(DAYS),))})
    busy = sum(e["end"] - e["start"] for day in days for e in s("list_events", day=day)["events"])
    return s.task(f"How many hours of events do I have on {' and '.join(days)}?", answer=busy,
                  checklist=((f"Lists the events of {' and '.join(days)}", 1.0), ("Adds up end - start of each event", 2.0)))


Calendar.families = (book, cancel, move, hours)
