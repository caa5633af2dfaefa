"""The training loop (loop.py) and what only the loop calls: setup, batches, validation, balance, dynamic sampling,
scoring, metrics, run-stopping checks, start-up facts and the preflight."""
