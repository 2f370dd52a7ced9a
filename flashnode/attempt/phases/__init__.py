"""The phases of an attempt, one module each, in the order the orchestrator runs them:
``prepare``, ``stage``, ``restore``, ``environment``, ``data``, ``execute``, then ``commit``'s
check and commit; and what only they use: ``relay`` (the checkpoints shipped while the task
runs, started by restore) and ``transfer`` (every download and upload, with the shared retry
policy). A phase is a function of the attempt's hooks (``attempt/hooks.py``) and of what the
phases before it made; it imports nothing of the orchestrator.
"""
