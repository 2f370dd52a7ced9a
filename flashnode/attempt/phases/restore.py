"""Checkpoints, before the run (docs/protocol.md §8), for a task whose payload carries
``checkpoint``: the relay is set to watch the run (relay.py) and the task's latest valid
checkpoint, when it has one, is fetched for it. Every task has its checkpoint directory,
``out/ckpt/`` (``FLASHML_CKPT_DIR``, ``FLASHML_CHECKPOINT_DIR`` for a checkpointing task), made
with the workspace.

Where the checkpoint goes depends on its layout. flashruntime's (a ``step-*`` or
``checkpoint-*`` directory with its ``manifest.json``) is restored into the checkpoint directory
under its own name, so that ``flashruntime.torch.prepare`` and the Hugging Face helper find it
there; its manifest's ``storage_prefix`` is made to name that directory as the task sees it
(it named the directory the attempt that wrote it saw); the task's user owns it (it may delete
it) and the relay never ships it back. The older layouts (a ``step-<N>.<ext>`` file, a
``step-<N>/`` directory) go to ``inputs/resume/`` (the agent's: the task reads it, never writes
it). Either way ``FLASHML_RESUME`` (and a module task's ``inputs.resume``) names it.

Every part of that manifest is downloaded and checked against its size and sha256; a manifest
that does not hold up (a part missing, altered, outside the task's output prefix, larger than
``max_checkpoint_bytes``, more parts than the relay ships (``MAX_CHECKPOINT_FILES``) or deeper
than it (``MAX_CHECKPOINT_DEPTH``), not one file or one directory, a flashruntime manifest that
does not match its parts) is not used: the attempt starts from scratch and says why. A coordinator
that cannot be asked lets the lease lapse (not the task's fault), so the next attempt can still
resume.

The checkpoint is written within the attempt's disk budget (``attempt/diskbudget.py``): all of
it (its bytes, and its files and directories as inodes) is weighed before its first byte is
fetched. One past the job's own caps (``task_disk_bytes``, ``task_disk_files``) is not used
either (the attempt starts from scratch); one that fits them but not the room the state dir's
disk has now lets the lease lapse (``ShortOfRoom``: the node's shortage; another node, or this
one later, can still resume from it).
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING

from flashnode.attempt.phases import stage
from flashnode.attempt.phases.relay import Relay
from flashnode.attempt.phases.transfer import Ladder, transfer
from flashnode.coordinator import manifests
from flashnode.coordinator.ids import ARTIFACT_SCHEME, safe_key
from flashnode.coordinator.lease import RESUME_INPUT
from flashnode.coordinator.messages import CheckpointManifest, CheckpointPart
from flashnode.errors import AttemptLapsed, OverBudget
from flashnode.runners.plan import WORK, Contribution
from flashnode.sandbox.checkpoints import MAX_CHECKPOINT_DEPTH, MAX_CHECKPOINT_FILES
from flashnode.sandbox.removal import remove_tree
from flashnode.sandbox.workspace import CKPT

if TYPE_CHECKING:
    from pathlib import Path

    from flashnode.attempt.hooks import AttemptView
    from flashnode.attempt.record import Staged
    from flashnode.coordinator.lease import Lease
    from flashnode.sandbox.workspace import Workspace

log = logging.getLogger(__name__)

SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Unusable(Exception):
    """The latest manifest cannot be resumed from; the message says why."""


def run(a: AttemptView, staged: Staged) -> Contribution:
    """What the task's start gets for its checkpoints: their variables, and the checkpoint
    restored for it, if any. The relay is set to watch the run."""
    task = staged.task
    if task.checkpoint is None:
        return Contribution()
    env = {"FLASHML_CHECKPOINT_DIR": f"{WORK}/out/{CKPT}"}
    inputs: dict[str, str] = {}
    manifest = _latest(a, staged.lease)
    restored = None
    if manifest is None:
        log.info("no checkpoint yet; starting from the beginning")
    else:
        try:
            files = _layout(manifest, task.output_prefix, a.ctx.settings.max_checkpoint_bytes)
            path, restored = _restore(a, staged.workspace, manifest, files)
        except Unusable as exc:
            log.warning(
                "checkpoint step %d is not usable (%s); starting from scratch", manifest.step, exc
            )
        else:
            env["FLASHML_RESUME"] = path
            if task.module is not None:
                inputs[RESUME_INPUT] = path
            a.restored(manifest.step, restored)
            log.info(
                "resuming from step %d (%d file(s), %d bytes)",
                manifest.step,
                len(files),
                sum(p.size_bytes for p, _ in files),
            )
    a.beside(Relay(a, staged, restored))
    return Contribution(env=env, module_inputs=inputs)


def _latest(a: AttemptView, lease: Lease) -> CheckpointManifest | None:
    ladder = Ladder(
        gave_up=lambda e: AttemptLapsed(f"could not ask for the task's latest checkpoint: {e}"),
        refused=lambda e: AttemptLapsed(f"could not ask for the task's latest checkpoint: {e}"),
    )
    return transfer(
        a,
        "latest checkpoint",
        lambda: a.ctx.coordinator.checkpoint_latest(lease.job_id, lease.task_id),
        ladder=ladder,
    )


def _layout(
    manifest: CheckpointManifest, output_prefix: str, max_bytes: int
) -> list[tuple[CheckpointPart, str]]:
    """Each part with its path under inputs/resume/. Part keys must lie under the task's own
    output prefix; under the manifest's storage prefix they keep their path below it (this
    agent's layout), elsewhere only their base name (a single-file checkpoint of flashnode 0.4)."""
    if not manifest.parts:
        raise Unusable("it has no parts")
    if len(manifest.parts) > MAX_CHECKPOINT_FILES:
        raise Unusable(f"it has {len(manifest.parts)} parts, more than {MAX_CHECKPOINT_FILES}")
    prefix = ""
    if manifest.storage_prefix.startswith(ARTIFACT_SCHEME):
        prefix = manifest.storage_prefix[len(ARTIFACT_SCHEME) :]
    files: list[tuple[CheckpointPart, str]] = []
    for part in manifest.parts:
        key = part.key
        if not safe_key(key) or not key.startswith(output_prefix):
            raise Unusable(f"part {key[:200]!r} is not under the task's output prefix")
        if not SHA256.match(part.sha256) or part.size_bytes < 0:
            raise Unusable(f"part {key[:200]!r} has no valid sha256 and size")
        rel = key[len(prefix) :] if prefix and key.startswith(prefix) else key.rsplit("/", 1)[-1]
        if not safe_key(rel) or not rel.isprintable():
            raise Unusable(f"part {key[:200]!r} has an unusable name")
        if rel.count("/") > MAX_CHECKPOINT_DEPTH:
            raise Unusable(
                f"part {key[:200]!r} lies deeper than {MAX_CHECKPOINT_DEPTH} directories"
            )
        files.append((part, rel))
    rels = [rel for _, rel in files]
    dirs = {rel.rsplit("/", i)[0] for rel in rels for i in range(1, rel.count("/") + 1)}
    if len(set(rels)) != len(rels) or dirs & set(rels):
        raise Unusable("two parts would be written at one path")
    if len({rel.split("/", 1)[0] for rel in rels}) != 1:
        raise Unusable("it is not one checkpoint (one file, or one directory)")
    total = sum(p.size_bytes for p, _ in files)
    if total > max_bytes:
        raise Unusable(f"it holds {total} bytes, more than max_checkpoint_bytes ({max_bytes})")
    return files


