"""docs/reference.md says what the code does: its tables are read row by row and compared with
the code, never generated into the page.

- Configuration: every field of the ``Settings`` model is a row, once, and no row names a setting
  the model lacks; each row's type is the field's, its default the field's default, its flag a
  flag of ``flashnode work`` for that key; and the forms a row promises (a unit on every
  ``*_bytes`` key, lists comma- or ``;``-separated in the environment) load from the file and from
  ``FLASHNODE_*`` alike.
- Exit codes: every ``ExitCode`` (and ``status``/``ui``'s 3) with its number, and nothing else.
- Metrics: every series the agent's registry exports, with its type and labels, and no other.
- The command line: every command of the ``flashnode`` click group and every option and argument
  of each, and nothing else.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args, get_origin

import click
import pytest

from flashnode.cli.main import main as cli
from flashnode.cli.ui import NO_AGENT
from flashnode.config.loading import SETTABLE, load
from flashnode.config.settings import RUNNER_TABLES, Settings
from flashnode.config.sizes import parse_size
from flashnode.errors import ExitCode
from flashnode.owner.metrics import HELD_RULES, Metrics

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
URL = "http://127.0.0.1:9"

# Rows whose default the reference gives in words (computed, or the system's): each says why.
IN_WORDS = {
    "coordinator": "required",
    "state_dir": "systemd's, root's or the user's directory",
    "node_id": "generated once",
    "credentials_dir": "root's or the user's directory",
    "docker.container_user": "65534:65534 as root, else the agent's own uid (the runner decides)",
    "nvml_library": "the driver's",
    "task_memory_bytes": "a share of the machine's memory",
    "task_cpus": "a share of the machine's cores",
    "run_windows_timezone": "the system's",
    "max_suspend_seconds": "the lease's lease_seconds",
    "dataset_ca_file": "the default trust store",
}
# One value per key in the form the reference documents, for the keys whose form is not its
# type's.
SAMPLES: dict[str, tuple[Any, Any]] = {  # key: (value as given, value as loaded)
    "pools": ("team-a,team-b", ("team-a", "team-b")),
    "gpu_yield_ignore": ("Xorg,picom", ("Xorg", "picom")),
    "docker.allowed_images": ("busybox:1.36,alpine:3.19", ("busybox:1.36", "alpine:3.19")),
    "run_windows": ("Mon-Fri 19:00-07:00;Sat-Sun", ("Mon-Fri 19:00-07:00", "Sat-Sun")),
    "dataset_allow_private_origins": (
        "192.168.1.20,10.8.0.0/16",
        ("192.168.1.20/32", "10.8.0.0/16"),
    ),
    "env_allow_private_indexes": ("10.8.0.0/16,127.0.0.1", ("10.8.0.0/16", "127.0.0.1/32")),
}


# --- reading the page ----------------------------------------------------------------------------


def section(title: str) -> str:
    """The text under ``## title``, up to the next ``## ``."""
    text = REFERENCE.read_text()
    assert f"\n## {title}\n" in text, f"docs/reference.md has no section '## {title}'"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def table(title: str) -> list[list[str]]:
    """The cells of each row of the first table in a section (its header and rule left out)."""
    rows = []
    lines = [x for x in section(title).splitlines() if x.startswith("|")]
    assert len(lines) > 2, f"'## {title}' has no table"
    for line in lines[2:]:
        # a "|" inside backticks is part of a cell (`a\|b`), never a column
        cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])
        rows.append([c.strip() for c in cells])
    return rows


def ticked(cell: str) -> list[str]:
    """What the backticks of a cell hold, in order."""
    return re.findall(r"`([^`]+)`", cell)


# --- settings ----------------------------------------------------------------------------------


def settings_fields() -> dict[str, Any]:
    """Every setting an owner can set, by its name in the file: a runner's own options as
    ``table.key`` (``docker.container_user``: ``RUNNER_TABLES``)."""
    table_of = {key: table for table, keys in RUNNER_TABLES.items() for key in keys}
    return {
        (f"{table_of[key]}.{key}" if key in table_of else key): Settings.model_fields[key]
        for key in SETTABLE
    }


FIELDS = settings_fields()


def settings_rows() -> dict[str, tuple[str, str, str, str]]:
    """key: (type, flag, default, meaning) of each row of the configuration table."""
    rows: dict[str, tuple[str, str, str, str]] = {}
    for cells in table("Configuration"):
        assert len(cells) == 5, (
            f"a configuration row is key | type | flag | default | meaning: {cells}"
        )
        keys = ticked(cells[0])
        assert len(keys) == 1, f"one key per row: {cells[0]}"
        assert keys[0] not in rows, f"{keys[0]} is documented twice"
        rows[keys[0]] = (cells[1], cells[2], cells[3], cells[4])
    return rows


