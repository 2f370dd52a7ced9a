"""What a runner can do for a task, stated in its registry entry (``runners.registry``).

Everything outside ``flashnode/runners/`` asks this record, never a runner's name: what the node
advertises to the coordinator, whether the agent builds job environments or lends local
datasets, who a task runs as (for the files laid out for it and the doctor's checks), whether
the host's cgroups are what limits a task. A new runner states its own and nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flashnode.config.settings import Settings
from flashnode.evidence.inventory import Offer


@dataclass(frozen=True)
class Capabilities:
    """One runner's abilities under one configuration on this host."""

    # Runs a task's argv isolated from the host (the coordinator's ``sandbox_capable`` and
    # ``argv_capable``): anyone's argv task may be placed here.
    sandbox: bool
    # Runs a task on the host itself, as a task user at best: pool work only (the node offers
    # ``unsandboxed_argv_capable`` only together with pools, and refuses to start without any),
    # limited by the host's cgroups where it has them, in the agent's session.
    on_host: bool
    # Installs a task's ``dependencies`` into a job environment (a container's image is all it
    # has otherwise).
    environments: bool
    # Lends the owner's local datasets (``local_data``) into a task, read-only.
    lends_data: bool
    # Who a task runs as: (uid, gid); None where each slot has a user of its own
    # (``<task_user>-N``).
    task_identity: tuple[int, int] | None
    # The task reaches only what its network policy lets it (its own network namespace).
    network_isolation: bool
    # How the task numbers the GPUs it was given: from 0 ("renumbered": a container sees only
    # its own) or as the host does ("host": CUDA_VISIBLE_DEVICES names them).
    gpu_addressing: Literal["renumbered", "host"]
    # ``Handle.suspend``/``resume`` freeze a task and let it go on (the owner's controls, the
    # courtesy, the disk watch's frozen walks); without, a pause asked for ends the task.
    pause: bool
    # A running task outlives an agent restart and is rejoined (``Handle.detach``, ``rejoin``).
    reattach: bool
    # Runs allowlisted ``python -m`` module tasks when given an interpreter or an image for them
    # (whether it has one is the runner's ``module_capable``, known once it is built).
    modules: bool

    def describe(self) -> str:
        """The abilities in the owner's words (``flashnode doctor``)."""
        words = [
            "sandboxed" if self.sandbox else "on the host (pool work only)",
            "no network" if self.network_isolation else "the host's network",
            "GPUs numbered from 0"
            if self.gpu_addressing == "renumbered"
            else "GPUs as the host numbers them",
        ]
        words += [
            w
            for w, on in (
                ("pauses", self.pause),
                ("re-attaches", self.reattach),
                ("job environments", self.environments),
                ("lends local data", self.lends_data),
            )
            if on
        ]
        who = self.task_identity
        words.append("tasks as each slot's task user" if who is None else f"tasks as uid {who[0]}")
        return ", ".join(words)

    def offer(
        self, settings: Settings, module_capable: bool, pools: tuple[str, ...] | None = None
    ) -> Offer:
        """What the node advertises when it registers with these abilities; ``pools``: those of
        ``settings`` the runner can run now (``Runner.pools``; None: all)."""
        return Offer(
            argv_capable=self.sandbox,
            sandbox_capable=self.sandbox,
            unsandboxed_argv_capable=self.on_host and bool(settings.pools),
            can_install_dependencies=self.environments,
            module_capable=self.modules and module_capable,
            lends_data=self.lends_data,
            pools=pools,
        )
