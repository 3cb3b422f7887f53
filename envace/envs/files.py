"""Files: a small flat-mapped file system (path -> text) with folders implied by paths."""

from __future__ import annotations

import json
import random
from typing import Any

from envace.envs._common import Script, World, arg, lookup
from envace.envs.base import WORLDS, ToolError, tool
from envace.types import Task

SETTINGS = {
    "port": ("5432", "6379", "8080", "9090"), "host": ("db-main", "cache-02", "api-eu7"),
    "region": ("eu-west", "us-east", "ap-south"), "level": ("debug", "warning"),
    "owner": ("team-blue", "team-red"), "timeout": ("30s", "45s", "90s"),
}
APPS = ("web", "db", "cache", "mail", "auth")
NAMES = ("alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega")
WORDS = ("plan", "budget", "notes", "ideas", "review", "summary")


def _file_path(path: str) -> str:
    if not path.startswith("/") or path.endswith("/"):
        raise ToolError("INVALID_PATH", f"{path!r}: a file path starts with '/' and does not end with '/'")
    return path


@WORLDS.register("files")
class Files(World):
    name = "files"
    description = (
        "A small file system. Paths are absolute, like /docs/plan; folders exist while they hold files. "
        "list_dir gives the names directly inside a folder, sorted, with sub-folders ending in '/' (NOT_FOUND "
        "for a folder with no files; / always exists). read_file returns the text. write_file creates or replaces "
        "a file and returns its size in characters. move renames a file to a new full path and fails with EXISTS "
        "if that path is taken. delete_file removes a file and cannot be undone. search lists, sorted, the paths of "
        "files whose text contains the given text (case-sensitive). Missing files give NOT_FOUND; a file path must "
        "start with '/' and not end with '/' (INVALID_PATH)."
    )
    irreversible_tools = frozenset({"delete_file"})

    def default_state(self) -> dict[str, Any]:
        return {"files": {}}

    @tool("Names directly inside a folder.", {"path": arg("string", "folder, e.g. /docs")}, ["path"])
    def list_dir(self, path: str) -> dict[str, Any]:
        if not path.startswith("/"):
            raise ToolError("INVALID_PATH", f"{path!r}: a folder path starts with '/'")
        folder = path.rstrip("/") or "/"
        prefix = folder.rstrip("/") + "/"
        entries = set()
        for file_path in self.state["files"]:
            if file_path.startswith(prefix):
                head, sep, _ = file_path[len(prefix):].partition("/")
                entries.add(head + sep)
        if not entries and folder != "/":
            raise ToolError("NOT_FOUND", f"no folder {folder!r}")
        return {"entries": sorted(entries), "path": folder}

    @tool("Read a file.", {"path": arg("string")}, ["path"])
    def read_file(self, path: str) -> dict[str, Any]:
        return {"content": lookup(self.state["files"], _file_path(path), "file"), "path": path}

    @tool("Create or replace a file.", {"path": arg("string"), "content": arg("string")}, ["path", "content"])
    def write_file(self, path: str, content: str) -> dict[str, Any]:
        self.state["files"][_file_path(path)] = content
        return {"path": path, "size": len(content)}

    @tool("Move or rename a file.", {"source": arg("string"), "destination": arg("string", "new full path")},
          ["source", "destination"])
    def move(self, source: str, destination: str) -> dict[str, Any]:
        content = lookup(self.state["files"], _file_path(source), "file")
        if _file_path(destination) in self.state["files"]:
            raise ToolError("EXISTS", f"{destination!r} already exists")
        del self.state["files"][source]
        self.state["files"][destination] = content
        return {"destination": destination, "source": source}

    @tool("Delete a file. Cannot be undone.", {"path": arg("string")}, ["path"])
    def delete_file(self, path: str) -> dict[str, Any]:
        lookup(self.state["files"], _file_path(path), "file")
        del self.state["files"][path]
        return {"deleted": path}

    @tool("Paths of files whose text contains the given text.", {"text": arg("string")}, ["text"])
    def search(self, text: str) -> dict[str, Any]:
        return {"paths": sorted(p for p, content in self.state["files"].items() if text in content)}

    @classmethod
    def facts(cls, state: dict[str, Any]) -> str:
        return "Files: " + "; ".join(f"{p} = {json.dumps(c)}" for p, c in sorted(state["files"].items())) + "."


