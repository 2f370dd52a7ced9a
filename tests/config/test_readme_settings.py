"""Settings say one thing: the README's configuration table is walked row by row, and
every documented key is checked against the code: it is a setting, its documented default is the
default, and the forms the README promises work from the file and from `FLASHNODE_*` alike (every
`*_bytes` key takes a unit; lists documented as comma- or `;`-separated in the environment)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest

from flashnode.config.loading import SETTABLE, load
from flashnode.config.settings import Settings
from flashnode.config.sizes import parse_size

ROOT = Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:9"

# Rows whose default the README gives in words (computed, or the system's): each says why.
IN_WORDS = {
    "coordinator": "required",
    "state_dir": "systemd's, root's or the user's directory",
    "node_id": "generated once",
    "credentials_dir": "root's or the user's directory",
    "container_user": "65534:65534 as root, else the agent's own uid (the runner decides)",
    "nvml_library": "the driver's",
    "task_memory_bytes": "a share of the machine's memory",
    "task_cpus": "a share of the machine's cores",
    "run_windows_timezone": "the system's",
    "max_suspend_seconds": "the lease's lease_seconds",
    "dataset_ca_file": "the default trust store",
}
# One value per key in the form the README documents, for the keys whose form is not its type's.
SAMPLES: dict[str, tuple[Any, Any]] = {  # key: (value as given, value as loaded)
    "pools": ("team-a,team-b", ("team-a", "team-b")),
    "gpu_yield_ignore": ("Xorg,picom", ("Xorg", "picom")),
    "allowed_images": ("busybox:1.36,alpine:3.19", ("busybox:1.36", "alpine:3.19")),
    "run_windows": ("Mon-Fri 19:00-07:00;Sat-Sun", ("Mon-Fri 19:00-07:00", "Sat-Sun")),
    "dataset_allow_private_origins": (
        "192.168.1.20,10.8.0.0/16",
        ("192.168.1.20/32", "10.8.0.0/16"),
    ),
    "env_allow_private_indexes": ("10.8.0.0/16,127.0.0.1", ("10.8.0.0/16", "127.0.0.1/32")),
}


def rows() -> list[tuple[list[str], str, list[str], str]]:
    """(keys, flag, defaults (one per key), meaning) of each row of the configuration table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    found = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip()[1:-1].split("|")]
        keys = re.findall(r"`([a-z_]+)`", cells[0])
        defaults = [d.strip() for d in cells[2].split(" / ")] if len(keys) > 1 else [cells[2]]
        assert len(defaults) == len(keys), line
        found.append((keys, cells[1], defaults, cells[3]))
    return found


ROWS = rows()
DOCUMENTED = {
    key: (flag, default, meaning)
    for keys, flag, defaults, meaning in ROWS
    for key, default in zip(keys, defaults, strict=True)
}


def default_of(key: str) -> Any:
    field = Settings.model_fields[key]
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def test_every_setting_is_documented_once_and_every_documented_key_is_a_setting() -> None:
    keys = [k for keys, *_ in ROWS for k in keys]
    assert len(keys) == len(set(keys)), "a key documented twice"
    assert set(keys) == set(SETTABLE)


@pytest.mark.parametrize("key", sorted(DOCUMENTED))
def test_the_documented_default_is_the_default(key: str) -> None:
    _, default, _ = DOCUMENTED[key]
    actual = default_of(key)
    if key in IN_WORDS:
        assert not re.fullmatch(r"[0-9.]+( [KMGT]iB)?|true|false|none|`[^`]*`", default), (
            f"{key}: the README gives a plain default ({default}): check it, not IN_WORDS"
        )
        return
    if default == "none" or default.startswith("none (") or default == "unlimited":
        assert actual in (None, (), {}), (key, actual)
    elif default in ("true", "false"):
        assert actual is (default == "true"), (key, actual)
    elif re.fullmatch(r"[0-9]+(\.[0-9]+)?", default):
        assert actual == float(default), (key, actual)
    elif re.fullmatch(r"[0-9]+ [KMGT]iB", default):
        assert actual == parse_size(default.replace(" ", "")), (key, actual)
    elif re.fullmatch(r"`[^`]*`", default):
        assert actual == default.strip("`"), (key, actual)
    elif re.fullmatch(r"(`[^`]+`, )+`[^`]+`", default):  # a list
        assert actual == tuple(re.findall(r"`([^`]+)`", default)), (key, actual)
    else:
        raise AssertionError(f"{key}: the README's default {default!r} is in words: IN_WORDS?")


def sample(key: str) -> tuple[Any, Any, Any] | None:
    """(in the file, in the environment, as loaded) in the documented form; None: no form to
    check beyond the type's own (text, paths)."""
    if key in SAMPLES:
        given, loaded = SAMPLES[key]
        return [p for p in re.split(r"[,;]", given)], given, loaded
    if key.endswith("_bytes"):
        return "64M", "64M", 64 << 20
    annotation = Settings.model_fields[key].annotation
    types = get_args(annotation) or (annotation,)
    if bool in types and len(types) == 1:
        return True, "true", True
    if float in types:
        x = 70 if key.endswith(("_percent", "_c")) else 5  # within its bounds
        return x, str(x), float(x)
    if int in types:
        n = 1000 if key == "task_disk_files" else 8  # its least allowed value
        return n, str(n), n
    return None


@pytest.mark.parametrize("key", sorted(DOCUMENTED))
def test_each_key_takes_its_documented_form_from_the_file_and_the_environment(
    key: str, tmp_path: Path
) -> None:
    found = sample(key)
    _, _, meaning = DOCUMENTED[key]
    if "comma-separated" in meaning or "`;`-separated" in meaning:
        assert key in SAMPLES, f"{key}: its documented environment form needs a sample"
    if key == "local_data":  # a table in the file; label=/dir pairs in the environment
        a, b = tmp_path / "a", tmp_path / "b"
        a.mkdir(), b.mkdir()
        in_file, in_env, loaded = None, f"scans={a},more={b}", {"scans": a, "more": b}
        config = tmp_path / "c.toml"
        config.write_text(f'coordinator = "{URL}"\n[local_data]\nscans = "{a}"\nmore = "{b}"\n')
        assert load({}, {}, config).local_data == loaded
        assert load({"coordinator": URL}, {"FLASHNODE_LOCAL_DATA": in_env}).local_data == loaded
        return
    if found is None:
        pytest.skip(f"{key}: text or a path, nothing more documented")
    in_file, in_env, loaded = found
    config = tmp_path / "c.toml"
    config.write_text(f'coordinator = "{URL}"\n{key} = {json.dumps(in_file)}\n')
    assert getattr(load({}, {}, config), key) == loaded
    env = {f"FLASHNODE_{key.upper()}": in_env}
    assert getattr(load({"coordinator": URL}, env), key) == loaded
