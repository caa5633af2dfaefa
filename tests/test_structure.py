"""The house's floor plan as a test: every module in a room, no module too long, imports one way.

The rules (docs/architecture.md draws them): commands are leaves that only ``python -m dsrl`` imports; only
commands import the trainer's room, and only ``dsrl-train`` imports the loop; engines import no rollout code;
rollout code imports no reward code (tools share ``workers/``); runtime, workers and algorithms import nothing
of dsrl outside their room; the lower floors (config, plan, rewards, workers, runtime) know no model code; data
and tracking know no engine or rollout; and no import cycle, between rooms or between modules. Each rule is also
checked against an import it must refuse, so that none of them can pass vacuously.

The tests' floor plan mirrors the package's: each test sits in the folder of the room it tests (tests/config/ for
dsrl/config/), except the shared helpers, the docs test and the two tiers that run in environments of their own;
tiers are markers, not folders.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from tests.conftest import REPO

PACKAGE = REPO / "dsrl"
MAX_LINES = 900
ROOT_MODULES = {"__init__.py", "__main__.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
COMMANDS = {
    target.partition(":")[0]
    for target in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"].values()
}


def room(module: str) -> str:
    """``dsrl.trainer.loop`` -> ``trainer``; the package's own ``__init__`` and ``__main__`` -> ``dsrl``."""
    parts = module.split(".")
    return "dsrl" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


def imported(path: Path, *, top_level_only: bool) -> set[str]:
    """The dsrl modules ``path`` imports (``from pkg import sub`` counts as ``pkg.sub`` when that is a module).
    ``top_level_only``: what runs at import time (module body, incl. if/try blocks), not imports inside functions."""
    tree = ast.parse(path.read_text())
    if top_level_only:
        nodes = [
            n
            for stmt in tree.body
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for n in ast.walk(stmt)
        ]
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "dsrl":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "dsrl"}
    return found


@dataclass(frozen=True)
class Rule:
    why: str
    breaks: Callable[[str, str], bool]  # (importer, imported) -> the import breaks the rule


def _in(module: str, *rooms: str) -> bool:
    return room(module) in rooms


LOWER_FLOORS = ("config", "plan", "rewards", "workers", "runtime")
RULES = [
    Rule(
        "a command is imported by nothing but python -m dsrl (commands are leaves)",
        lambda src, dst: dst in COMMANDS and src != "dsrl.__main__",
    ),
    Rule(
        "only commands import the trainer's room",
        lambda src, dst: _in(dst, "trainer") and not _in(src, "trainer", "commands"),
    ),
    Rule(
        "only dsrl-train imports the loop", lambda src, dst: dst == "dsrl.trainer.loop" and src != "dsrl.commands.train"
    ),
    Rule("engines import no rollout code", lambda src, dst: _in(src, "engines") and _in(dst, "rollout")),
    Rule(
        "rollout code imports no reward code (tools share workers/)",
        lambda src, dst: _in(src, "rollout") and _in(dst, "rewards"),
    ),
    Rule(
        "runtime imports nothing of dsrl outside runtime/ (config sits above it)",
        lambda src, dst: _in(src, "runtime") and not _in(dst, "runtime"),
    ),
    Rule(
        "workers/ imports nothing of dsrl outside workers/ (worker processes start without torch)",
        lambda src, dst: _in(src, "workers") and not _in(dst, "workers"),
    ),
    Rule(
        "algorithms are pure torch: they import nothing of dsrl outside algorithms/",
        lambda src, dst: _in(src, "algorithms") and not _in(dst, "algorithms"),
    ),
    Rule(
        "the lower floors know no model code",
        lambda src, dst: _in(src, *LOWER_FLOORS) and _in(dst, "algorithms", "engines", "rollout"),
    ),
    Rule(
        "data and tracking know no engine or rollout",
        lambda src, dst: _in(src, "data", "tracking") and _in(dst, "engines", "rollout"),
    ),
]


def broken_rules(edges: set[tuple[str, str]]) -> list[str]:
    return sorted(f"{src} -> {dst}: {rule.why}" for src, dst in edges for rule in RULES if rule.breaks(src, dst))


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        if src != dst:
            graph.setdefault(src, set()).add(dst)
            graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


ALL_IMPORTS = {(src, dst) for src, path in MODULES.items() for dst in imported(path, top_level_only=False)}
IMPORT_TIME = {(src, dst) for src, path in MODULES.items() for dst in imported(path, top_level_only=True)}


def room_edges(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(room(src), room(dst)) for src, dst in edges if room(src) != room(dst)}


