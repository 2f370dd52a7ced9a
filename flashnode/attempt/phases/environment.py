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

import logging
import sys
from typing import TYPE_CHECKING

from flashnode.errors import AttemptLapsed
from flashnode.runners.plan import Contribution
from flashnode.runners.registry import capabilities

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from flashnode.attempt.hooks import AttemptView
    from flashnode.coordinator.lease import Task

# A task that names no ``python``: the version of the interpreter the agent runs under.
DEFAULT_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def rejoin(a: AttemptView) -> Contribution:
    """For a task rejoined after a restart: its job environment pinned again (the agent that
    pinned it is gone), so that no eviction removes it under the task; released at its end."""
    key, envs = a.record.environment, a.ctx.envs
    if key is None or envs is None:
        return Contribution()
    env = envs.pin(key)
    if env is None:
        log.warning("its job environment is gone")
        return Contribution()
    return Contribution(release=env.release)


def run(a: AttemptView, task: Task) -> Contribution:
    """What the task's start gets for its job environment (nothing, where it has none); its
    release unpins the environment."""
    ctx = a.ctx
    if not task.dependencies or not capabilities(ctx.settings).environments:
        return Contribution()
    if ctx.envs is None:
        raise AttemptLapsed("this node builds no job environments")
    python = task.python or DEFAULT_PYTHON
    env = ctx.envs.acquire(
        python,
        task.dependencies,
        stop=a.stop,
        timeout_s=ctx.settings.env_build_timeout_seconds,
    )
    a.environment_pinned(env.key)
    a.report(
        "environment",
        {
            "key": env.key[:16],
            "python": python,
            "built": env.built,
            "build_seconds": round(env.build_seconds, 3),
        },
    )
    if task.module is not None:
        return Contribution(python=str(env.python), environment=str(env.path), release=env.release)
    return Contribution(
        env={"VIRTUAL_ENV": str(env.path)},
        path=(str(env.path / "bin"),),
        environment=str(env.path),
        release=env.release,
    )
