"""The job environment: a task's ``dependencies`` installed for the Python its ``python`` names,
before it starts (flashnode.caches.envcache builds each environment once per key and shares it).

Only a runner that ``installs_dependencies`` (the trusted runner) gets one: a container task's
image already holds its base, and its ``extra_dependencies`` were refused by the runner's check.
The environment stays pinned (never evicted) until the attempt has ended; the lease is renewed
meanwhile by the keeper, and the task's own timeout starts when the task does, after the build.

An argv task runs with the environment's ``bin`` first on ``PATH`` and ``VIRTUAL_ENV`` set; a
module task runs under the environment's interpreter. A build that fails because of the job's
lines fails the attempt (EnvBuildFailed, with the tool's last lines); one that fails because of
the node (an index it cannot reach, a full disk) lets the lease lapse (EnvUnavailable).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from flashnode.errors import AttemptLapsed
from flashnode.runners.spec import Preparation

if TYPE_CHECKING:
    from flashnode.attempt import Attempt
    from flashnode.coordinator.lease import Task

# A task that names no ``python``: the version of the interpreter the agent runs under.
DEFAULT_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def run(a: Attempt, task: Task) -> Preparation:
    """What the task's start gets for its job environment (nothing, where it has none)."""
    ctx, prepared = a.ctx, Preparation()
    if not task.dependencies or not ctx.runner.installs_dependencies:
        return prepared
    if ctx.envs is None:
        raise AttemptLapsed("this node builds no job environments")
    python = task.python or DEFAULT_PYTHON
    env = ctx.envs.acquire(
        python,
        task.dependencies,
        stop=a.stop,
        timeout_s=ctx.settings.env_build_timeout_seconds,
    )
    a.cleanups.append(env.release)
    a.facts["environment"] = {
        "key": env.key[:16],
        "python": python,
        "built": env.built,
        "build_seconds": round(env.build_seconds, 3),
    }
    prepared.environment = str(env.path)
    if task.module is not None:
        prepared.python = str(env.python)
    else:
        prepared.path_prefix.append(str(env.path / "bin"))
        prepared.agent_env["VIRTUAL_ENV"] = str(env.path)
    return prepared
