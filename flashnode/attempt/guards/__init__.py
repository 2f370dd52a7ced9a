"""What runs beside a task: a list of guards, built for each task, and the one supervisor that
asks them in turn (``supervisor.py``). Each guard is one rule (``base.py`` is their contract):
the lease (``lease.py``), the agent's restart (``restart.py``), a cancel (``cancel.py``), the
owner's suspension and its bound (``suspension.py``), the timeout (``timeout.py``), the task's
disk (``disk.py``); the execute phase builds them in that order, then those the agent's wiring
adds (``AttemptContext.guards``), then the sampling of the task's use (``sampling.py``: it
never acts)."""
