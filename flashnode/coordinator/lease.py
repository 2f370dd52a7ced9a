"""A claimed lease and its task payload, parsed strictly (docs/protocol.md §4, §5).

Incoming data is untrusted: a Lease envelope is parsed first (its ids end up in paths and URLs,
so they are checked strictly), then its payload is parsed into a Task; any problem with the
payload becomes an AttemptFailed whose message is the reason reported to the coordinator.

Its models are built at their first use (``defer_build``): an idle node does not hold their
validators.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from flashnode.coordinator.datasets import DatasetEntry, parse_datasets
from flashnode.coordinator.ids import ARTIFACT_SCHEME, SAFE_ID, safe_key
from flashnode.coordinator.validators import Validators, parse_validators
from flashnode.errors import AttemptFailed

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
MAX_ARGV_BYTES = 128 * 1024
MAX_ENV_BYTES = 128 * 1024
# The only modules a module task may run (docs/protocol.md §5.3): installed code, not task code.
MODULES = (
    "flashml_workloads.sklearn_trial",
    "flashml_workloads.kmeans_shard",
    "flashml_workloads.sgd_trainer",
    "flashml_workloads.fedavg_worker",
)


class Lease(BaseModel):
    """The envelope of a claimed lease; ``payload`` is parsed separately by ``parse_task``."""

    model_config = ConfigDict(extra="ignore", defer_build=True)

    lease_id: str
    task_id: str
    job_id: str
    attempt_number: int = 0
    lease_seconds: float = 0.0
    payload: dict[str, Any]

    @field_validator("lease_id", "task_id", "job_id")
    @classmethod
    def _safe_id(cls, value: str) -> str:
        if not SAFE_ID.match(value):
            raise ValueError("not a safe identifier")
        return value

    @property
    def renew_interval(self) -> float:
        """clamp(lease_seconds / 3, 2 s, 60 s); a missing or absurd window renews every 2 s."""
        seconds = self.lease_seconds
        if not math.isfinite(seconds) or seconds <= 0:
            return 2.0
        return min(max(seconds / 3.0, 2.0), 60.0)

    @property
    def window(self) -> float:
        """The lease window used to judge a local deadline: at least one renewal interval."""
        seconds = self.lease_seconds
        if not math.isfinite(seconds) or seconds <= 0:
            return self.renew_interval
        return min(seconds, 3600.0)


def parse_lease(data: Any) -> Lease:
    """Parse a claim answer; raises ValueError with a short reason when the envelope is unusable."""
    try:
        return Lease.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "lease"
        raise ValueError(f"malformed lease ({where}: {first['msg']})") from None


class Isolation(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, defer_build=True)

    tier: str | None = None
    allow_fallback: StrictBool = Field(default=False, alias="allowFallback")


class Input(BaseModel):
    """One staged input: the artifact key, where it lands under ``inputs/``, and whether it is an
    archive to unpack into ``inputs/<name>/``."""

    model_config = ConfigDict(defer_build=True)

    name: str
    key: str
    unpack: bool = False

    @property
    def dest(self) -> str:
        return self.name if self.unpack else self.key.rsplit("/", 1)[-1]


class CheckpointPolicy(BaseModel):
    """The payload's ``checkpoint`` (docs/protocol.md §8): its presence turns on the relay and
    resume. The numbers are the coordinator's (its silence watchdog), read the way it reads them: a
    value that is not a finite number counts as absent."""

    model_config = ConfigDict(defer_build=True)

    interval_seconds: float | None = None
    watchdog_seconds: float | None = None


class Task(BaseModel):
    """A parsed task payload: exactly one of ``argv`` and ``module`` is set."""

    model_config = ConfigDict(defer_build=True)

    task_id: str
    output_prefix: str
    argv: tuple[str, ...] | None = None
    module: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    inputs: tuple[Input, ...] = ()
    image: str = ""
    isolation: Isolation | None = None
    pool: str | None = None
    workload_type: str | None = None
    timeout_seconds: float | None = None
    gpus: int = 0
    dependencies: tuple[str, ...] = ()  # requirements lines: the image's base plus the extras
    extra_dependencies: tuple[str, ...] = ()  # the extras alone (gate VIII)
    python: str | None = None  # the "major.minor" the dependencies were resolved against
    checkpoint: CheckpointPolicy | None = None  # set: relay checkpoints, resume from the latest
    local_inputs: tuple[str, ...] = ()  # labels of data the owner lends, each once, in order
    datasets: tuple[DatasetEntry, ...] = ()  # dataset slice entries, laid out under /work/data
    validators: Validators | None = None  # what the job declared a result must hold


# Where a resumed attempt finds its checkpoint (inputs/resume/), and its module spec key.
RESUME_INPUT = "resume"
# Names a payload may not set: the agent's ownership token, and the GPU visibility that only the
# agent decides (on hosts where nvidia is Docker's default runtime, NVIDIA_VISIBLE_DEVICES=all
# would hand a container every GPU).
RESERVED_ENV = re.compile(r"^(FLASHNODE_|NVIDIA_|CUDA_VISIBLE_DEVICES$|CUDA_DEVICE_ORDER$)")
PYTHON_VERSION = re.compile(r"^3\.[0-9]{1,2}$")
MAX_DEPENDENCY_LINES = 1000
MAX_LOCAL_INPUTS = 64


def parse_task(lease: Lease) -> Task:
    """Turn a lease payload into a Task, or raise AttemptFailed with the reason."""
    p = lease.payload
    argv, module = p.get("argv"), p.get("module")
    if (argv is None) == (module is None):
        raise AttemptFailed("payload must carry exactly one of argv and module")
    if argv is not None:
        argv = _argv(argv)
    params: Any = {}
    if module is not None:
        if not isinstance(module, str) or module not in MODULES:
            raise AttemptFailed(f"module {str(module)[:80]!r} is not on this node's allowlist")
        params = p.get("params", {})
        if not isinstance(params, dict):
            raise AttemptFailed("payload params is not an object")

    task_id = _opt_str(p, "task_id") or lease.task_id
    if task_id != lease.task_id:
        raise AttemptFailed("payload task_id does not match the lease")
    output_prefix = _opt_str(p, "output_prefix")
    if (
        output_prefix is None
        or not safe_key(output_prefix.rstrip("/"))
        or not output_prefix.endswith("/")
    ):
        raise AttemptFailed(
            "payload output_prefix is missing or not a safe relative key ending in /"
        )

    isolation = p.get("isolation")
    if isolation is not None:
        if not isinstance(isolation, dict):
            raise AttemptFailed("payload isolation is not an object")
        try:
            isolation = Isolation.model_validate(isolation)
        except ValidationError:
            raise AttemptFailed("payload isolation.allowFallback is not a boolean") from None

    pool = p.get("pool")
    if pool is not None and not isinstance(pool, str):
        raise AttemptFailed("payload pool is not a string")

    env = _env(p.get("env"))
    if module is not None and env:
        # Module tasks run installed code, not the task's own: an env could make it run other
        # code (PYTHONPATH, LD_PRELOAD), so a module task takes none.
        raise AttemptFailed("payload env is not allowed for a module task")

    inputs = _inputs(p.get("inputs"), p.get("unpack_inputs"))
    checkpoint = _checkpoint(p.get("checkpoint"))
    try:
        declared = parse_validators(p.get("validators"))
    except ValueError as exc:
        raise AttemptFailed(str(exc)) from None
    if checkpoint is not None and any(RESUME_INPUT in (i.name, i.dest) for i in inputs):
        raise AttemptFailed(
            f"payload input {RESUME_INPUT!r} is reserved for the checkpoint a task resumes from"
        )

    return Task(
        task_id=task_id,
        output_prefix=output_prefix,
        argv=argv,
        module=module,
        params=params,
        env=env,
        inputs=inputs,
        image=_opt_str(p, "image") or "",
        isolation=isolation,
        pool=pool,
        workload_type=_opt_str(p, "workload_type"),
        timeout_seconds=_timeout(p.get("timeout_seconds")),
        gpus=_gpus(p.get("gpus")),
        dependencies=_lines(p.get("dependencies"), "dependencies"),
        extra_dependencies=_lines(p.get("extra_dependencies"), "extra_dependencies"),
        python=_python(p.get("python")),
        checkpoint=checkpoint,
        local_inputs=_labels(p.get("local_inputs")),
        datasets=parse_datasets(p.get("datasets")),
        validators=declared,
    )


def _opt_str(p: dict[str, Any], key: str) -> str | None:
    value = p.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise AttemptFailed(f"payload {key} is not a string")
    return value


def _argv(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise AttemptFailed("payload argv is not a non-empty list")
    if not all(isinstance(a, str) for a in value):
        raise AttemptFailed("payload argv is not a list of strings")
    if any("\0" in a for a in value) or not value[0]:
        raise AttemptFailed("payload argv has an empty program or a NUL byte")
    if sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in value) > MAX_ARGV_BYTES:
        raise AttemptFailed(f"payload argv is larger than {MAX_ARGV_BYTES} bytes")
    return tuple(value)


def _env(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AttemptFailed("payload env is not an object")
    size = 0
    for k, v in value.items():
        if not isinstance(v, str):
            raise AttemptFailed(f"payload env {k[:64]!r} is not a string")
        if not ENV_NAME.match(k) or "\0" in v:
            raise AttemptFailed(f"payload env name {k[:64]!r} is not a valid variable")
        if RESERVED_ENV.match(k):
            raise AttemptFailed(f"payload env {k!r} is reserved for the agent")
        size += len(k) + len(v) + 2
    if size > MAX_ENV_BYTES:
        raise AttemptFailed(f"payload env is larger than {MAX_ENV_BYTES} bytes")
    return dict(value)


def _lines(value: Any, key: str) -> tuple[str, ...]:
    """Requirement lines: a list of strings."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise AttemptFailed(f"payload {key} is not a list of requirement lines")
    if len(value) > MAX_DEPENDENCY_LINES or any("\0" in x or len(x) > 4096 for x in value):
        raise AttemptFailed(f"payload {key} is too long or holds a NUL byte")
    return tuple(value)


