"""A job's requirement lines, judged before anything is built: the forms accepted, the endpoints
they name and their check against the owner's policy, and the credentials in them, redacted.

A job's lines are accepted only in a form judged in full (``_line_problem``): they may not make
uv read a file of this host (``-r``, ``-c``, ``-e``, a ``/`` outside a URL, a bare archive name
and ``file:`` URLs are refused) or run a VCS (no scheme but http(s)), nor name a URL whose host
Python and uv could read apart (a backslash, anything but a plain host after at most one ``@``),
nor, before the build, a URL whose host does not exist or has an address the owner does not
allow (``check_endpoints``: the dataset origins' ``OriginPolicy``,
``env_allow_private_indexes``). uv resolves each host again itself: DNS rebinding, a public
index's redirects and the links its pages list are not checked here.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

from flashnode.caches.origins import Resolver, resolve
from flashnode.coordinator.datasets import OriginPolicy
from flashnode.errors import EnvBuildFailed, EnvUnavailable

MAX_LINES = 1000
MAX_LINE_CHARS = 4096

# Options a job's lines may carry. Everything else (``-r``, ``-c``, ``-e``, local paths, file:
# URLs) would make the agent read files on this host, and is refused.
URL_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links"}
FLAG_OPTIONS = {"--no-index"}
URL_SCHEMES = ("http", "https")
SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # any, anywhere: git+http://, ftp://, ...
# What the resolver answers for a name that does not exist (a job's), not for a failed lookup.
NO_SUCH_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
URL_LINE = re.compile(r"https?://", re.IGNORECASE)
# A URL's host as both Python's urlsplit and uv (WHATWG) read it, nothing they could read apart.
HOST = re.compile(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]")
# A requirement's name (PEP 508); a name with an archive's ending would be read as a local file.
NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
ARCHIVES = (".whl", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip", ".egg")


COMMENT = re.compile(r"(^|\s+)#.*$")  # pip's rule: a '#' after whitespace (a URL's fragment stays)


def normalise(lines: Sequence[str]) -> tuple[str, ...]:
    """The lines that matter: without comments, stripped, without blank lines, in order."""
    kept = (COMMENT.sub("", line).strip() for line in lines)
    return tuple(line for line in kept if line)


def check_lines(lines: Sequence[str]) -> None:
    """Refuse, with the job's fault, a line that would make uv read anything on this host."""
    if len(lines) > MAX_LINES:
        raise EnvBuildFailed(f"too many dependency lines ({len(lines)} > {MAX_LINES})")
    for line in lines:
        why = _line_problem(line)
        if why:
            shown = redact(line, secrets_in([line]))[:200]
            raise EnvBuildFailed(f"dependency line {shown!r} is refused: {why}")


def _line_problem(line: str) -> str | None:
    if len(line) > MAX_LINE_CHARS:
        return "too long"
    if any(ord(c) < 32 or ord(c) == 127 for c in line):
        return "control characters"
    if "\\" in line:
        return "backslashes are not allowed"
    if "${" in line:
        return "environment variables are not expanded"
    if "file:" in line.lower():
        return "local files are not allowed"
    for scheme in SCHEME.finditer(line):
        if scheme.group(1).lower() not in URL_SCHEMES:
            return "only http(s) URLs are allowed (no VCS or other schemes)"
    words = line.split()
    if line.startswith("-"):
        option, _, value = words[0].partition("=")
        if option in FLAG_OPTIONS and len(words) == 1 and not value:
            return None
        if option not in URL_OPTIONS:
            return "only --index-url, --extra-index-url, --find-links and --no-index are allowed"
        rest = [value] if value else words[1:]
        if len(rest) != 1 or len(words) > (1 if value else 2):
            return f"{option} takes exactly one URL"
        return None if _is_url(rest[0]) else f"{option} needs an http(s) URL"
    if URL_LINE.match(line):
        if len(words) != 1:
            return "a URL line takes nothing after the URL"
        return None if _is_url(words[0]) else "not an http(s) URL with a plain host"
    name = NAME.match(line)
    if not name or not re.match(r"$|[\s\[(<>=!~;@]", line[name.end() :]):
        return "not a requirement (local paths are not allowed)"
    if name.group().lower().endswith(ARCHIVES):
        return "not a requirement (local files are not allowed)"
    outside = line
    if "@" in line.split(";", 1)[0]:
        before, _, after = line.partition("@")
        target = after.split()
        if not target or ";" in target[0] or not _is_url(target[0]):
            return "a direct reference must be an http(s) URL with a plain host"
        outside = " ".join([before, *target[1:]])
    if "/" in outside:
        return "not a requirement (local paths are not allowed)"
    for word in words[1:]:
        if word.startswith("-") and not word.startswith("--hash"):
            return f"option {word.split('=')[0]} is not allowed after a requirement"
    return None


