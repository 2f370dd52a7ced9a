"""doctor's fix for a refused setting says where to correct it: the config file by its path (a
runner's option: the table of it), the variable or the flag the refusal names."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from flashnode.cli.main import main

BASE = 'coordinator = "http://127.0.0.1:9"\nstate_dir = "{state}"\n'


def doctor(config: Path, **env: str) -> list[str]:
    clean = {"FLASHNODE_STATE_DIR": None, "FLASHNODE_COORDINATOR": None, **env}
    done = CliRunner().invoke(main, ["doctor", "--config", str(config)], env=clean)
    assert done.exit_code == 1, done.output
    return done.output.splitlines()


def write(tmp_path: Path, text: str) -> Path:
    config = tmp_path / "flashnode.toml"
    config.write_text(BASE.format(state=tmp_path / "state") + text)
    return config


def test_a_refused_top_level_setting_names_the_config_file(tmp_path: Path) -> None:
    config = write(tmp_path, 'slots = "x"\n')
    failed, fix = doctor(config)[:2]
    assert failed.startswith("FAIL  configuration: slots = 'x'")
    assert fix.startswith(f"      fix: correct the setting named above in {config};"), fix
    assert "[docker]" not in fix and "[trusted]" not in fix


@pytest.mark.parametrize(
    ("table", "text"),
    [
        ("docker", 'runner = "docker"\n[docker]\ncontainer_user = "0:0"\n'),
        ("trusted", 'runner = "trusted"\npools = ["p"]\n[trusted]\nallow_same_user = "maybe"\n'),
    ],
)
def test_a_refused_runner_option_names_its_table_of_the_config_file(
    tmp_path: Path, table: str, text: str
) -> None:
    config = write(tmp_path, text)
    fix = doctor(config)[1]
    assert f"correct the setting named above in the [{table}] table of {config};" in fix, fix


def test_a_setting_refused_from_the_environment_names_the_variable_not_the_file(
    tmp_path: Path,
) -> None:
    config = write(tmp_path, "")
    fix = doctor(config, FLASHNODE_SLOTS="0")[1]
    assert "correct FLASHNODE_SLOTS where it is set" in fix and str(config) not in fix, fix


def test_a_bad_key_in_a_runner_table_names_the_file_and_the_tables(tmp_path: Path) -> None:
    config = write(tmp_path, '[docker]\ncontainer_usr = "1:1"\n')
    failed, fix = doctor(config)[:2]
    assert "did you mean 'container_user'" in failed
    assert f"correct {config} as said above" in fix and "[docker] or [trusted]" in fix, fix
