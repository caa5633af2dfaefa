"""The sizing each recipe's header states (configs/<name>.yaml, "# Sizing") against the memory plan of the header's
own GPU commands on 8 x 141 GiB, as bench/memory_plan.py's ``recipes`` table computes it (``plan_for_config`` with
the model's shape from bench/model_shapes/): every "<phase> ~N GiB", the KV tokens an engine holds ("~N M KV tokens
per engine") and what a step needs ("a step needs N M per engine") within TOLERANCE of the plan's figure.

A header's sizing has one paragraph per command, opened by the model's name (``#   Qwen3-8B ...``); the command's
model (``actor_rollout_ref.model.path``) picks its paragraph and its shape file."""

import re
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dsrl import config as C
from dsrl.plan.inputs import Device
from dsrl.plan.plan import Plan, plan_for_config
from dsrl.plan.shape import GIB
from tests.conftest import write_parquet_stub

REPO = Path(__file__).resolve().parents[2]
SHAPES = REPO / "bench" / "model_shapes"
H200 = Device("cuda", 141 * GIB, "8 x H200")  # bench/memory_plan.py's recipes table
WORLD_SIZE = 8
TOLERANCE = 0.20
COMMAND = re.compile(r"^#   deepspeed --num_gpus 8 scripts/train\.py (.*)$", re.M)
RECIPES = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if COMMAND.search(p.read_text()))
PARAGRAPH = re.compile(r"^#   (Qwen[\w.-]*\w)")
PHASE = re.compile(
    r"\b(rollout|reward|old_log_prob|ref|teacher|values|update_critic|update_actor) ~(\d+(?:\.\d+)?) (GiB|GB)\b"
)
JUDGES = ("reward_model.model.path", "distillation.teacher_models.teacher_model.model_path")
KV_TOKENS = re.compile(r"~(\d+(?:\.\d+)?) M KV tokens per engine")
KV_NEEDED = re.compile(r"\b(?:step|round) needs (\d+(?:\.\d+)?) M per engine")
UNITS = {"GiB": GIB, "GB": 10**9, "M": 10**6}


def header(name: str) -> str:
    """The comment lines that open configs/<name>.yaml."""
    lines = (REPO / "configs" / f"{name}.yaml").read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def sizing_paragraphs(text: str) -> dict[str, str]:
    """The header's sizing paragraphs by model name, each paragraph's lines joined into one."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("# Sizing")), len(lines))
    paragraphs: dict[str, list[str]] = {}
    current = None
    for line in lines[start + 1 :]:
        if opened := PARAGRAPH.match(line):
            current = opened[1]
            paragraphs[current] = []
        if current is not None and line.startswith("#   "):
            paragraphs[current].append(line.removeprefix("#   "))
        else:
            current = None
    return {model: " ".join(words) for model, words in paragraphs.items()}


def stated(paragraph: str) -> list[tuple[str, float, str]]:
    """The figures a paragraph states: (what, value, unit)."""
    figures = [(phase, float(value), unit) for phase, value, unit in PHASE.findall(paragraph)]
    figures += [("KV tokens per engine", float(value), "M") for value in KV_TOKENS.findall(paragraph)]
    figures += [("a step's KV need per engine", float(value), "M") for value in KV_NEEDED.findall(paragraph)]
    return figures


def planned(plan: Plan, what: str) -> int | None:
    """The plan's figure for ``what``: a phase's device bytes per rank, or KV tokens; None for a phase it lacks."""
    if what == "KV tokens per engine":
        return plan.kv.tokens
    if what == "a step's KV need per engine":
        return plan.kv.needed
    return next((phase.device for phase in plan.phases if phase.name == what), None)


def judges_from_shapes(cfg, folder: Path) -> None:
    """The reward model's and the teacher's hub ids swapped for folders holding their shape files as config.json (the
    plan reads each model's own config.json; ``--model-config`` gives the actor's alone)."""
    OmegaConf.set_readonly(cfg, False)
    for key in JUDGES:
        path = OmegaConf.select(cfg, key)
        shape = SHAPES / f"{Path(path).name}.json" if path else None
        if shape is not None and shape.is_file():
            (folder / shape.stem).mkdir(exist_ok=True)
            shutil.copy(shape, folder / shape.stem / "config.json")
            OmegaConf.update(cfg, key, str(folder / shape.stem))
    OmegaConf.set_readonly(cfg, True)


@pytest.fixture
def data_files(tmp_path):
    """The headers' commands name the GSM8K files; the plan reads only their keys, so stubs that validate do."""
    write_parquet_stub(tmp_path / "train.parquet")
    return [f"data.train_files={tmp_path / 'train.parquet'}", "data.val_files=null"]


@pytest.mark.parametrize("name", RECIPES)
def test_the_sizing_in_the_header_is_what_the_plan_computes_for_its_commands(name, data_files, tmp_path):
    text = header(name)
    paragraphs = sizing_paragraphs(text)
    failures = []
    for command in COMMAND.findall(text):
        config, *overrides = command.split()
        cfg, _ = C.load_and_validate([str(REPO / config)], [*overrides, *data_files], WORLD_SIZE)
        model = Path(cfg.actor_rollout_ref.model.path).name
        judges_from_shapes(cfg, tmp_path)
        plan = plan_for_config(cfg, WORLD_SIZE, H200, str(SHAPES / f"{model}.json"))
        where = f"configs/{name}.yaml, {model}"
        figures = stated(paragraphs.pop(model, ""))
        if "update_actor" not in [what for what, _, _ in figures]:
            failures.append(f"{where}: no '#   {model}' sizing paragraph stating 'update_actor ~N GiB'")
        for what, value, unit in figures:
            actual = planned(plan, what)
            if actual is None:
                failures.append(f"{where}: the header sizes phase {what}, which the plan does not have")
                continue
            error = value * UNITS[unit] / actual - 1
            if abs(error) > TOLERANCE:
                failures.append(
                    f"{where}: the header says {what} ~{value:g} {unit}, the plan of its command says "
                    f"{actual / UNITS[unit]:.3g} {unit} ({error:+.0%}, beyond ±{TOLERANCE:.0%})"
                )
    failures += [f"configs/{name}.yaml: a sizing paragraph for {model}, which no command runs" for model in paragraphs]
    assert not failures, "\n".join(failures)


def test_the_recipes_with_gpu_commands_are_found():
    """The parametrization above is not empty by accident: every recipe that ships a sizing is checked."""
    sized = {"dapo", "distill", "grpo", "grpo_lora", "opo", "otb", "ppo", "ppo_rm", "reinforce_pp", "rloo", "tir_otb"}
    assert sized <= set(RECIPES), sorted(sized - set(RECIPES))
