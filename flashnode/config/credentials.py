"""Where ``flashnode login`` keeps a coordinator's secrets (its token, its join code), under which
names a coordinator's secrets may be stored, where a stored one is found (systemd's
``$CREDENTIALS_DIRECTORY`` first), and how a secret file is read (only one no other user can
read).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from flashnode.config.urls import normalise_url
from flashnode.errors import ConfigError

if TYPE_CHECKING:
    from flashnode.config.settings import Settings

# systemd's LoadCredential=ID:DIRECTORY names each file of DIRECTORY "ID_<file name>".
CREDENTIAL_ID = "flashnode"


def default_credentials_dir() -> Path:
    """``/etc/flashnode/credentials`` as root, else ``$XDG_CONFIG_HOME/flashnode/credentials``."""
    if os.geteuid() == 0:
        return Path("/etc/flashnode/credentials")
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "flashnode" / "credentials"


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")  # one machine: one coordinator identity


def credentials_name(coordinator: str) -> str:
    """The stem of the files ``flashnode login`` keeps a coordinator's secrets in: host_port."""
    return credentials_names(coordinator)[0]


def credentials_names(coordinator: str) -> list[str]:
    """Every stem under which a coordinator's secrets may be stored, its own first: the
    coordinator is one by identity (scheme's default port made explicit, the host's case and a
    trailing dot dropped), so ``http://localhost:27820`` and ``http://127.0.0.1:27820`` (and
    ``[::1]``) name the same one. Names that resolve elsewhere (DNS) are never taken as one:
    secrets go only where the owner's own words send them."""
    parts = urlsplit(normalise_url(coordinator))
    host, port = parts.hostname or "", parts.port

    def stem(name: str) -> str:
        return f"{re.sub(r'[^A-Za-z0-9.-]', '_', name)}_{port}"

    names = [stem(host)]
    if host in LOOPBACK_NAMES:
        names += [stem(h) for h in LOOPBACK_NAMES if h != host]
    return names


def credentials_file(coordinator: str, directory: Path, kind: str = "token") -> Path:
    """The file ``flashnode login`` keeps a coordinator's token (or ``join-code``) in."""
    return directory / f"{credentials_name(coordinator)}.{kind}"


def stored_credential(
    coordinator: str, kind: str, directory: Path, env: Mapping[str, str]
) -> Path | None:
    """Where a stored token or join code for ``coordinator`` is, or None.

    Under systemd the unit hands the credentials in with ``LoadCredential=`` and the agent reads
    them from ``$CREDENTIALS_DIRECTORY`` first; then from ``directory`` (what login wrote).
    """
    candidates = credential_candidates(coordinator, kind, directory, env)
    return next((p for p in candidates if _exists(p)), None)


def credential_candidates(
    coordinator: str, kind: str, directory: Path, env: Mapping[str, str]
) -> list[Path]:
    """Every place a stored token or join code for ``coordinator`` may be, the first found
    taken (``stored_credential``)."""
    candidates = []
    loaded = env.get("CREDENTIALS_DIRECTORY")
    for stem in credentials_names(coordinator):  # its own name first, then its aliases
        name = f"{stem}.{kind}"
        if loaded:
            candidates += [Path(loaded) / f"{CREDENTIAL_ID}_{name}", Path(loaded) / name]
        candidates.append(directory / name)
    return candidates


class StoredCredentials:
    """The agent's credentials as stored, read again while the coordinator refuses them
    (``node/session.py``): ``changed`` looks (a stat of each place they may be) whether they
    changed since they were last read; ``reread`` loads the settings again (``load``: the same
    loader the agent started with) and hands the token and join code to the client
    (``present``)."""

    def __init__(
        self,
        settings: Settings,
        load: Callable[[], Settings],
        present: Callable[[str | None, str | None], None],
        env: Mapping[str, str],
    ) -> None:
        self._load = load
        self._present = present
        self._env = env
        self._coordinator = settings.coordinator  # the one the running client talks to
        self._paths = self._places(settings)
        self._seen = self._look()

    def _places(self, settings: Settings) -> list[Path]:
        directory = settings.credentials_dir
        places: list[Path] = []
        for given, kind in ((settings.token_file, "token"), (settings.join_code_file, "join-code")):
            if given is not None:
                places.append(given)
            else:
                places += credential_candidates(settings.coordinator, kind, directory, self._env)
        return places

    def _look(self) -> tuple[tuple[int, int, int] | None, ...]:
        seen: list[tuple[int, int, int] | None] = []
        for path in self._paths:
            try:
                st = path.stat()
                seen.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                seen.append(None)
        return tuple(seen)

    def changed(self) -> bool:
        return self._look() != self._seen

    def reread(self) -> None:
        seen = self._look()
        settings = self._load()  # ConfigError: a file unreadable, or readable by others
        if settings.coordinator != self._coordinator:
            # Another coordinator's token must never reach this one (a reload refuses the
            # change of coordinator too): only a restart moves the agent.
            raise ConfigError(
                f"the config now names coordinator {settings.coordinator}, but this agent talks"
                f" to {self._coordinator}: restart the agent (sudo systemctl restart flashnode)"
            )
        self._paths = self._places(settings)
        self._seen = seen if len(seen) == len(self._paths) else self._look()
        token, code = settings.token, settings.join_code
        self._present(
            token.get_secret_value() if token else None, code.get_secret_value() if code else None
        )


def _exists(path: Path) -> bool:
    """False also where this user may not look (root's credentials, read by another user's
    owner command, which needs no secret)."""
    try:
        return path.exists()
    except PermissionError:
        return False


def read_secret_file(path: Path, what: str) -> str:
    """Read a secret from a file only this user can read; refuse one that others can."""
    try:
        st = path.stat()
        value = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} file {path} is not UTF-8 text") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{what} file {path} is accessible to other users"
            f" (mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}"
        )
    if not value:
        raise ConfigError(f"{what} file {path} is empty")
    return value