def _labels(value: Any) -> tuple[str, ...]:
    """``local_inputs``: a list of labels, each kept once. Whether this node lends them is the
    data phase's question (it names a label it does not lend)."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise AttemptFailed("payload local_inputs is not a list of labels")
    labels = tuple(dict.fromkeys(value))
    if len(labels) > MAX_LOCAL_INPUTS:
        raise AttemptFailed(f"payload local_inputs names more than {MAX_LOCAL_INPUTS} labels")
    return labels


def _python(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not PYTHON_VERSION.match(value):
        raise AttemptFailed(f"payload python {str(value)[:20]!r} is not a major.minor version")
    return value


def _checkpoint(value: Any) -> CheckpointPolicy | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise AttemptFailed("payload checkpoint is not an object")

    def number(key: str) -> float | None:
        x = value.get(key)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            return None
        return float(x)

    return CheckpointPolicy(
        interval_seconds=number("interval_seconds"), watchdog_seconds=number("watchdog_seconds")
    )


def _inputs(value: Any, unpack: Any) -> tuple[Input, ...]:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise AttemptFailed("payload inputs is not an object")
    if unpack is None:
        unpack = []
    if not isinstance(unpack, list) or not all(isinstance(n, str) for n in unpack):
        raise AttemptFailed("payload unpack_inputs is not a list of names")
    missing = sorted(set(unpack) - set(value))
    if missing:
        raise AttemptFailed(f"payload unpack_inputs names unknown input {missing[0][:64]!r}")
    staged: list[Input] = []
    for name, uri in value.items():
        if not SAFE_ID.match(name):
            raise AttemptFailed(f"payload input name {name[:64]!r} is not a safe name")
        if not isinstance(uri, str) or not uri.startswith(ARTIFACT_SCHEME):
            # Inputs come only from the coordinator's store: no file://, no URLs to anywhere.
            raise AttemptFailed(
                f"input {name!r} is not an artifact:// URI of the coordinator's store"
            )
        key = uri[len(ARTIFACT_SCHEME) :]
        if not safe_key(key):
            raise AttemptFailed(f"input {name!r} has an unsafe artifact key")
        staged.append(Input(name=name, key=key, unpack=name in unpack))
    dests = [i.dest for i in staged]
    for dest in dests:
        if dests.count(dest) > 1:
            raise AttemptFailed(f"two inputs would be staged at inputs/{dest}")
    return tuple(staged)


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AttemptFailed("payload timeout_seconds is not a number")
    if not math.isfinite(value) or value <= 0:
        raise AttemptFailed("payload timeout_seconds is not a positive finite number")
    return float(value)


def _gpus(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AttemptFailed("payload gpus is not a non-negative integer")
    return value
