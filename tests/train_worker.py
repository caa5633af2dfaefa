"""One rank of a training run (hf or vLLM rollout): the real Trainer; every logged step's metrics go
to ``<out>/rank<N>.json``. Runs alone (a world of one) or under the deepspeed launcher."""

import argparse
import json
import os
from pathlib import Path

from dsrl.config import load_and_validate
from dsrl.trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int)
parser.add_argument("config")
parser.add_argument("overrides", nargs="*")
args = parser.parse_args()

cfg, _ = load_and_validate(args.config, args.overrides, int(os.environ.get("WORLD_SIZE", "1")))
trainer = Trainer(cfg)
logged = []
trainer.tracker.log_metrics = lambda metrics, step: logged.append({"step": step, "metrics": metrics})
trainer.fit()
llm = getattr(trainer.rollout, "llm", None)
tp = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size if llm is not None else None
report = {"world": trainer.world_size, "rollout": type(trainer.rollout).__name__, "tp": tp, "logged": logged}
Path(args.out, f"rank{trainer.rank}.json").write_text(json.dumps(report))
