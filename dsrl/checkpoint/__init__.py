"""Checkpoints: atomic saves (save.py), exact resume (resume.py), resume at another world size through
universal checkpoints (universal.py), and the run folder's lock (run_folder.py)."""
