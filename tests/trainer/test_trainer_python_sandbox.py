"""The python tool's sandbox in a real 2-step run (HF rollout, ZeRO-3 + offload): the security review's rollout
cases (security_3.md, R1-R7 of section A) through dsrl's own tool path, with this process as the trainer.

The tiny tool model cannot write code, so a test double of the model replaces the parse of its turns (as the
review's harness did): a turn in which it wrote a tool call is read as a ``python`` call whose code tries the
escapes at once (the trainer's tokens in /proc, the training labels, a file in the run folder, the network,
a signal to the trainer and to a process of the host, the trainer's console, a process that outlives the
call). Everything after the parse (the tool workers, the sandbox, the chat template, scoring) is dsrl's. A
wrapper around ``ToolSet.run`` only records what the calls returned."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import live, with_argument

pytestmark = pytest.mark.e2e

SECRET = "hf_FAKEsecretTOKEN1234567890"
ESCAPES = """
import os, signal, socket, sys

def attempt(name, action):
    try:
        action()
        print(name, "DONE")
    except Exception as exc:
        print(name, "blocked", type(exc).__name__)

tokens = []
for pid in os.listdir("/proc"):
    try:
        tokens += [e for e in open(f"/proc/{{pid}}/environ", "rb").read().split(b"\\0") if b"HF_TOKEN" in e]
    except OSError:
        pass
print("tokens", tokens)
attempt("labels", lambda: open({labels!r}).read())
attempt("run-folder", lambda: open({run_folder!r} + "/written_by_model_code.txt", "w").write("x"))
attempt("network", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2))
attempt("trainer", lambda: os.kill({trainer}, 0))
attempt("console", lambda: open("/proc/{trainer}/fd/1", "w").write("status: finished (SPOOFED BY TOOL CODE)"))
attempt("victim", lambda: os.kill({victim}, signal.SIGKILL))
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}])
    os._exit(0)
print("end")
"""
BLOCKED = ("labels", "run-folder", "network", "trainer", "console", "victim")


def test_model_written_code_in_a_real_run_is_contained(
    tool_model_dir, calculator_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path, monkeypatch
):
    import dsrl.rollout.multi_turn as multi_turn
    from dsrl.rollout.tools import ToolCall, ToolSet
    from tests.helpers.trainer import trainer_for

    monkeypatch.setenv("HF_TOKEN", SECRET)  # the trainer's, so its tool workers' too
    run_folder = tmp_path / "run"
    marker = f"outlived-{os.getpid()}-{time.monotonic_ns()}"
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    code = ESCAPES.format(
        labels=str(calculator_data / "train.parquet"),
        run_folder=str(run_folder),
        port=listener.getsockname()[1],
        trainer=os.getpid(),
        victim=victim.pid,
        marker=marker,
    )

    parse = multi_turn.parse_tool_calls

    def the_model_writes_escapes(text, format="hermes"):  # the test double of the model
        calls, errors = parse(text, format)
        return ([ToolCall("python", {"code": code})], []) if calls or errors else (calls, errors)

    monkeypatch.setattr(multi_turn, "parse_tool_calls", the_model_writes_escapes)
    results = []
    run = ToolSet.run

    def recorded(self, requests):
        answers = run(self, requests)
        results.extend(answers)
        return answers

    monkeypatch.setattr(ToolSet, "run", recorded)
    reward = tmp_path / "reward.py"
    reward.write_text("from dsrl.rewards import compute_score  # the calculator task's rule\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: dsrl:calculator\n  - class_name: dsrl:python\n")
    try:
        trainer = trainer_for(
            "grpo",
            tool_model_dir,
            calculator_data,
            ds_test_config,
            run_folder,
            f"actor_rollout_ref.model.path={tool_model_dir}",
            f"custom_reward_function.path={reward}",
            "data.max_prompt_length=40",
            "data.max_response_length=160",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=2000",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
        )
        logged = []
        trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
        trainer.fit()

        assert len([m for _, m in logged if "actor/grad_norm" in m]) == 2  # the run went on to its end
        assert results, "the model wrote no tool call in two steps"
        for result in results:
            assert result.failure is None and result.text.startswith("tokens []\n"), result.text
            assert [f"{name} blocked" in result.text for name in BLOCKED] == [True] * len(BLOCKED), result.text
            assert result.text.endswith("end\n") and SECRET not in result.text
        assert not (run_folder / "written_by_model_code.txt").exists()
        assert live([victim.pid]) == [victim.pid]
        with pytest.raises(TimeoutError):
            listener.accept()
        assert with_argument(marker) == []
    finally:
        listener.close()
        victim.kill()
        victim.wait()
        for pid in with_argument(marker):
            os.kill(pid, 9)
