"""What the installed systemd unit lets the agent see: its file-system sandbox, read from the unit
file and its drop-ins, so that ``flashnode doctor`` judges paths the way the service will meet
them, and the service's own errors name the unit setting to change.

The unit confines the agent with ``ProtectSystem=``, ``ProtectHome=``, ``ReadWritePaths=``,
``ReadOnlyPaths=``, ``InaccessiblePaths=``, ``BindPaths=``, ``BindReadOnlyPaths=``,
``StateDirectory=``, ``PrivateTmp=`` and hands it credentials with ``LoadCredential=``. What a path
is to the service (as systemd 252 applies these, checked in tests/test_systemd.py):

* under ``ProtectHome=yes`` (``/home``, ``/root``, ``/run/user``) or an ``InaccessiblePaths=``
  entry: nothing, whatever else is set (no ``ReadWritePaths=`` or bind reaches below it);
* under ``ProtectHome=tmpfs``: only what ``BindPaths=`` / ``BindReadOnlyPaths=`` bring in;
* else writable or read-only by the most specific entry that covers it: ``ReadWritePaths=``,
  ``StateDirectory=`` and ``BindPaths=`` write, ``ReadOnlyPaths=`` and ``BindReadOnlyPaths=``
  read, ``ProtectSystem=strict`` makes ``/`` read-only (``full``: ``/usr``, ``/boot``, ``/efi``,
  ``/etc``; ``yes``: without ``/etc``), ``ProtectHome=read-only`` the homes;
* under ``/tmp`` or ``/var/tmp`` with ``PrivateTmp=``: the service's own, not the host's.

Pure parsing and evaluation; reading the unit's files is ``load``'s only side effect.
"""

from __future__ import annotations

import glob
import os
import shlex
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

UNIT = "flashnode.service"
SERVICE_UNIT = Path("/usr/lib/systemd/system/flashnode.service")  # where the package puts it
# Where systemd looks for system units, the first that has one winning (the owner's /etc first).
UNIT_DIRS = (
    Path("/etc/systemd/system"),
    Path("/run/systemd/system"),
    Path("/usr/local/lib/systemd/system"),
    Path("/usr/lib/systemd/system"),
    Path("/lib/systemd/system"),
)
HOMES = (Path("/home"), Path("/root"), Path("/run/user"))
LISTS = (
    "ReadWritePaths",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "BindPaths",
    "BindReadOnlyPaths",
    "StateDirectory",
    "LoadCredential",
    "ExecStart",
)
SCALARS = ("ProtectSystem", "ProtectHome", "PrivateTmp")
DROP_IN = "sudo systemctl edit {unit}, then under [Service]:"

Access = Literal["write", "read", "hidden", "private"]


@dataclass(frozen=True)
class Verdict:
    """What a path is to the service, and the setting that makes it so ("" for none)."""

    access: Access
    setting: str = ""


