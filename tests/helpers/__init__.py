"""What several test folders share: runs killed and resumed (``resume``), processes a test starts
(``processes``), the rollout contract (``rollout``), the engines', trainer's and dsrl-eval's set-ups
(``engines``, ``trainer``, ``evaluate``), and the scripts tests start as processes of their own
(``train_worker.py``, ``engines_2ranks_worker.py``, ``stuck_rank_worker.py``)."""