# ---- task families -------------------------------------------------------------------------
# File names never contain '.': success-spec paths are dot-separated (files./etc/web).

def _configs(rng: random.Random, n: int) -> dict[str, str]:
    """n config files under /etc; every setting key appears in one file only, so search finds it."""
    keys = rng.sample(sorted(SETTINGS), n)
    return {f"/etc/{app}": f"{key}={rng.choice(SETTINGS[key])}\nmode=on" for app, key in zip(rng.sample(APPS, n), keys)}


def lookup_setting(rng: random.Random, difficulty: int) -> Task:
    files = _configs(rng, 2 + difficulty)
    path = rng.choice(sorted(files))
    key, value = files[path].splitlines()[0].split("=")
    s = Script(Files, {"files": files})
    if difficulty == 1:
        request = f"What is {key} set to in {path}?"
    else:
        request = f"One file under /etc sets {key}. What is its value?"
        path = s("search", text=f"{key}=")["paths"][0]
    s("read_file", path=path)
    if difficulty == 3:
        request += f" Also save just the value to /notes/{key}."
        s("write_file", path=f"/notes/{key}", content=value)
    return s.task(request, check=("files",) if difficulty == 3 else (), answer=value, candidates=SETTINGS[key],
                  checklist=(("Reads the file that sets the key instead of guessing", 2.0),))


def cleanup(rng: random.Random, difficulty: int) -> Task:
    names = rng.sample(NAMES, 2 + difficulty)
    files = {f"/tmp/{n}": f"{'DRAFT ' if i < difficulty else 'final '}{rng.choice(WORDS)}" for i, n in enumerate(names)}
    if difficulty > 1:  # a DRAFT outside /tmp that must survive
        files[f"/docs/{rng.choice(WORDS)}"] = f"DRAFT {rng.choice(WORDS)}"
    s = Script(Files, {"files": files})
    for path in s("search", text="DRAFT")["paths"]:
        if path.startswith("/tmp/"):
            s("delete_file", path=path)
    return s.task("Delete every file in /tmp whose text contains DRAFT. Leave all other files alone.",
                  check=("files",), checklist=(("Finds the DRAFT files with search or by reading them", 1.0),
                                               ("Deletes exactly the /tmp files containing DRAFT", 3.0)))


def archive(rng: random.Random, difficulty: int) -> Task:
    names = rng.sample(NAMES, 1 + difficulty)
    n_invoices = rng.randint(1, difficulty)
    files = {f"/inbox/{n}": f"{'invoice' if i < n_invoices else 'memo'} {rng.randrange(10, 999)}" for i, n in enumerate(names)}
    files["/archive/old"] = f"invoice {rng.randrange(10, 999)}"
    s = Script(Files, {"files": files})
    for name in s("list_dir", path="/inbox")["entries"]:
        if s("read_file", path=f"/inbox/{name}")["content"].startswith("invoice"):
            s("move", source=f"/inbox/{name}", destination=f"/archive/{name}")
    return s.task("Move every file in /inbox whose text starts with 'invoice' into /archive, keeping its name.",
                  check=("files",), checklist=(("Lists /inbox and reads each file", 1.0),
                                               ("Moves exactly the invoice files, keeping their names", 3.0)))


def total_numbers(rng: random.Random, difficulty: int) -> Task:
    files = {f"/data/{n}": str(rng.randrange(1, 500)) for n in rng.sample(NAMES, 1 + difficulty)}
    files[f"/docs/{rng.choice(WORDS)}"] = str(rng.randrange(1, 500))  # outside /data: must not be counted
    s = Script(Files, {"files": files})
    numbers = [int(s("read_file", path=f"/data/{name}")["content"]) for name in s("list_dir", path="/data")["entries"]]
    return s.task("Each file in /data holds one number. What is their sum?", answer=sum(numbers),
                  checklist=(("Lists /data and reads every file in it", 2.0), ("Does not change any file", 1.0)))


Files.families = (lookup_setting, cleanup, archive, total_numbers)
