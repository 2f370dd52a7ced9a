"""Configuration: precedence, validation, secrets and the CLI's exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashnode.errors import ConfigError
from flashnode.settings import load

URL = "http://127.0.0.1:8100"


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "f.toml",
        f'coordinator = "{URL}"\nrunner = "trusted"\npools = ["file-pool"]\nheartbeat_seconds = 7\nmax_tasks = 3\n',
    )
    s = load({}, {}, cfg)
    assert (s.pools, s.heartbeat_seconds, s.max_tasks, s.kill_grace_seconds) == (
        ("file-pool",),
        7,
        3,
        10,
    )
    s = load({}, {"FLASHNODE_POOLS": "a, b,a", "FLASHNODE_MAX_TASKS": "5"}, cfg)
    assert (s.pools, s.max_tasks) == (("a", "b"), 5)
    s = load(
        {"pools": ("flag",), "max_tasks": 9},
        {"FLASHNODE_POOLS": "a", "FLASHNODE_MAX_TASKS": "5"},
        cfg,
    )
    assert (s.pools, s.max_tasks) == (("flag",), 9)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({}, {}, "no coordinator"),
        ({"coordinator": URL, "runner": "trusted"}, {}, "needs at least one --pool"),
        ({"coordinator": "ftp://x"}, {}, "not an http(s) URL"),
        ({"coordinator": "http://example.com"}, {}, "refusing plain http"),
        ({"coordinator": URL, "pools": ("bad pool",)}, {}, "not a valid pool id"),
        ({"coordinator": URL}, {"FLASHNODE_HEARTBEAT_SECONDS": "nan"}, "heartbeat_seconds"),
        ({"coordinator": URL}, {"FLASHNODE_MAX_TASKS": "0"}, "max_tasks"),
    ],
)
def test_bad_configuration_is_one_clear_error(
    flags: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(flags, env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_or_secret_keys_in_the_config_file_are_refused(tmp_path: Path) -> None:
    for text in ('coordinator = "x"\ncoordinatr = "y"\n', 'token = "abc"\n'):
        with pytest.raises(ConfigError, match="unknown key"):
            load({}, {}, write(tmp_path / "c.toml", text))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load({}, {}, write(tmp_path / "c.toml", "= broken"))


def test_https_is_allowed_and_plain_http_to_another_host_needs_the_opt_in() -> None:
    assert (
        load({"coordinator": "https://coord.example/"}, {}).coordinator == "https://coord.example"
    )
    assert load(
        {"coordinator": "http://10.0.0.5:8100", "allow_insecure_http": True}, {}
    ).allow_insecure_http


def test_token_file_must_be_private(tmp_path: Path) -> None:
    token = write(tmp_path / "token", "s3cret\n", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load({"coordinator": URL, "token_file": token}, {})
    token.chmod(0o600)
    s = load({"coordinator": URL, "token_file": token}, {"FLASHNODE_TOKEN": "from-env"})
    assert s.token is not None and s.token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(s)
    s = load({"coordinator": URL}, {"FLASHNODE_TOKEN": "from-env", "FLASHNODE_JOIN_CODE": "jc"})
    assert s.token is not None and s.token.get_secret_value() == "from-env"
    assert s.join_code is not None and s.join_code.get_secret_value() == "jc"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
    return subprocess.run(
        [sys.executable, "-m", "flashnode", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=60,
    )


def test_cli_exit_codes(tmp_path: Path) -> None:
    assert cli("--version").stdout.startswith("flashnode, version")
    r = cli("work", "--coordinator", URL, "--runner", "trusted", "--state-dir", str(tmp_path))
    assert r.returncode == 78 and r.stderr.count("\n") == 1 and "configuration error" in r.stderr
    r = cli("work", "--coordinator", URL, "--token", "x")
    assert r.returncode == 2  # secrets are never flags
    r = cli("work", "--config", str(tmp_path / "missing.toml"), "--coordinator", URL)
    assert r.returncode == 78 and "cannot read config file" in r.stderr