def _is_url(value: str) -> bool:
    """An http(s) URL whose host both Python and uv read alike: letters, digits, dots and
    hyphens, or a bracketed IPv6 literal, after at most one ``@`` (credentials before it; an
    ``@`` in them is written ``%40``, else part of them would go unredacted)."""
    try:
        parts = urlsplit(value)
        _ = parts.port
    except ValueError:
        return False
    if parts.netloc.count("@") > 1:
        return False
    host = re.sub(r":[0-9]*$", "", parts.netloc.rpartition("@")[2])
    return parts.scheme in URL_SCHEMES and bool(parts.hostname) and bool(HOST.fullmatch(host))


def endpoints(lines: Sequence[str]) -> list[tuple[str, str]]:
    """Every URL the (checked) lines name, with its line: an index, an extra index, a page of
    links, a direct reference."""
    found = []
    for line in lines:
        words = line.split()
        if line.startswith("-"):
            option, _, value = words[0].partition("=")
            if option in URL_OPTIONS:
                found.append((line, value or words[1]))
        elif URL_LINE.match(line):
            found.append((line, words[0]))
        elif "@" in line.split(";", 1)[0]:
            found.append((line, line.split("@", 1)[1].split(";", 1)[0].split()[0]))
    return found


def check_endpoints(
    lines: Sequence[str], policy: OriginPolicy, resolver: Resolver = resolve
) -> None:
    """Refuse, with the job's fault, a line whose URL's host has an address the owner's
    ``env_allow_private_indexes`` does not allow (the dataset origins' rule, ``OriginPolicy``):
    by default loopback, private and link-local addresses. Every address the host resolves to
    must pass. A host the resolver says does not exist is the job's too (any job can name
    one); EnvUnavailable when resolving fails otherwise (no network, a resolver that does not
    answer: the node's)."""
    hidden = secrets_in(lines)
    for line, url in endpoints(lines):
        parts = urlsplit(url)
        host = parts.hostname or ""
        shown = redact(line, hidden)[:200]
        try:
            addresses = resolver(host, parts.port or (443 if parts.scheme == "https" else 80))
        except socket.gaierror as exc:
            if exc.errno in NO_SUCH_HOST:
                raise EnvBuildFailed(
                    f"dependency line {shown!r} is refused: its host does not exist"
                ) from None
            addresses = []
        except (OSError, ValueError, UnicodeError):
            addresses = []
        if not addresses:
            raise EnvUnavailable(
                f"dependency line {shown!r}: its host does not resolve here", job_endpoint=True
            )
        for address in addresses:
            problem = policy.problem(address)
            if problem:
                raise EnvBuildFailed(
                    f"dependency line {shown!r} is refused: its host is {problem}"
                    " (the owner allows indexes at such addresses with env_allow_private_indexes)"
                )


def secrets_in(lines: Sequence[str]) -> tuple[str, ...]:
    """Credentials the lines carry in URLs (``https://user:token@host``): never shown."""
    found: set[str] = set()
    for match in re.finditer(r"[A-Za-z][A-Za-z0-9+.-]*://([^/\s@]+)@", "\n".join(lines)):
        userinfo = match.group(1)
        for part in (userinfo, *userinfo.split(":", 1)):
            for form in (part, unquote(part)):
                if len(form) >= 3:
                    found.add(form)
    return tuple(sorted(found, key=len, reverse=True))


def redact(text: str, hidden: Sequence[str] = ()) -> str:
    """``text`` without URL credentials and without any of ``hidden``."""
    text = re.sub(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@", r"\1***@", text)
    for secret in hidden:
        text = text.replace(secret, "***")
    return text
