"""Code rewards on a SandboxFusion server, as verl's default scorer gives them with ``reward.sandbox_fusion.url``
set (``verl.utils.reward_score.sandbox_fusion``): for the data sources ``codecontests``, ``apps``, ``codeforces``
and ``taco``, the response's code runs on the server against the ground truth's test cases, and the score is the
fraction of the first 10 cases it passes.

- The code: the text after the response's last `````python`` fence up to the next fence; else the first fenced
  block, without a first line that names a language; a response without a fence scores 0.
- The ground truth: JSON (or a dict) ``{"inputs": [...], "outputs": [...]}``, optionally ``"fn_name"`` (the cases
  call that function, or ``Solution().<fn_name>``, with one JSON argument per line of the input, and print what it
  returns: JSON for a dict, list, tuple, bool or None, ``str`` otherwise; the code runs after verl's prelude, the
  star imports of 18 standard modules) and ``"assert_case"`` (code appended to the response's, one per case; the
  inputs default to empty, the outputs to None).
- A case passes when the server's verdict is ``Success`` with the run ``Finished`` and, unless its output is None,
  stdout equal to ``str(output)``, trailing newlines ignored. Each case runs under verl's limit of 10 s (compile and
  run), in ``python``, the cases of a response concurrently (``reward.sandbox_fusion.max_concurrent`` bounds the
  requests of a rank's reward workers).

Where dsrl departs: a case the server gives no verdict on (unreachable, an HTTP error, a ``SandboxError``), a
ground truth that is not readable test cases, or one without any, fails the row, counted as
``reward/fail_exception`` with the reason, where verl scores such a case or row 0; only the 10 cases that count are
run (verl runs them all and scores the first 10).

The reward workers build the run's client once (:func:`configure`, from ``reward.sandbox_fusion.*``);
``dsrl.rewards.compute_score`` for these data sources and :func:`sandbox_client` in a custom reward function use it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from dsrl.workers.sandbox_fusion import SandboxFusionClient, SandboxRun

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
SCORED_CASES = 10  # verl's continuous score: the pass rate of the first 10 cases
# The fn_name cases' prelude, in verl's order: every star import, then the plain ones.
_PRELUDE_MODULES = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
)
_PRELUDE = "\n".join(
    [f"from {m} import *" for m in (*_PRELUDE_MODULES, "builtins", "typing")]
    + [f"import {m}" for m in _PRELUDE_MODULES]
)
# Calls fn_name with the JSON arguments on stdin (one a line) and prints the result; an error goes to stderr, with
# exit status 0 and nothing on stdout, as verl's wrapper does.
_CALL = """
def _dsrl_call():
    import json as _json, sys as _sys, traceback as _traceback
    _text = _sys.stdin.read()
    try:
        _args = [_json.loads(_line) for _line in _text.split("\\n")] if _text.strip() else []
        if {name!r} in globals():
            _target = globals()[{name!r}]
        elif "Solution" in globals():
            _target = getattr(globals()["Solution"](), {name!r})
        else:
            _sys.stderr.write("function " + {name!r} + " not found\\n")
            return
        _result = _target(*_args)
    except Exception:
        _sys.stderr.write(_traceback.format_exc())
        return
    if _result is None or isinstance(_result, (dict, list, tuple, bool)):
        print(_json.dumps(_result))
    else:
        print(str(_result))


if __name__ == "__main__":
    _dsrl_call()
"""

_client: SandboxFusionClient | None = None


def configure(url: str, max_concurrent: int, memory_limit_mb: int) -> None:
    """Build this process's client of ``reward.sandbox_fusion.*`` (the reward workers call it at start-up)."""
    global _client
    _client = SandboxFusionClient(url, max_concurrent=max_concurrent, memory_limit_mb=memory_limit_mb, name="reward")