def _restore(
    a: AttemptView,
    ws: Workspace,
    manifest: CheckpointManifest,
    files: list[tuple[CheckpointPart, str]],
) -> tuple[str, tuple[str, int] | None]:
    """Fetch the checkpoint and put it in place for the task: the ``/work`` path it has there,
    and, for flashruntime's layout, its (name, step) under out/ckpt/. All of it is weighed
    against the attempt's disk budget first."""
    budget = a.budget
    what = f"the checkpoint of step {manifest.step}"
    try:
        budget.fits(sum(p.size_bytes for p, _ in files), _inodes(files), what)
    except OverBudget as exc:
        raise Unusable(str(exc)) from None
    held = budget.mark()
    try:
        fetched = _fetch(a, ws, files)
    except Unusable:
        budget.give_back(*budget.since(held))  # removed: no longer the attempt's
        raise
    name = files[0][1].split("/", 1)[0]
    try:
        if _flashruntime_layout(name, [rel for _, rel in files]):
            _retarget(a, ws, fetched / name, manifest, files)
            os.rename(fetched / name, ws.out / CKPT / name)
            remove_tree(fetched)
            budget.give_back(*budget.since(held))  # the task's files now: its caps count them
            return f"{WORK}/out/{CKPT}/{name}", (name, manifest.step)
    except BaseException:
        remove_tree(fetched)
        budget.give_back(*budget.since(held))
        raise
    os.rename(fetched, ws.inputs / RESUME_INPUT)
    return f"{WORK}/inputs/{RESUME_INPUT}/{name}", None


