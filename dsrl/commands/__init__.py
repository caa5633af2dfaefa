"""The console commands, one module each: dsrl-train (train.py), dsrl-convert, dsrl-eval, dsrl-compare; and
what the comparisons on a CPU share (tiny_runs.py). Commands are leaves: nothing in dsrl imports them."""