def sandbox_client() -> SandboxFusionClient:
    """The client of ``reward.sandbox_fusion.*`` in a reward worker; ValueError with the fix when the url is not set."""
    if _client is None:
        raise ValueError(
            "reward.sandbox_fusion.url is not set, so code cannot be run (dsrl runs no model-written code for a "
            "reward on its own machine); fix: set reward.sandbox_fusion.url to a SandboxFusion server's /run_code URL"
        )
    return _client


def compute_score(solution_str: str, ground_truth, client: SandboxFusionClient) -> float:
    """The fraction of the first ``SCORED_CASES`` test cases of ``ground_truth`` that the code of ``solution_str``
    passes on ``client``'s server (the module doc). ValueError for a ground truth without readable cases;
    SandboxFusionError when the server gives no verdict on a case."""
    code = extract_code(solution_str)
    if code is None:
        return 0.0
    cases = read_test_cases(ground_truth)[:SCORED_CASES]

    def run(case: tuple) -> SandboxRun:
        program, stdin, _ = case
        return client.run_code(program(code), stdin=stdin)  # under the client's default limit, verl's 10 s

    with ThreadPoolExecutor(max_workers=len(cases)) as threads:
        runs = list(threads.map(run, cases))
    passed = sum(_passed(run, expected) for run, (_, _, expected) in zip(runs, cases, strict=True))
    return passed / len(cases)


def extract_code(response: str) -> str | None:
    """The code of ``response`` as verl finds it (the module doc); None without a fence."""
    if "```python" in response:
        return response.rsplit("```python", 1)[1].split("```", 1)[0]
    if "```" not in response:
        return None
    block = response.split("```", 2)[1]
    first_line, newline, rest = block.partition("\n")
    return rest if newline and first_line.strip().isalpha() else block


def read_test_cases(ground_truth) -> list[tuple]:
    """``(program(code) -> str, stdin, expected output or None)`` per case of ``ground_truth`` (JSON or a dict);
    ValueError naming what is wrong."""
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError as exc:
            raise ValueError(f"the ground truth is not JSON test cases ({exc}): {str(ground_truth)[:100]!r}") from None
    if not isinstance(ground_truth, dict):
        raise ValueError(
            f"the ground truth must be {{'inputs': [...], 'outputs': [...]}}, got {type(ground_truth).__name__}"
        )
    asserts = ground_truth.get("assert_case")
    if isinstance(asserts, list):
        inputs = ground_truth.get("inputs", [""] * len(asserts))
        outputs = ground_truth.get("outputs", [None] * len(asserts))
    elif "inputs" in ground_truth and "outputs" in ground_truth:
        inputs, outputs = ground_truth["inputs"], ground_truth["outputs"]
        asserts = [""] * len(inputs) if isinstance(inputs, list) else []
    else:
        raise ValueError(f"the ground truth has no 'inputs' and 'outputs' (keys: {sorted(ground_truth)})")
    if not (isinstance(inputs, list) and isinstance(outputs, list)) or not len(inputs) == len(outputs) == len(asserts):
        raise ValueError(
            "the ground truth's inputs, outputs and assert_case must be lists of one length, got "
            + ", ".join(f"{len(v) if isinstance(v, list) else type(v).__name__}" for v in (inputs, outputs, asserts))
        )
    if not inputs:
        raise ValueError("the ground truth has no test cases")
    fn_name = ground_truth.get("fn_name")

    def program(assert_case: str):
        def build(code: str) -> str:
            code = f"{code}\n\n{assert_case}"
            return f"{_PRELUDE}\n\n{code}\n\n{_CALL.format(name=fn_name)}" if fn_name else code

        return build

    return [
        (program(a), None if stdin is None else str(stdin), expected)
        for a, stdin, expected in zip(asserts, inputs, outputs, strict=True)
    ]


def _passed(run: SandboxRun, expected) -> bool:
    if run.status != "Success" or run.run_status != "Finished":
        return False
    return expected is None or run.stdout.rstrip("\n") == str(expected).rstrip("\n")
