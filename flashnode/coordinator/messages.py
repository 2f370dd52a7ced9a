"""Pydantic models of the messages the node sends (docs/protocol.md §4), and of the checkpoint
manifest it reads back. They mirror the coordinator's own.

The models only a task uses (all but the registration's and the node heartbeat's) are built at
their first use (``defer_build``): an idle node does not hold their validators.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = "v1alpha1"


class GpuInfo(BaseModel):
    index: int
    name: str = ""
    memory_total_mb: int | None = None
    driver_version: str = ""
    compute_capability: str = ""


class NodeCapabilities(BaseModel):
    cpu_cores: float | None = None
    memory_bytes: int | None = None
    gpus: list[GpuInfo] = Field(default_factory=list)
    dataset_cache_bytes: int = 0
    pools: list[str] = Field(default_factory=list)
    os: str = ""
    architecture: str = ""


class NodeRegistration(BaseModel):
    """What the node tells the coordinator about itself. Security flags fail closed: each is
    sent, and true only when it holds for this node; ``module_capable`` is always explicit
    because the coordinator defaults it to true."""

    schema_version: Literal["v1alpha1"] = "v1alpha1"
    node_id: str
    kubernetes_node: str = ""
    hostname: str
    capabilities: NodeCapabilities
    environment: Literal["local", "cloud", "edge"] = "local"
    sandbox_capable: bool = False
    argv_capable: bool = False
    unsandboxed_argv_capable: bool = False
    module_capable: bool = False
    can_install_dependencies: bool = False
    local_datasets: list[str] = Field(default_factory=list)
    runtime_profile: str = "flashnode"
    labels: dict[str, str] = Field(default_factory=dict)
    agent_version: str = ""


class NodeHeartbeat(BaseModel):
    """Never carries ``timestamp`` (the server clock is used) nor ``pools`` (that field belongs to a
    control-plane proxy)."""

    schema_version: Literal["v1alpha1"] = "v1alpha1"
    node_id: str
    status: Literal["online", "draining", "terminating"] = "online"


class ExecutionEvidence(BaseModel):
    """None means not measured; 0 means measured zero."""

    model_config = ConfigDict(defer_build=True)

    wall_seconds: float | None = None
    cpu_percent_mean: float | None = None
    gpu_util_percent_mean: float | None = None
    image_digest: str = ""
    exit_code: int | None = None


class CompleteRequest(BaseModel):
    model_config = ConfigDict(defer_build=True)

    output_sha256: str
    evidence: ExecutionEvidence | None = None


class CheckpointPart(BaseModel):
    """One file of a checkpoint: its artifact key, sha256 and size (docs/protocol.md §8)."""

    model_config = ConfigDict(defer_build=True)

    key: str
    sha256: str
    size_bytes: int


class CheckpointManifest(BaseModel):
    """A committed checkpoint as ``checkpoints/latest`` returns it (the fields the agent uses)."""

    model_config = ConfigDict(extra="ignore", defer_build=True)

    manifest_id: str = ""
    step: int
    storage_prefix: str = ""
    parts: list[CheckpointPart]

    @classmethod
    def parse(cls, data: Any) -> CheckpointManifest | None:
        """The manifest, or None when the answer is not one."""
        try:
            return cls.model_validate(data)
        except ValidationError:
            return None
