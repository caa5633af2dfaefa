"""One rank of a world of two whose rank 1 gets stuck: rank 0 enters the trainer's phases ``step`` > ``reward``
and all-reduces there, over a process group made by ``init_distributed(timeout_s)``. It prints what scripts/train.py
would print for the error it gets, and how long it waited; rank 1 sleeps past the timeout.

    python tests/helpers/stuck_rank_worker.py TIMEOUT_S SLEEP_S   (RANK, WORLD_SIZE=2, MASTER_ADDR/PORT set)
"""

import os
import sys
import time

import torch

from dsrl.engines import init_distributed
from dsrl.runtime.distributed import all_reduce, collective_timeout_message, leave_timed_out_group
from dsrl.runtime.phases import PhaseTimer

timeout_s, sleep_s = int(sys.argv[1]), float(sys.argv[2])
init_distributed(timeout_s)
all_reduce(torch.ones(1))  # both ranks are up
if os.environ["RANK"] == "1":
    time.sleep(sleep_s)
    sys.exit(0)
timer = PhaseTimer()
start = time.monotonic()
try:
    with timer("step"), timer("reward"):
        all_reduce(torch.ones(1))
except RuntimeError as err:
    print(f"waited {time.monotonic() - start:.1f} s; dsrl: {collective_timeout_message(err)}", flush=True)
    leave_timed_out_group()  # as scripts/train.py does
    sys.exit(1)
