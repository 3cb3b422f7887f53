"""A tiny world for engine tests, loadable as `tests.worlds:Counter` (a user-module world)."""

from envace.envs.base import ToolError, ToolWorld, tool


class Counter(ToolWorld):
    name = "counter"
    description = "A counter. add(n) adds n and returns the new value; get() returns it."
    irreversible_tools = frozenset({"reset_counter"})

    def default_state(self):
        return {"value": 0}

    @tool("Add n to the counter.", {"n": {"type": "integer"}}, ["n"])
    def add(self, n):
        if n < 0:
            raise ToolError("NEGATIVE", "n must be >= 0")
        self.state["value"] += n
        return {"value": self.state["value"]}

    @tool("Read the counter.")
    def get(self):
        return {"value": self.state["value"]}

    @tool("Set the counter to zero.")
    def reset_counter(self):
        self.state["value"] = 0
        return {"value": 0}
