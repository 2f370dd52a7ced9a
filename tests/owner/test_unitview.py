"""The service's view of the file system, read from the unit and its drop-ins (unitview.py): what
each path is to the packaged service, and the fix in unit settings. tests/owner/test_systemd.py checks
the same against a real systemd; this checks the evaluation itself, and that doctor uses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashnode.config.settings import Settings
from flashnode.owner import unitview
from flashnode.runners import preflight

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = unitview.parse((ROOT / "systemd" / "flashnode.service").read_text())


@pytest.mark.parametrize(
    ("path", "access", "setting"),
    [
        ("/var/lib/flashnode/ledger.jsonl", "write", "StateDirectory=flashnode"),
        ("/etc/flashnode/flashnode.toml", "write", "ReadWritePaths=/etc/flashnode"),
        ("/etc/flashnode/credentials/x.token", "read", "ReadOnlyPaths=/etc/flashnode/credentials"),
        ("/srv/flashnode", "read", "ProtectSystem=strict"),
        ("/root/token", "hidden", "ProtectHome=yes"),
        ("/home/owner/scans", "hidden", "ProtectHome=yes"),
        ("/run/user/1000/x", "hidden", "ProtectHome=yes"),
        ("/tmp/state", "private", "PrivateTmp=yes"),
    ],
)
def test_the_shipped_unit_confines_paths_as_systemd_does(
    path: str, access: str, setting: str
) -> None:
    assert SHIPPED.verdict(Path(path)) == unitview.Verdict(access, setting)  # type: ignore[arg-type]
    assert SHIPPED.config_file == Path("/etc/flashnode/flashnode.toml")
    assert SHIPPED.credentials == {"flashnode": Path("/etc/flashnode/credentials")}


def test_drop_ins_apply_in_order_and_an_empty_list_setting_resets_it(tmp_path: Path) -> None:
    vendor, admin = tmp_path / "usr", tmp_path / "etc"
    (vendor / "flashnode.service.d").mkdir(parents=True)
    (admin / "flashnode.service.d").mkdir(parents=True)
    (vendor / "flashnode.service").write_text((ROOT / "systemd" / "flashnode.service").read_text())
    (vendor / "flashnode.service.d" / "10-vendor.conf").write_text(
        "[Service]\nReadWritePaths=/opt/vendor\n"
    )
    (admin / "flashnode.service.d" / "10-vendor.conf").write_text(  # replaces the vendor's
        "[Service]\nReadWritePaths=\nReadWritePaths=/srv/flashnode\n"
    )
    (admin / "flashnode.service.d" / "override.conf").write_text(
        "[Service]\nProtectHome=tmpfs\nBindReadOnlyPaths=/root/token \\\n  -/home/owner/scans\n"
    )
    view = unitview.load(dirs=[admin, vendor])
    assert view is not None and [f.name for f in view.files] == [
        "flashnode.service",
        "10-vendor.conf",
        "override.conf",
    ]
    assert view.verdict(Path("/srv/flashnode/x")).access == "write"
    assert view.verdict(Path("/opt/vendor")).access == "read"  # reset by the empty assignment
    assert view.verdict(Path("/etc/flashnode")).access == "read"  # so was the shipped one
    assert view.verdict(Path("/root/token")) == unitview.Verdict(
        "read", "BindReadOnlyPaths=/root/token"
    )
    assert view.verdict(Path("/home/owner/scans/a")).access == "read"
    assert view.verdict(Path("/home/other")) == unitview.Verdict("hidden", "ProtectHome=tmpfs")
    assert unitview.load(dirs=[tmp_path / "none"]) is None


def test_each_path_the_service_cannot_use_is_refused_with_the_unit_setting_to_change(
    tmp_path: Path,
) -> None:
    lent = tmp_path / "lent"  # stands for /home/owner/scans: the check reads no path
    lent.mkdir()
    settings = Settings(
        coordinator="http://127.0.0.1:9",
        state_dir=Path("/srv/flashnode"),
        token_file=None,
        local_data={"scans": lent},
    )
    raw = {
        **settings.model_dump(),
        "token_file": "/root/token",
        "local_data": {"scans": "/home/owner/scans"},
    }
    found = {f.need.key: f for f in unitview.check(SHIPPED, raw)}
    assert set(found) == {"state_dir", "token_file", "local_data"}
    assert "read-only for the service: ProtectSystem=strict in flashnode.service" in (
        found["state_dir"].why
    )
    assert found["state_dir"].fix.endswith(
        "sudo systemctl edit flashnode, then under [Service]: ReadWritePaths=/srv/flashnode"
    )
    assert "sudo install -d -m 0700 /srv/flashnode" in found["state_dir"].fix
    assert "ProtectHome=yes in flashnode.service hides it" in found["token_file"].why
    assert "ProtectHome=tmpfs and BindReadOnlyPaths=/root/token" in found["token_file"].fix
    assert "BindReadOnlyPaths=/home/owner/scans" in found["local_data"].fix
    # The preflight (doctor, and work under the unit) fails them, the state dir's check giving
    # way to the unit's (not "chmod u+rwx").
    problems = [
        p
        for p in preflight.check(settings, service=SHIPPED)
        if isinstance(p, preflight.Problem) and p.what == "state_dir"
    ]
    assert len(problems) == 1 and problems[0].fatal
    assert not any(
        isinstance(p, preflight.Problem) and "chmod" in p.fix
        for p in preflight.check(settings, service=SHIPPED)
    )