def _inodes(files: list[tuple[CheckpointPart, str]]) -> int:
    """The files and directories the checkpoint is fetched into (its staging directory too)."""
    dirs = {rel.rsplit("/", i)[0] for _, rel in files for i in range(1, rel.count("/") + 1)}
    return len(files) + len(dirs) + 1


def _flashruntime_layout(name: str, rels: list[str]) -> bool:
    """One ``step-*``/``checkpoint-*`` directory of files, its manifest.json among them."""
    return (
        manifests.DIRECTORY.match(name) is not None
        and f"{name}/{manifests.MANIFEST_NAME}" in rels
        and all(rel.count("/") == 1 for rel in rels)
    )


def _retarget(
    a: AttemptView,
    ws: Workspace,
    directory: Path,
    manifest: CheckpointManifest,
    files: list[tuple[CheckpointPart, str]],
) -> None:
    """Check the fetched manifest.json against what was fetched (its step, and the sha256 of
    every part it lists), then make its ``storage_prefix`` name the directory as the task will
    see it (out/ckpt/<name>), the way flashruntime's pickers read it."""
    path = directory / manifests.MANIFEST_NAME
    data = path.read_bytes()  # fetched by the agent into its own .stage/
    try:
        local = manifests.parse(data)
    except manifests.Invalid as exc:
        raise Unusable(f"its {manifests.MANIFEST_NAME} cannot be used: {exc}") from None
    if local.step != manifest.step:
        raise Unusable(f"its {manifests.MANIFEST_NAME} is of step {local.step}")
    fetched = {rel.split("/", 1)[1]: part.sha256 for part, rel in files}
    for part in local.parts:
        if fetched.get(part.name) != part.sha256:
            raise Unusable(f"its part {part.name!r} does not match its manifest")
    where = a.ctx.runner.task_path(ws, f"{WORK}/out/{CKPT}/{directory.name}")
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "wb") as fh:
        fh.write(manifests.retarget(data, where))


def _fetch(a: AttemptView, ws: Workspace, files: list[tuple[CheckpointPart, str]]) -> Path:
    """Download and check every part into .stage/resume/; that directory."""
    fetched = ws.stage / RESUME_INPUT
    budget = a.budget
    made: set[Path] = set()
    try:
        for part, rel in files:
            a.check()
            dest = fetched / rel
            parts = rel.split("/")[:-1]
            dirs = [fetched.joinpath(*parts[:i]) for i in range(len(parts) + 1)]
            missing = [d for d in dirs if d not in made]
            budget.take(0, len(missing), f"the checkpoint's directories for {rel}")
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            made.update(missing)
            size, sha256 = _download(a, part, dest)  # hashed as it streamed: never read back
            if size != part.size_bytes:
                raise Unusable(f"part {rel} has {size} bytes, not {part.size_bytes}")
            if sha256 != part.sha256:
                raise Unusable(f"part {rel} does not match its sha256")
    except BaseException:
        remove_tree(fetched)
        raise
    return fetched


def _download(a: AttemptView, part: CheckpointPart, dest: Path) -> tuple[int, str]:
    """The part fetched into ``dest``: its size and the sha256 of the bytes written."""
    ladder = Ladder(
        missing=lambda _: Unusable(f"part {part.key} is missing from the store"),
        gave_up=lambda e: AttemptLapsed(f"the task's checkpoint could not be fetched: {e}"),
        refused=lambda e: Unusable(f"part {part.key}: {e}"),
    )
    what = f"checkpoint part {part.key}"
    return stage.fetch_hashed(a, part.key, dest, part.size_bytes, what, ladder)
