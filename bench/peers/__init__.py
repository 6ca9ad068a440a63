"""Drivers that replay one trace through blockd's core and through vLLM's and SGLang's own
block managers, under one counting rule (``tally``), for ``bench/peers_replay.py``."""