ROWS = settings_rows()


def type_word(key: str, annotation: Any) -> str:
    """The reference's word for a setting's type (its introduction says what each means)."""
    if key.endswith("_bytes"):
        return "size"
    args = get_args(annotation)
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return " or ".join(type_word(key, a) for a in kinds)
    if origin is typing.Literal:
        return " or ".join(f'"{a}"' for a in args)
    if origin is tuple:
        return "list"
    if annotation is bool:
        return "bool"
    if annotation is int:
        return "integer"
    if annotation is float:
        return "number"
    if annotation is str:
        return "text"
    if annotation is Path:
        return "path"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return "table"
    raise AssertionError(f"{key}: no word for its type {annotation!r}: add one here and above")


def default_of(key: str) -> Any:
    field = FIELDS[key]
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def test_every_setting_is_a_row_and_every_row_is_a_setting() -> None:
    missing = sorted(set(FIELDS) - set(ROWS))
    extra = sorted(set(ROWS) - set(FIELDS))
    assert not missing, f"settings the reference does not list: {missing}"
    assert not extra, f"rows for settings the model lacks: {extra}"


@pytest.mark.parametrize("key", sorted(ROWS))
def test_each_rows_type_is_the_settings_type(key: str) -> None:
    if key not in FIELDS:
        pytest.skip("not a setting (the row test says so)")
    assert ROWS[key][0] == type_word(key, FIELDS[key].annotation)


