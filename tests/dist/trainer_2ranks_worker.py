"""One rank of a 2-rank training run: the real Trainer, every step's metrics written to rank<N>.json."""

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

cfg, _ = load_and_validate(args.config, args.overrides, int(os.environ["WORLD_SIZE"]))
trainer = Trainer(cfg)
logged = []
trainer.tracker.log_metrics = lambda metrics, step: logged.append({"step": step, "metrics": metrics})
trainer.fit()
report = {"world": trainer.world_size, "logged": logged}
Path(args.out, f"rank{trainer.rank}.json").write_text(json.dumps(report))
