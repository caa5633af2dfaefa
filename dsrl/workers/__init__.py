"""The process pool that rewards and tools share (pool.py). Imports nothing: worker processes start without torch."""