@dataclass(frozen=True)
class UnitView:
    name: str
    files: tuple[Path, ...]  # the unit, then its drop-ins, in the order systemd applies them
    settings: Mapping[str, Any] = field(default_factory=dict)

    # --- what the unit says --------------------------------------------------------------------

    def scalar(self, key: str, default: str = "no") -> str:
        value = self.settings.get(key)
        return value if isinstance(value, str) and value else default

    def paths(self, key: str) -> list[Path]:
        """The paths a list setting names (``-`` and ``+`` prefixes dropped; a bind's target)."""
        out = []
        for item in self.settings.get(key) or []:
            item = item.lstrip("-+")
            if key.startswith("Bind"):
                source, _, rest = item.partition(":")
                item = rest.partition(":")[0] or source
            if item.startswith("/"):
                out.append(Path(os.path.normpath(item)))
        return out

    @property
    def protect_system(self) -> str:
        value = self.scalar("ProtectSystem")
        return {"true": "yes", "1": "yes", "on": "yes", "false": "no", "0": "no"}.get(value, value)

    @property
    def protect_home(self) -> str:
        value = self.scalar("ProtectHome")
        return {"true": "yes", "1": "yes", "on": "yes", "false": "no", "0": "no"}.get(value, value)

    @property
    def state_directories(self) -> list[Path]:
        return [Path("/var/lib") / d for d in self.settings.get("StateDirectory") or []]

    @property
    def credentials(self) -> dict[str, Path]:
        """``LoadCredential=ID:PATH``: what is handed in, by id."""
        found = {}
        for item in self.settings.get("LoadCredential") or []:
            ident, _, path = item.partition(":")
            if path.startswith("/"):
                found[ident] = Path(os.path.normpath(path))
        return found

    @property
    def config_file(self) -> Path | None:
        """The ``--config`` of ``ExecStart=`` (what the service reads)."""
        for line in self.settings.get("ExecStart") or []:
            try:
                words = shlex.split(line)
            except ValueError:
                continue
            for i, word in enumerate(words):
                if word == "--config" and i + 1 < len(words):
                    return Path(words[i + 1])
                if word.startswith("--config="):
                    return Path(word.split("=", 1)[1])
        return None

    def describe(self) -> str:
        """``flashnode.service (ProtectSystem=strict, ProtectHome=yes; /usr/lib/…, …)``."""
        shown = "; ".join(str(f) for f in self.files)
        return (
            f"{self.name} (ProtectSystem={self.protect_system},"
            f" ProtectHome={self.protect_home}; {shown})"
        )

    # --- what a path is to the service ---------------------------------------------------------

    def verdict(self, path: Path) -> Verdict:
        path = Path(os.path.normpath(path))
        for root in self.paths("InaccessiblePaths"):
            if _under(path, root):
                return Verdict("hidden", f"InaccessiblePaths={root}")
        home = next((h for h in HOMES if _under(path, h)), None)
        if home is not None and self.protect_home == "yes":
            return Verdict("hidden", "ProtectHome=yes")
        if home is not None and self.protect_home == "tmpfs":
            bound = self._longest(
                [(p, "write", f"BindPaths={p}") for p in self.paths("BindPaths")]
                + [(p, "read", f"BindReadOnlyPaths={p}") for p in self.paths("BindReadOnlyPaths")],
                path,
            )
            return bound or Verdict("hidden", "ProtectHome=tmpfs")
        if self.scalar("PrivateTmp") in ("yes", "true", "1", "on") and any(
            _under(path, t) for t in (Path("/tmp"), Path("/var/tmp"))
        ):
            return Verdict("private", "PrivateTmp=yes")
        rules: list[tuple[Path, Access, str]] = []
        system = self.protect_system
        if system == "strict":
            rules.append((Path("/"), "read", "ProtectSystem=strict"))
        elif system in ("yes", "full"):
            tops = ["/usr", "/boot", "/efi"] + (["/etc"] if system == "full" else [])
            rules += [(Path(t), "read", f"ProtectSystem={system}") for t in tops]
        if home is not None and self.protect_home == "read-only":
            rules.append((home, "read", "ProtectHome=read-only"))
        rules += [(p, "write", f"ReadWritePaths={p}") for p in self.paths("ReadWritePaths")]
        rules += [(p, "write", f"StateDirectory={p.name}") for p in self.state_directories]
        rules += [(p, "write", f"BindPaths={p}") for p in self.paths("BindPaths")]
        rules += [(p, "read", f"ReadOnlyPaths={p}") for p in self.paths("ReadOnlyPaths")]
        rules += [(p, "read", f"BindReadOnlyPaths={p}") for p in self.paths("BindReadOnlyPaths")]
        return self._longest(rules, path) or Verdict("write")

    @staticmethod
    def _longest(rules: list[tuple[Path, Access, str]], path: Path) -> Verdict | None:
        """The most specific rule covering ``path`` (on a tie, the read-only one)."""
        found = [r for r in rules if _under(path, r[0])]
        if not found:
            return None
        _, access, setting = max(found, key=lambda r: (len(r[0].parts), r[1] == "read"))
        return Verdict(access, setting)


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


# --- reading the unit ---------------------------------------------------------------------------


def load(name: str = UNIT, dirs: Iterable[Path] = UNIT_DIRS) -> UnitView | None:
    """The installed unit ``name`` with its drop-ins, or None when it is not installed."""
    dirs = list(dirs)
    unit = next((d / name for d in dirs if (d / name).is_file()), None)
    if unit is None:
        return None
    drop_ins: dict[str, Path] = {}
    for d in reversed(dirs):  # a drop-in of the same name in a higher directory replaces it
        for found in glob.glob(str(d / f"{name}.d" / "*.conf")):
            drop_ins[Path(found).name] = Path(found)
    files = [unit, *(drop_ins[k] for k in sorted(drop_ins))]
    settings: dict[str, Any] = {}
    for file in files:
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        _apply(settings, _service_lines(text))
    return UnitView(name, tuple(files), settings)


def parse(text: str, name: str = UNIT) -> UnitView:
    """A unit from its text alone (for tests and for the unit shipped in the package)."""
    settings: dict[str, Any] = {}
    _apply(settings, _service_lines(text))
    return UnitView(name, (), settings)


