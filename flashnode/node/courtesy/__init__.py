"""The owner's courtesy: the node gives a GPU back when its owner uses it and keeps heat and
power in bounds (``rules.py``: what holds, pure; ``watch.py``: read and applied beside the
running tasks; ``power.py``: the power limit while tasks run on a GPU)."""
