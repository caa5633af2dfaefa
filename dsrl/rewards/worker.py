"""The reward worker process of :class:`dsrl.rewards.RewardScorer`.

``python -m dsrl.rewards.worker FD [PATH NAME]``: FD is this end of the pipe; PATH/NAME name a
custom reward function (else the built-in ``dsrl.rewards.compute_score``). Sends ``("ready", None)``
or ``("failed", message)`` once, then for each received list of
``(data_source, solution_str, ground_truth, extra_info)`` calls sends one ``("ok", result)`` or
``("error", message)`` per call, in order. Exits when the parent closes the pipe.
"""

import signal
import sys
import traceback
from multiprocessing.connection import Connection

from dsrl.rewards import compute_score, load_custom_reward_function


def main(argv: list[str]) -> int:
    # Ctrl-C belongs to the trainer; the worker ends when the trainer closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    try:
        fn = load_custom_reward_function(argv[1], argv[2]) if len(argv) > 1 else compute_score
    except ValueError as exc:
        conn.send(("failed", str(exc)))
        return 1
    except Exception:
        conn.send(("failed", f"custom_reward_function.path={argv[1]!r}: importing it raised\n{traceback.format_exc()}"))
        return 1
    conn.send(("ready", None))
    while True:
        try:
            calls = conn.recv()
        except EOFError:
            return 0
        for data_source, solution_str, ground_truth, extra_info in calls:
            try:
                reply = (
                    "ok",
                    fn(
                        data_source=data_source,
                        solution_str=solution_str,
                        ground_truth=ground_truth,
                        extra_info=extra_info,
                    ),
                )
            except Exception as exc:
                reply = ("error", f"{type(exc).__name__}: {exc}")
            try:
                conn.send(reply)
            except OSError:
                return 0  # the trainer is gone
            except Exception as exc:  # the result could not be pickled
                conn.send(("error", f"the reward function returned an unpicklable {type(reply[1]).__name__}: {exc}"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
