"""Processes the agent runs for itself, not for a task: ``popen_as`` (a command as a given user,
with exactly the environment given, in a sandbox and cgroup if given), the module import check
and the JSON Schema check it runs as its helper user, and the probe of whether a sandbox can be
made here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from flashnode.coordinator import validators
from flashnode.sandbox.cgroups import AttemptCgroup
from flashnode.sandbox.procs import TaskUser, helper_user
from flashnode.sandbox.procs.chain import PRIVILEGED_ENV, SYSTEM_PATH, command, env_file
from flashnode.sandbox.procs.mounts import Sandbox


def popen_as(
    argv: Sequence[str],
    env: Mapping[str, str],
    user: TaskUser | None,
    sandbox: Sandbox | None = None,
    cgroup: AttemptCgroup | None = None,
    rlimits: Mapping[str, int] | None = None,
    **kwargs: Any,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``user`` (None: as the agent's own user) with exactly ``env``, which no
    step that runs with the agent's privileges sees, in ``sandbox`` and ``cgroup`` if given,
    with ``rlimits`` (``command``). ``kwargs`` go to Popen."""
    env_fd = env_file(env, argv)
    try:
        return subprocess.Popen(
            command(cgroup, user, sandbox, rlimits=rlimits),
            env=PRIVILEGED_ENV,
            stdin=env_fd,
            **kwargs,
        )
    finally:
        os.close(env_fd)


def python_imports(python: str, modules: Sequence[str]) -> str | None:
    """None if ``python`` imports every module; else why not. Run as ``helper_user`` in a
    sandbox of its own (a root agent), bounded in time, its process group killed after."""
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    try:
        user = helper_user()
    except LookupError as exc:
        return str(exc)
    try:
        proc = popen_as(
            [python, "-I", "-c", code, *modules],
            {"PATH": SYSTEM_PATH},
            user,
            Sandbox(64 * 1024 * 1024, keep_agent=True) if user is not None else None,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            if proc.stderr is not None:  # left open by a communicate that timed out
                proc.stderr.close()
            return "TimeoutExpired"
        finally:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
    except OSError as exc:
        return type(exc).__name__
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        return lines[-1][:200] if lines else f"exit code {proc.returncode}"
    return None


SCHEMA_CHECK_S = 30.0  # the longest a declared schema's check may take on the node


def json_schema_problem(schema: dict[str, Any], metrics: Any) -> str | None:
    """The coordinator's reason why ``metrics`` does not conform to the job's JSON Schema, or
    None (validators.SchemaCheck). Checked by the agent's own interpreter in a helper process
    (a root agent's in a sandbox of its own with no network, become ``helper_user`` before it
    reads the job's schema; at most 1 GiB and ``SCHEMA_CHECK_S``, its process group killed
    after): the schema is the job's, and it is resolved against nothing but itself
    (validators.SCHEMA_HELPER). A check that takes longer fails too (it would hold the
    coordinator as long). validators.Unchecked when it cannot tell."""
    try:
        user = helper_user()
    except LookupError as exc:
        raise validators.Unchecked(f"the schema check has no user to run as: {exc}") from None
    body = json.dumps({"schema": schema, "metrics": metrics}).encode()
    data = os.memfd_create("flashnode-schema-check")
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(data, view) :]
        os.lseek(data, 0, os.SEEK_SET)
        proc = popen_as(
            [
                sys.executable,
                "-I",
                "-c",
                validators.SCHEMA_HELPER,
                str(data),
                f"{user.uid}:{user.gid}" if user is not None else "",
            ],
            {"PATH": SYSTEM_PATH},
            None,
            Sandbox(64 * 1024 * 1024, no_network=True, keep_agent=True)
            if user is not None
            else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            pass_fds=(data,),
            start_new_session=True,
        )
    except OSError as exc:
        raise validators.Unchecked(f"the schema check did not start ({exc.strerror})") from None
    finally:
        os.close(data)
    try:
        out, _ = proc.communicate(timeout=SCHEMA_CHECK_S)
    except subprocess.TimeoutExpired:
        return (
            "metrics.json could not be checked against the declared json_schema within"
            f" {SCHEMA_CHECK_S:g} s"
        )
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:  # left open by a communicate that timed out
            proc.stdout.close()
    try:
        verdict = json.loads(out)
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        raise validators.Unchecked(f"the schema check failed (exit code {proc.returncode})")
    if "unchecked" in verdict:
        raise validators.Unchecked(str(verdict["unchecked"]))
    reason = verdict.get("problem")
    return reason if isinstance(reason, str) else None


def sandbox_works() -> str | None:
    """None if this process can give a task private namespaces and tmpfs mounts; else why not."""
    try:
        proc = popen_as(
            ["true"],
            {"PATH": SYSTEM_PATH},
            None,
            Sandbox(1 << 20, keep_agent=True),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd="/",
        )
    except OSError as exc:
        return type(exc).__name__
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "TimeoutExpired"
    if proc.returncode != 0:
        why = err.decode(errors="replace").strip().removeprefix("flashnode: ")
        return why[:200] or f"exit {proc.returncode}"
    return None