def test_the_package_root_holds_only_the_entry_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ROOT_MODULES)
    assert loose == [], f"modules at the root of dsrl/: move each into the room its role names: {loose}"


def test_no_module_is_longer_than_the_limit():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: split them by concern: {long}"


def test_every_command_of_the_package_is_in_the_commands_room():
    assert COMMANDS and all(room(command) == "commands" and command in MODULES for command in COMMANDS), COMMANDS


def test_imports_point_one_way():
    assert broken_rules(ALL_IMPORTS) == []


def test_rooms_import_each_other_without_a_cycle():
    assert cycles(room_edges(ALL_IMPORTS)) == []


def test_modules_import_each_other_without_a_cycle_at_import_time():
    assert cycles(IMPORT_TIME) == []


BAD_IMPORTS = [
    ("dsrl.trainer.loop", "dsrl.commands.evaluate"),
    ("dsrl.commands.compare", "dsrl.commands.train"),
    ("dsrl.checkpoint.save", "dsrl.trainer.metrics"),
    ("dsrl.commands.evaluate", "dsrl.trainer.loop"),
    ("dsrl.engines.actor", "dsrl.rollout.base"),
    ("dsrl.rollout.tools.worker", "dsrl.rewards.worker"),
    ("dsrl.runtime.launch", "dsrl.config.schema"),
    ("dsrl.workers.pool", "dsrl.rewards.worker"),
    ("dsrl.algorithms.losses", "dsrl.config.schema"),
    ("dsrl.plan.plan", "dsrl.engines.forward"),
    ("dsrl.tracking.console", "dsrl.rollout.base"),
]


@pytest.mark.parametrize(("src", "dst"), BAD_IMPORTS)
def test_each_rule_refuses_an_import_that_breaks_it(src, dst):
    assert src in MODULES and dst in MODULES, (src, dst)
    assert broken_rules({(src, dst)}), f"{src} -> {dst} passed every rule"


def test_every_rule_is_exercised_by_a_refused_import():
    exercised = {rule.why for rule in RULES for src, dst in BAD_IMPORTS if rule.breaks(src, dst)}
    assert exercised == {rule.why for rule in RULES}


def test_a_cycle_is_found_between_rooms_and_between_modules():
    assert cycles(room_edges(ALL_IMPORTS | {("dsrl.config.schema", "dsrl.trainer.loop")})) != []
    assert cycles(IMPORT_TIME | {("dsrl.runtime.launch", "dsrl.commands.train")}) != []


TESTS = REPO / "tests"
# Folders of tests/ that are no room: shared helpers, the docs test, and the tiers that run in environments of their
# own (.ci/vllm_tier.sh, .ci/verl_tier.sh). What is inside them is free.
NOT_ROOMS = {"helpers", "docs", "vllm", "verl"}
ROOT_FILES = {"__init__.py", "conftest.py", "test_structure.py"}


def unmirrored_folders(tests: Path) -> list[str]:
    """The folders under ``tests`` that are neither one of ``NOT_ROOMS`` nor the same place as a package folder of
    dsrl/ (tests/config/ for dsrl/config/, tests/rollout/tools/ for dsrl/rollout/tools/)."""
    found = []
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir()):
        parts = folder.relative_to(tests).parts
        if parts[0] in NOT_ROOMS or any(part == "__pycache__" or part.startswith(".") for part in parts):
            continue
        if not PACKAGE.joinpath(*parts, "__init__.py").is_file():
            found.append("/".join(parts))
    return found


def loose_files(tests: Path) -> list[str]:
    """The Python files at the top of ``tests`` other than the package marker, the fixtures and this file."""
    return sorted(p.name for p in tests.glob("*.py") if p.name not in ROOT_FILES)


def test_the_test_folders_mirror_the_package():
    assert unmirrored_folders(TESTS) == [], "folders of tests/ that are no room of dsrl/: move each test to its room"
    assert loose_files(TESTS) == [], "files loose in tests/: a test goes to its room's folder, a helper to helpers/"


@pytest.mark.parametrize("stray", ["unit", "integration", "dist", "trainers", "config/late_errors"])
def test_a_test_folder_that_mirrors_no_room_is_found(stray, tmp_path):
    for folder in ("config", "rollout/tools", "helpers/anything", stray):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    assert unmirrored_folders(tmp_path) == [stray]


@pytest.mark.parametrize("loose", ["test_trainer.py", "resume_helpers.py"])
def test_a_file_loose_in_tests_is_found(loose, tmp_path):
    for name in (*ROOT_FILES, loose):
        (tmp_path / name).touch()
    assert loose_files(tmp_path) == [loose]