def _service_lines(text: str) -> Iterator[tuple[str, str]]:
    """The ``[Service]`` section's assignments, continuation lines joined."""
    section, pending = "", ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[] ")
            continue
        key, sep, value = line.partition("=")
        if sep and section == "Service":
            yield key.strip(), value.strip()


def _apply(settings: dict[str, Any], lines: Iterable[tuple[str, str]]) -> None:
    for key, value in lines:
        if key in LISTS:
            if not value:
                settings[key] = []  # an empty assignment resets the list
            elif key == "ExecStart":
                settings.setdefault(key, []).append(value)
            else:
                try:
                    words = shlex.split(value)
                except ValueError:
                    words = value.split()
                settings.setdefault(key, []).extend(words)
        elif key in SCALARS:
            settings[key] = value.lower()


# --- what the agent needs of the paths its settings name ----------------------------------------


@dataclass(frozen=True)
class Need:
    """A path a setting names, and what the agent must be able to do with it."""

    key: str
    path: Path
    access: Literal["write", "read"]
    what: str  # in the owner's words: "state dir", "token file", "lent directory scans"


def needs(raw: Mapping[str, Any]) -> list[Need]:
    """The paths the settings (as given: flags, environment, file, before checking) name."""
    found: list[Need] = []

    def add(key: str, value: Any, access: Literal["write", "read"], what: str) -> None:
        if isinstance(value, (str, Path)) and str(value).startswith("/"):
            found.append(Need(key, Path(value), access, what))

    add("state_dir", raw.get("state_dir"), "write", "the state dir")
    add("token_file", raw.get("token_file"), "read", "the token file")
    add("join_code_file", raw.get("join_code_file"), "read", "the join code file")
    add("dataset_ca_file", raw.get("dataset_ca_file"), "read", "the dataset CA file")
    add("task_python", raw.get("task_python"), "read", "task_python")
    add("nvml_library", raw.get("nvml_library"), "read", "nvml_library")
    lent = raw.get("local_data")
    if isinstance(lent, str):
        lent = dict(p.split("=", 1) for p in lent.split(",") if "=" in p)
    if isinstance(lent, Mapping):
        for label, path in sorted(lent.items()):
            add("local_data", str(path).strip(), "read", f"the lent directory {label}")
    return found


@dataclass(frozen=True)
class Finding:
    """A path the service cannot use as the agent needs: why, and the fix in unit settings."""

    need: Need
    why: str
    fix: str


def check(view: UnitView, raw: Mapping[str, Any]) -> list[Finding]:
    """Every path the settings name that the service could not use as it must."""
    out = []
    for need in needs(raw):
        verdict = view.verdict(need.path)
        if need.access == "read" and verdict.access in ("read", "write"):
            continue
        if need.access == "write" and verdict.access == "write":
            continue
        out.append(_finding(view, need, verdict))
    return out


def _finding(view: UnitView, need: Need, verdict: Verdict) -> Finding:
    path, unit = need.path, view.name
    edit = DROP_IN.format(unit=unit.removesuffix(".service"))
    seen = f"{need.what} {path} ({need.key})"
    if verdict.access == "private":
        return Finding(
            need,
            f"{seen} is under the service's private /tmp ({verdict.setting} in {unit}): it is"
            " not the directory outside",
            f"set {need.key} to a path outside /tmp and /var/tmp",
        )
    if verdict.access == "hidden":
        bind = "BindPaths" if need.access == "write" else "BindReadOnlyPaths"
        how = (
            f"{edit} ProtectHome=tmpfs and {bind}={path}"
            if verdict.setting.startswith("ProtectHome")
            else f"{edit} remove the {verdict.setting.split('=')[0]} entry that covers it"
        )
        move = (
            " (or move it out of /home, /root and /run/user)"
            if verdict.setting.startswith("ProtectHome")
            else ""
        )
        return Finding(
            need,
            f"{seen} does not exist for the service: {verdict.setting} in {unit} hides it",
            how + move,
        )
    # read-only where the agent must write
    make = "" if path.exists() else f"sudo install -d -m 0700 {path}; then "
    return Finding(
        need,
        f"{seen} is read-only for the service: {verdict.setting} in {unit}",
        f"{make}{edit} ReadWritePaths={path}",
    )


def running_under() -> str | None:
    """The systemd service this process runs in (its cgroup), when systemd started it."""
    if not os.environ.get("INVOCATION_ID"):
        return None
    from flashnode.owner.statelock import systemd_unit

    return systemd_unit(os.getpid())
