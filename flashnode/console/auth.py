"""Who may use the console, and how a browser proves it.

* **Login links.** The running agent makes two random keys at start and writes each to the state
  dir: ``console.json`` (0600, the agent's user: root under the packaged unit) holds the
  *owner* key, ``console-view.json`` (0640, group ``flashnode``: who may run ``flashnode status``)
  the *view* key. ``flashnode ui`` reads the one it can and mints a login link from it:
  ``/login?token=<level>.<expiry>.<nonce>.<mac>``, an HMAC-SHA256 of the rest under that level's
  key, valid for ``LINK_SECONDS`` and for one use only. So a login is exactly as strong as the
  right to read the file, and the CLI's rights carry over: who may change the node from the
  command line (root: ``pause``, ``pools``) may change it here; who may only read ``status`` may
  only look.
* **Sessions.** A good link becomes a session: a random id in an ``HttpOnly``,
  ``SameSite=Strict`` cookie, and a CSRF token the page reads from ``/api/session``. Sessions
  live in the agent's memory (a restart logs everyone out), end after ``IDLE_SECONDS`` unused,
  and are few (``MAX_SESSIONS``; the oldest goes first).
* **Requests.** Every request must name the listen address in its ``Host`` (a DNS-rebinding
  page's host is refused). Every state-changing request also needs a session of the owner level,
  its CSRF token in ``X-Flashnode-CSRF``, an ``Origin`` that is this console's own (a missing one
  is refused too), and a JSON body. The console sends no CORS headers at all.

Pure logic and small files: the HTTP server (``server.py``) asks; this module answers.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from flashnode import statefile

Level = Literal["owner", "view"]
LEVELS: tuple[Level, ...] = ("owner", "view")
KEY_FILES: dict[Level, str] = {"owner": "console.json", "view": "console-view.json"}
LINK_SECONDS = 600.0  # a login link is good for ten minutes, once
IDLE_SECONDS = 12 * 3600.0
MAX_SESSIONS = 32
COOKIE = "flashnode_console"
CSRF_HEADER = "X-Flashnode-CSRF"


@dataclass
class Session:
    level: Level
    csrf: str
    created: float
    used: float


@dataclass
class Gate:
    """The keys, the login links spent, the sessions; thread-safe (one lock, short holds)."""

    keys: dict[Level, bytes] = field(
        default_factory=lambda: {lv: secrets.token_bytes(32) for lv in LEVELS}
    )
    clock: Callable[[], float] = time.time
    _spent: dict[str, float] = field(default_factory=dict)  # nonce -> when its link expires
    _sessions: dict[str, Session] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --- the key files ------------------------------------------------------------------------

    def publish(self, state_dir: Path, url: str, pid: int) -> None:
        """Write the key files ``flashnode ui`` reads (each only as readable as its level)."""
        for level in LEVELS:
            data = json.dumps(
                {"url": url, "level": level, "key": self.keys[level].hex(), "pid": pid}
            ).encode()
            if level == "owner":
                statefile.write(state_dir / KEY_FILES[level], data, 0o600)
            else:
                statefile.write(state_dir / KEY_FILES[level], data, 0o640, statefile.STATUS_GROUP)

    @staticmethod
    def withdraw(state_dir: Path) -> None:
        for name in KEY_FILES.values():
            with contextlib.suppress(OSError):
                (state_dir / name).unlink()

    # --- login links --------------------------------------------------------------------------

    def login(self, token: str) -> tuple[str, Session] | None:
        """A new session for a good, unspent, unexpired link; None otherwise."""
        level = redeem(self.keys, token, self.clock())
        if level is None:
            return None
        nonce = token.split(".")[2]
        now = self.clock()
        with self._lock:
            self._spent = {n: t for n, t in self._spent.items() if t > now}
            if nonce in self._spent:
                return None
            self._spent[nonce] = now + LINK_SECONDS + 60
            self._sessions = {
                k: s for k, s in self._sessions.items() if now - s.used < IDLE_SECONDS
            }
            while len(self._sessions) >= MAX_SESSIONS:
                oldest = min(self._sessions, key=lambda k: self._sessions[k].used)
                del self._sessions[oldest]
            sid = secrets.token_urlsafe(32)
            session = Session(level, secrets.token_urlsafe(32), now, now)
            self._sessions[sid] = session
        return sid, session

    def session(self, sid: str | None) -> Session | None:
        """The live session a cookie names (and it counts as used now)."""
        if not sid:
            return None
        now = self.clock()
        with self._lock:
            found = self._sessions.get(sid)
            if found is None:
                return None
            if now - found.used >= IDLE_SECONDS:
                del self._sessions[sid]
                return None
            found.used = now
            return found

    def logout(self, sid: str | None) -> None:
        with self._lock:
            self._sessions.pop(sid or "", None)


def mint(level: Level, key: bytes, now: float, seconds: float = LINK_SECONDS) -> str:
    """A login token of ``level``, good until ``now + seconds`` (what ``flashnode ui`` makes)."""
    body = f"{level}.{int(now + seconds)}.{secrets.token_urlsafe(18)}"
    return f"{body}.{_mac(key, body)}"


def redeem(keys: dict[Level, bytes], token: str, now: float) -> Level | None:
    """The level of a well-formed, authentic, unexpired token (spent or not: the Gate knows)."""
    parts = token.split(".")
    if len(token) > 256 or len(parts) != 4:
        return None
    level, expiry, nonce, mac = parts
    if level not in LEVELS or not expiry.isdigit() or not nonce:
        return None
    key = keys[level]
    if not hmac.compare_digest(mac, _mac(key, f"{level}.{expiry}.{nonce}")):
        return None
    if int(expiry) < now or int(expiry) > now + LINK_SECONDS + 60:
        return None
    return level


def _mac(key: bytes, body: str) -> str:
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def read_key_file(state_dir: Path) -> dict[str, object] | None:
    """What ``flashnode ui`` may read: the owner's key file, else the view key file; None when
    neither is readable (no console, or not allowed)."""
    for level in LEVELS:
        try:
            data = json.loads((state_dir / KEY_FILES[level]).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("level") == level:
            return data
    return None


# --- checks on each request ----------------------------------------------------------------


def allowed_hosts(
    host: str, port: int, loopback: bool, wildcard_names: list[str]
) -> frozenset[str]:
    """The ``Host`` header values that name this console: its address, and for loopback the
    usual names of this machine's loopback; for a wildcard bind, the names and addresses the
    caller found for this machine."""

    def with_port(name: str) -> str:
        return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"

    names = {host}
    if loopback:
        names |= {"localhost", "127.0.0.1", "::1"}
    if host in ("0.0.0.0", "::", ""):
        names |= set(wildcard_names) | {"localhost", "127.0.0.1", "::1"}
        names.discard("0.0.0.0")
        names.discard("::")
    return frozenset(with_port(n.lower()) for n in names if n)


def same_origin(origin: str | None, host: str) -> bool:
    """Whether a request's ``Origin`` is this console's own page (``http://<Host>``)."""
    return origin is not None and origin.lower() == f"http://{host.lower()}"


def cookie_name(port: int) -> str:
    """Per port: a browser sends a host's cookies to every port of it, and two agents' consoles
    on one machine must not take each other's sessions."""
    return f"{COOKIE}_{port}"


def hmac_equal(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