@pytest.mark.parametrize("key", sorted(ROWS))
def test_the_documented_default_is_the_default(key: str) -> None:
    if key not in FIELDS:
        pytest.skip("not a setting (the row test says so)")
    default = ROWS[key][2]
    actual = default_of(key)
    if key in IN_WORDS:
        assert not re.fullmatch(r"[0-9.]+( [KMGT]iB)?|true|false|none|`[^`]*`", default), (
            f"{key}: the reference gives a plain default ({default}): check it, not IN_WORDS"
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
        assert actual == tuple(ticked(default)), (key, actual)
    else:
        raise AssertionError(f"{key}: the reference's default {default!r} is in words: IN_WORDS?")


def work_flags() -> dict[str, list[str]]:
    """The setting each of ``flashnode work``'s flags sets, with the flag's spellings."""
    work = cli.commands["work"]
    return {
        p.name: [*p.opts, *p.secondary_opts]
        for p in work.params
        if isinstance(p, click.Option) and p.name != "config_file" and p.name is not None
    }


def test_each_flag_of_work_is_in_its_settings_row_and_no_row_names_another() -> None:
    in_file = {key.rpartition(".")[2]: key for key in FIELDS}
    flags = {in_file.get(name, name): spellings for name, spellings in work_flags().items()}
    for key, spellings in flags.items():
        assert key in ROWS, f"flashnode work sets {key}, which the reference does not list"
        assert set(ticked(ROWS[key][1])) == set(spellings), (key, ROWS[key][1])
    for key, (_, flag, _, _) in ROWS.items():
        if key not in flags:
            assert not ticked(flag), f"{key}: flashnode work has no flag {flag}"


def sample(key: str) -> tuple[Any, Any, Any] | None:
    """(in the file, in the environment, as loaded) in the documented form; None: no form to
    check beyond the type's own (text, paths)."""
    if key in SAMPLES:
        given, loaded = SAMPLES[key]
        return list(re.split(r"[,;]", given)), given, loaded
    if key.endswith("_bytes"):
        return "64M", "64M", 64 << 20
    types_ = get_args(FIELDS[key].annotation) or (FIELDS[key].annotation,)
    if bool in types_ and len(types_) == 1:
        return True, "true", True
    if float in types_:
        x = 70 if key.endswith(("_percent", "_c")) else 5  # within its bounds
        return x, str(x), float(x)
    if int in types_:
        n = 1000 if key == "task_disk_files" else 8  # its least allowed value
        return n, str(n), n
    return None


def _toml(key: str, value: Any) -> str:
    """``key = value`` in the file; a table's key under its ``[table]``."""
    table_name, _, name = key.rpartition(".")
    line = f"{name} = {json.dumps(value)}\n"
    return f"[{table_name}]\n{line}" if table_name else line


def _loaded(settings: Settings, key: str) -> Any:
    return getattr(settings, key.rpartition(".")[2])


def test_every_key_with_a_listed_environment_form_has_a_sample() -> None:
    listed = [k for k, row in ROWS.items() if "comma-separated" in row[3] or "`;`-separated" in row[3]]
    assert listed and [k for k in listed if k not in SAMPLES] == []


# Text and paths have no form to check beyond their type's: not listed (no test that skips).
FORMED = [k for k in sorted(ROWS) if k in FIELDS and (k == "local_data" or sample(k) is not None)]


@pytest.mark.parametrize("key", FORMED)
def test_each_key_takes_its_documented_form_from_the_file_and_the_environment(
    key: str, tmp_path: Path
) -> None:
    config = tmp_path / "c.toml"
    if key == "local_data":  # a table in the file; label=/dir pairs in the environment
        a, b = tmp_path / "a", tmp_path / "b"
        a.mkdir()
        b.mkdir()
        in_env, loaded = f"scans={a},more={b}", {"scans": a, "more": b}
        config.write_text(f'coordinator = "{URL}"\n[local_data]\nscans = "{a}"\nmore = "{b}"\n')
        assert load({}, {}, config).local_data == loaded
        assert load({"coordinator": URL}, {"FLASHNODE_LOCAL_DATA": in_env}).local_data == loaded
        return
    found = sample(key)
    assert found is not None
    in_file, in_env, loaded = found
    config.write_text(f'coordinator = "{URL}"\n{_toml(key, in_file)}')
    assert _loaded(load({}, {}, config), key) == loaded
    env = {f"FLASHNODE_{key.rpartition('.')[2].upper()}": in_env}
    assert _loaded(load({"coordinator": URL}, env), key) == loaded


# --- exit codes --------------------------------------------------------------------------------


def test_every_exit_code_is_listed_with_its_number_and_no_other() -> None:
    documented = {}
    for cells in table("Exit codes"):
        assert re.fullmatch(r"[0-9]+", cells[0]), cells
        [name] = ticked(cells[1])
        assert cells[0] not in documented, f"exit code {cells[0]} is documented twice"
        documented[int(cells[0])] = name
    defined = {int(code): code.name for code in ExitCode}
    defined[NO_AGENT] = "NO_AGENT"  # status and ui: no agent runs on this state dir
    assert documented == defined


# --- metrics -----------------------------------------------------------------------------------


def exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """series: (type, labels) of every series the agent's registry exports, as scraped (a
    counter's name with its ``_total``)."""
    registry = Metrics().registry
    found = {}
    # The collectors' own names, types and label names: a series with no sample yet (an empty
    # label set) still counts. prometheus_client keeps them on the collector.
    for collector in list(registry._collector_to_names):
        name, kind = collector._name, collector._type  # type: ignore[attr-defined]
        labels = tuple(collector._labelnames)  # type: ignore[attr-defined]
        found[f"{name}_total" if kind == "counter" else name] = (kind, labels)
    return found


def documented_metrics() -> dict[str, tuple[str, tuple[str, ...], str]]:
    rows = {}
    for cells in table("Metrics"):
        [name] = ticked(cells[0])
        assert name not in rows, f"{name} is documented twice"
        rows[name] = (cells[1], tuple(ticked(cells[2])), cells[3])
    return rows


def test_every_exported_metric_is_listed_with_its_type_and_labels_and_no_other() -> None:
    documented = {name: (kind, labels) for name, (kind, labels, _) in documented_metrics().items()}
    assert documented == exported()


def test_every_hold_a_metric_can_name_is_listed() -> None:
    meaning = documented_metrics()["flashnode_claiming_held"][2]
    assert set(ticked(meaning)) == set(HELD_RULES)


# --- the command line --------------------------------------------------------------------------


def commands() -> dict[str, set[str]]:
    """Every command of the ``flashnode`` group (subgroups too, by their full path), with the
    spellings of its options and the names of its arguments."""
    found: dict[str, set[str]] = {}

    def walk(command: click.Command, path: str) -> None:
        if command.hidden:
            return
        found[path] = set()
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                found[path] |= {*param.opts, *param.secondary_opts}
            elif isinstance(param, click.Argument):
                found[path].add(param.human_readable_name)
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}")

    walk(cli, "flashnode")
    return found


def documented_commands() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for cells in table("The command line"):
        [command] = ticked(cells[0])
        # an option cell names each spelling first in its backticks: `--config FILE`, `-f`
        found.setdefault(command, set()).update(t.split()[0] for t in ticked(cells[1]))
    return found


def test_every_command_and_option_is_listed_and_none_that_is_not() -> None:
    documented, defined = documented_commands(), commands()
    assert sorted(documented) == sorted(defined), "commands"
    wrong = {
        command: {
            "missing": sorted(options - documented[command]),
            "extra": sorted(documented[command] - options),
        }
        for command, options in defined.items()
        if documented[command] != options
    }
    assert not wrong
