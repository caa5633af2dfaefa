"""Data: the batch contract (``batch.py``), prompt parquet files (``datasets.py``), and the synthetic
arithmetic task (``arithmetic.py``)."""
