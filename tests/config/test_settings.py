"""Configuration: precedence, validation, secrets and the CLI's exit codes."""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flashnode.config.loading import load, top_level_runner_keys
from flashnode.errors import ConfigError
from flashnode.runners.registry import load_settings

URL = "http://127.0.0.1:8100"
ROOT = Path(__file__).resolve().parents[2]


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
        ({"coordinator": URL, "runner": "trusted"}, {}, "needs at least one pool"),
        ({"coordinator": URL, "runner": "podman"}, {}, "no such runner (known: docker, trusted)"),
        ({"coordinator": URL, "runner": "Docker"}, {}, "no such runner (known: docker, trusted)"),
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
        load_settings(flags, env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_or_secret_keys_in_the_config_file_are_refused(tmp_path: Path) -> None:
    for text in ('coordinator = "x"\ncoordinatr = "y"\n', 'token = "abc"\n'):
        with pytest.raises(ConfigError, match="unknown key"):
            load({}, {}, write(tmp_path / "c.toml", text))
    with pytest.raises(ConfigError) as info:
        load({}, {}, write(tmp_path / "c.toml", f'coordinator = "{URL}"\ntask_usr = "x"\n'))
    assert "unknown key 'task_usr' (did you mean 'task_user'?)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load({}, {}, write(tmp_path / "c.toml", f'coordinator = "{URL}"\ntoken = "abc"\n'))
    assert "token_file or flashnode login" in str(info.value) and "abc" not in str(info.value)
    with pytest.raises(ConfigError, match="not valid TOML"):
        load({}, {}, write(tmp_path / "c.toml", "= broken"))


def test_https_is_allowed_and_plain_http_to_another_host_needs_the_opt_in() -> None:
    assert (
        load({"coordinator": "https://Coord.Example/"}, {}).coordinator
        == "https://coord.example:443"
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


def test_cli_exit_codes(flashnode: Callable[..., Any], tmp_path: Path) -> None:
    assert flashnode("--version").stdout.startswith("flashnode, version")
    r = flashnode("work", "--coordinator", URL, "--runner", "trusted", "--state-dir", str(tmp_path))
    assert r.returncode == 78 and r.stderr.count("\n") == 1 and "configuration error" in r.stderr
    r = flashnode("work", "--coordinator", URL, "--token", "x")
    assert r.returncode == 2  # secrets are never flags
    r = flashnode("work", "--config", str(tmp_path / "missing.toml"), "--coordinator", URL)
    assert r.returncode == 78 and "cannot read config file" in r.stderr


# --- the owner's words (errors, sizes, slots) --------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"FLASHNODE_SLOTS": "-2"},
            "slots = '-2' (from FLASHNODE_SLOTS): must be a whole number of at least 1, or \"auto\"",
        ),
        (
            {"FLASHNODE_SLOTS": "two"},
            "slots = 'two' (from FLASHNODE_SLOTS): must be a whole number",
        ),
        (
            {"FLASHNODE_HEARTBEAT_SECONDS": "soon"},
            "heartbeat_seconds = 'soon' (from FLASHNODE_HEARTBEAT_SECONDS): must be a number",
        ),
        (
            {"FLASHNODE_RUNNER": "a runner"},
            "runner = 'a runner' (from FLASHNODE_RUNNER): is not a runner's name",
        ),
        (
            {"FLASHNODE_TASK_MEMORY_BYTES": "1M"},
            "task_memory_bytes = '1M' (from FLASHNODE_TASK_MEMORY_BYTES): must be at least 4 MiB",
        ),
        (
            {"FLASHNODE_MAX_INPUT_BYTES": "lots"},
            "must be a size in bytes, or with a unit: 512M, 8G, 1.5GiB",
        ),
        (
            {"FLASHNODE_PULL_IMAGES": "perhaps"},
            "pull_images = 'perhaps' (from FLASHNODE_PULL_IMAGES): must be true or false",
        ),
        ({"FLASHNODE_ALLOWED_IMAGES": "python:latest"}, "'python:latest' is not pinned"),
        ({"FLASHNODE_ALLOWED_IMAGES": "python"}, "'python' has no tag"),
    ],
)
def test_a_refused_setting_says_which_where_from_and_what_is_allowed(
    env: dict[str, str], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load({"coordinator": URL}, env)
    message = str(info.value)
    assert expected in message
    # No library internals: pydantic's locations, prefixes and counts.
    for internal in (".int", "Value error", "and 1 more", "Input should", "literal["):
        assert internal not in message


def test_slots_from_the_file_and_the_flag_alike(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", f'coordinator = "{URL}"\nslots = 0\n')
    with pytest.raises(ConfigError, match=rf"slots = 0 \(in {cfg}, line 2\): must be a whole"):
        load({}, {}, cfg)
    with pytest.raises(ConfigError, match=r"slots = '-1' \(from --slots\)"):
        load({"coordinator": URL, "slots": "-1"}, {})
    assert load({"coordinator": URL, "slots": "AUTO"}, {}).slots == "auto"
    assert load({"coordinator": URL}, {"FLASHNODE_SLOTS": "3"}).slots == 3


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8G", 8 << 30),
        ("512M", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("2GB", 2_000_000_000),
        ("64 KiB", 64 << 10),
        ("4096", 4096),
        ("100B", 100),
    ],
)
def test_sizes_take_units(tmp_path: Path, text: str, size: int) -> None:
    cfg = write(
        tmp_path / "c.toml",
        f'coordinator = "{URL}"\ntask_memory_bytes = "{text}"\nmax_input_bytes = "{text}"\n',
    )
    if size >= 4 << 20:
        s = load({}, {}, cfg)
        assert s.task_memory_bytes == size and s.max_input_bytes == size
    assert load({"coordinator": URL}, {"FLASHNODE_MAX_INPUT_BYTES": text}).max_input_bytes == size
    assert load({"coordinator": URL, "min_free_bytes": size}, {}).min_free_bytes == size


@pytest.mark.parametrize("text", ["-1G", "8X", "G", "1.5", "8Gi", "true"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="must be a size in bytes"):
        load({"coordinator": URL}, {"FLASHNODE_LOG_MAX_BYTES": text})


def test_the_state_dir_is_systemds_when_it_gives_one(tmp_path: Path) -> None:
    given = tmp_path / "service-state"
    assert load({"coordinator": URL}, {"STATE_DIRECTORY": str(given)}).state_dir == given
    assert load(
        {"coordinator": URL}, {"STATE_DIRECTORY": str(given), "FLASHNODE_STATE_DIR": "/x"}
    ).state_dir == Path("/x")


def test_credentials_handed_in_by_systemd_come_first(tmp_path: Path) -> None:
    """LoadCredential=flashnode:/etc/flashnode/credentials names each file flashnode_<file>."""
    handed = tmp_path / "creds-from-systemd"
    stored = tmp_path / "creds-of-login"
    for d in (handed, stored):
        d.mkdir(mode=0o700)
    write(stored / "127.0.0.1_8100.token", "old\n")
    write(stored / "127.0.0.1_8100.join-code", "jc-stored\n")
    s = load({"coordinator": URL, "credentials_dir": stored}, {})
    assert s.token is not None and s.token.get_secret_value() == "old"
    assert s.join_code is not None and s.join_code.get_secret_value() == "jc-stored"
    write(handed / "flashnode_127.0.0.1_8100.token", "handed\n", 0o400)
    s = load(
        {"coordinator": URL, "credentials_dir": stored}, {"CREDENTIALS_DIRECTORY": str(handed)}
    )
    assert s.token is not None and s.token.get_secret_value() == "handed"
    # The explicit environment still wins over anything stored.
    s = load(
        {"coordinator": URL, "credentials_dir": stored},
        {"CREDENTIALS_DIRECTORY": str(handed), "FLASHNODE_TOKEN": "env"},
    )
    assert s.token is not None and s.token.get_secret_value() == "env"
    # The same coordinator written differently finds the same files.
    s = load({"coordinator": "HTTP://127.0.0.1:8100/", "credentials_dir": stored}, {})
    assert s.token is not None and s.token.get_secret_value() == "old"


def test_coordinator_urls_are_normalised_or_refused() -> None:
    assert load({"coordinator": "http://LOCALHOST"}, {}).coordinator == "http://localhost:80"
    assert load({"coordinator": "http://[::1]:9/x/"}, {}).coordinator == "http://[::1]:9/x"
    for bad, why in [
        ("notaurl", "is not a URL: write it with its scheme"),
        ("127.0.0.1:19101", "is not a URL: write it with its scheme"),
        ("ftp://x", "is not an http(s) URL"),
        ("http://127.0.0.1:99999", "bad port"),
        ("http://u:p@127.0.0.1", "must not carry credentials"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(why)):
            load({"coordinator": bad}, {})


def test_cli_refused_settings_exit_78_in_one_line(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    for args, env, text in [
        (("--slots", "-1"), {}, "slots = '-1' (from --slots)"),
        ((), {"FLASHNODE_SLOTS": "-2"}, "slots = '-2' (from FLASHNODE_SLOTS)"),
        (("--token-file", str(tmp_path / "missing")), {}, "cannot read token file"),
        (("--token-file", str(tmp_path)), {}, "cannot read token file"),
        (("--join-code-file", str(tmp_path / "missing")), {}, "cannot read join code file"),
    ]:
        r = flashnode(
            "work", "--coordinator", URL, "--state-dir", str(tmp_path / "s"), *args, env=env
        )
        assert r.returncode == 78, (args, r.stderr)
        assert text in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_setting_refused_with_another_names_where_each_came_from_not_a_flag(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    cfg = write(tmp_path / "flashnode.toml", '# mine\nrunner = "trusted"\n', 0o600)
    far = write(tmp_path / "far.toml", 'coordinator = "http://example.com"\n', 0o600)
    state = ("--state-dir", str(tmp_path / "s"))
    for args, env, text in [
        (
            ("--coordinator", URL, "--config", str(cfg)),
            {},
            f"runner = 'trusted' (in {cfg}, line 2)",
        ),
        (("--coordinator", URL), {"FLASHNODE_RUNNER": "trusted"}, "(from FLASHNODE_RUNNER)"),
        (("--coordinator", URL, "--runner", "trusted"), {}, "runner = 'trusted' (from --runner)"),
        (("--config", str(far)), {}, f"coordinator = 'http://example.com:80' (in {far}, line 1)"),
    ]:
        r = flashnode("work", *state, *args, env=env)
        assert r.returncode == 78, (args, r.stderr)
        assert text in r.stderr and r.stderr.count("\n") == 1, r.stderr
        if "--runner" not in args:
            assert "--runner" not in r.stderr, r.stderr


def test_an_unreadable_token_file_exits_78_like_a_missing_one(tmp_path: Path) -> None:
    token = write(tmp_path / "token", "s3cret\n", 0o000)
    if os.geteuid() == 0:
        # root reads any file: run the agent as an unprivileged user instead.
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to run as another user")
        nobody = pwd.getpwnam("nobody")
        tmp_path.chmod(0o755)
        prefix = [
            "setpriv",
            f"--reuid={nobody.pw_uid}",
            f"--regid={nobody.pw_gid}",
            "--clear-groups",
        ]
    else:
        prefix = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
    r = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "flashnode",
            "work",
            "--coordinator",
            URL,
            "--state-dir",
            str(tmp_path / "s"),
            "--token-file",
            str(token),
        ],
        capture_output=True,
        text=True,
        env={**env, "HOME": str(tmp_path)},
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 78, r.stderr
    assert "cannot read token file" in r.stderr and "Permission denied" in r.stderr


def test_a_runners_options_are_read_from_its_table(tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "c.toml",
        f'coordinator = "{URL}"\nrunner = "trusted"\npools = ["p"]\n\n'
        '[trusted]\ntask_user = "team-task"\n\n'
        '[docker]\ncontainer_user = "1000:1000"\nallowed_images = ["busybox:1.36"]\n',
    )
    s = load_settings({}, {}, cfg)
    assert (s.task_user, s.container_user, s.allowed_images) == (
        "team-task",
        "1000:1000",
        ("busybox:1.36",),
    )
    # A refused value in a table names its line.
    cfg.write_text(f'coordinator = "{URL}"\n[docker]\n\ncontainer_user = "0:0"\n')
    with pytest.raises(ConfigError, match=r"container_user = '0:0' \(in .*c.toml, line 4\)"):
        load_settings({}, {}, cfg)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[docker]\ntask_user = "x"\n', "task_user belongs in [trusted], not in [docker]"),
        ("[docker]\nslots = 2\n", "slots is not a [docker] option: a setting of the whole agent"),
        ('[docker]\ncontaner_user = "1:1"\n', "unknown key 'contaner_user' in [docker] (did you"),
        ('container_user = "1:1"\n[docker]\ncontainer_user = "2:2"\n', "set both in [docker]"),
        ('docker = "yes"\n', "docker must be a table ([docker])"),
    ],
)
def test_a_runner_table_refuses_what_is_not_its_own(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load({}, {}, write(tmp_path / "c.toml", f'coordinator = "{URL}"\n{text}'))
    assert message in str(info.value)


def test_a_runners_option_at_the_top_level_still_reads_and_says_where_it_now_goes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = write(
        tmp_path / "c.toml",
        f'coordinator = "{URL}"\ncontainer_user = "1000:1000"\n[trusted]\ntask_user = "t"\n',
    )
    with caplog.at_level(logging.DEBUG):
        assert load({}, {}, cfg).container_user == "1000:1000"
    # Loading says nothing (a command's output, a --log-json stream, stay clean): the agent's
    # start and the doctor say where it goes.
    assert not caplog.records
    assert top_level_runner_keys(cfg) == [("container_user", "docker")]


# --- the runtime per container task (issue 45) -------------------------------------------------

RUNTIMES = """coordinator = "http://127.0.0.1:8100"
pools = ["team", "open"]
[docker]
container_runtime = "runc"
public_runtime = "runsc"
[docker.pool_runtimes]
open = "runsc"
"""


def test_each_task_gets_its_pools_runtime_else_public_or_container_runtime(
    tmp_path: Path,
) -> None:
    s = load({}, {}, write(tmp_path / "c.toml", RUNTIMES))
    assert (s.runtime_for(None), s.runtime_for("open"), s.runtime_for("team")) == (
        "runsc",
        "runsc",
        "runc",
    )
    assert s.runtimes() == ("runc", "runsc")
    env = {"FLASHNODE_POOLS": "a,b", "FLASHNODE_POOL_RUNTIMES": "b=kata-qemu"}
    s = load({"coordinator": URL}, env)
    # Nothing named: the engine's default for all; public_runtime falls back to
    # container_runtime.
    assert (s.runtime_for(None), s.runtime_for("a"), s.runtime_for("b")) == (
        None,
        None,
        "kata-qemu",
    )
    s = load({"coordinator": URL, "container_runtime": "runsc"}, {})
    assert s.runtime_for(None) == "runsc" and s.runtimes() == ("runsc",)


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            ('container_runtime = "runc"', 'container_runtime = "run sc"'),
            "container_runtime = 'run sc' (in {cfg}, line 4): 'run sc' is not a runtime's name",
        ),
        (
            ('public_runtime = "runsc"', 'public_runtime = "../runsc"'),
            "'../runsc' is not a runtime's name",
        ),
        (('open = "runsc"', 'open = "run;sc"'), "open: 'run;sc' is not a runtime's name"),
        (
            ('open = "runsc"', 'open = "runsc"\nelsewhere = "runsc"'),
            "pool_runtimes = {'open': 'runsc', 'elsewhere': 'runsc'} (in {cfg}, line 6):"
            " elsewhere is not among pools = ('team', 'open') (in {cfg}, line 2)",
        ),
        (('open = "runsc"', '"bad pool!" = "runsc"'), "'bad pool!' is not a valid pool id"),
    ],
)
def test_bad_runtimes_and_pools_in_the_runtime_policy_are_refused_saying_where(
    tmp_path: Path, edit: tuple[str, str], said: str
) -> None:
    cfg = write(tmp_path / "c.toml", RUNTIMES.replace(*edit))
    with pytest.raises(ConfigError) as refused:
        load({}, {}, cfg)
    assert said.replace("{cfg}", str(cfg)) in str(refused.value)
    with pytest.raises(ConfigError, match="pool=runtime pairs"):
        load({"coordinator": URL}, {"FLASHNODE_POOL_RUNTIMES": "open"})


@pytest.mark.parametrize("value", ["", "off", " OFF "])
def test_an_empty_or_off_metrics_address_serves_no_metrics(value: str) -> None:
    """As the console's: "off" (an empty variable is no variable: the file's value stays)."""
    env = {"FLASHNODE_COORDINATOR": "http://127.0.0.1:1"}
    assert load_settings({"metrics_listen": value}, env).metrics_listen is None
    assert load_settings({"ui_listen": value}, env).ui_listen is None
    if value:
        off = load_settings({}, {**env, "FLASHNODE_METRICS_LISTEN": value})
        assert off.metrics_listen is None
    served = load_settings({}, {**env, "FLASHNODE_METRICS_LISTEN": " 127.0.0.1:9469 "})
    assert served.metrics_listen == "127.0.0.1:9469"
