"""A local package index for tests: small pure-Python wheels built in the test and served as a
PEP 503 simple index from an HTTP server on 127.0.0.1, so that environment builds need no
network beyond loopback. A job names it with ``--index-url {index.url}``."""

from __future__ import annotations

import base64
import hashlib
import html
import io
import re
import tarfile
import threading
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from localhttp import LocalHTTPServer


def normalize(name: str) -> str:
    """PEP 503 project name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Wheel:
    filename: str
    data: bytes

    @property
    def project(self) -> str:
        return normalize(self.filename.split("-")[0])

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_wheel(
    name: str,
    version: str,
    *,
    requires: Sequence[str] = (),
    source: str | None = None,
    scripts: dict[str, str] | None = None,
    requires_python: str | None = None,
    python_tag: str = "py3",
    extra_files: dict[str, str] | None = None,
) -> Wheel:
    """A pure-Python wheel with one module named ``name`` (``VERSION = "<version>"`` unless
    ``source`` is given), its dependencies and console scripts (``{"cmd": "module:func"}``),
    and ``extra_files`` (path in site-packages: text, e.g. a ``.pth`` file)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    if requires_python:
        meta.append(f"Requires-Python: {requires_python}")
    files: dict[str, bytes] = {
        f"{dist}/__init__.py": (source or f'VERSION = "{version}"\n').encode(),
        f"{info}/METADATA": ("\n".join(meta) + "\n").encode(),
        f"{info}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: flashnode-tests\nRoot-Is-Purelib: true\n"
            f"Tag: {python_tag}-none-any\n"
        ).encode(),
    }
    files.update({path: text.encode() for path, text in (extra_files or {}).items()})
    if scripts:
        lines = "".join(f"{cmd} = {target}\n" for cmd, target in scripts.items())
        files[f"{info}/entry_points.txt"] = ("[console_scripts]\n" + lines).encode()
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return Wheel(f"{dist}-{version}-{python_tag}-none-any.whl", buf.getvalue())


BACKEND = """\
import base64, hashlib, os, zipfile

NAME, VERSION = {name!r}, {version!r}


def _hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = NAME.replace("-", "_")
    info = dist + "-" + VERSION + ".dist-info"
    files = {{
        dist + "/__init__.py": (
            "VERSION = %r\\nBUILT_BY_UID = %d\\n" % (VERSION, os.getuid())
        ).encode(),
        info + "/METADATA": (
            "Metadata-Version: 2.1\\nName: %s\\nVersion: %s\\n" % (NAME, VERSION)
        ).encode(),
        info + "/WHEEL": b"Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }}
    record = "".join("%s,%s,%d\\n" % (p, _hash(d), len(d)) for p, d in files.items())
    files[info + "/RECORD"] = (record + info + "/RECORD,,\\n").encode()
    name = dist + "-" + VERSION + "-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return name
"""


# What a hostile build backend leaves behind: a daemon in its own session, with an empty
# environment (no ownership token), that opens a file of the environment being built while it
# still can, waits until the environment is published, and then writes through that descriptor.
LINGERER = """\
import glob, os, time
MARKER = {marker!r}
here = os.getcwd()
while here != "/" and not os.path.exists(os.path.join(here, "requirements.txt")):
    here = os.path.dirname(here)
key = os.path.basename(here).split(".")[0]
root = os.path.dirname(os.path.dirname(here))
deadline = time.time() + 60
fh = open(os.path.join(here, "env", "pyvenv.cfg"), "a")
open(os.path.join(MARKER, "opened"), "w").close()
published = os.path.join(root, key, "env", "pyvenv.cfg")
while time.time() < deadline and not os.path.exists(published):
    time.sleep(0.02)
fh.write("# PWNED by a lingering build process\\n")
fh.flush()
open(os.path.join(MARKER, "wrote"), "w").close()
"""

LINGER = """

def _linger():
    import sys
    if os.fork():
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    python = os.path.realpath(sys.executable)
    os.execve(python, [python, "-I", "-c", {code!r}], {{}})


_build_wheel = build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _linger()
    return _build_wheel(wheel_directory, config_settings, metadata_directory)
"""


def build_sdist(
    name: str, version: str, linger_marker: str | None = None, linger_code: str | None = None
) -> Wheel:
    """A source distribution only (no wheel) with an in-tree build backend that needs nothing
    from an index: its wheel's module records ``BUILT_BY_UID``, the uid the build ran as. With
    binary wheels only, it can never be installed. With ``linger_marker`` (a directory anyone
    can write), the backend also leaves a LINGERER behind, which drops ``opened`` and ``wrote``
    there as it goes; with ``linger_code``, that Python code instead."""
    dist = name.replace("-", "_")
    top = f"{dist}-{version}"
    backend = BACKEND.format(name=name, version=version)
    if linger_marker is not None:
        linger_code = LINGERER.format(marker=linger_marker)
    if linger_code is not None:
        backend += LINGER.format(code=linger_code)
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        "pyproject.toml": (
            '[build-system]\nrequires = []\nbuild-backend = "flashnode_backend"\n'
            'backend-path = ["."]\n'
        ),
        "flashnode_backend.py": backend,
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for path, text in files.items():
            data = text.encode()
            member = tarfile.TarInfo(f"{top}/{path}")
            member.size = len(data)
            member.mode = 0o644
            tf.addfile(member, io.BytesIO(data))
    return Wheel(f"{top}.tar.gz", buf.getvalue())


class PackageIndex:
    """A PEP 503 simple index on 127.0.0.1 serving the distributions added to it.

    ``requests`` lists the paths served, so a test can tell whether a build fetched anything.
    Clearing ``files_gate`` holds every file download until it is set again (up to a minute),
    so a test can catch a build in the middle.
    """

    def __init__(self) -> None:
        self._files: dict[str, Wheel] = {}
        self.files_gate = threading.Event()
        self.files_gate.set()
        self._lock = threading.Lock()
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                index._serve(self, body=True)

            def do_HEAD(self) -> None:
                index._serve(self, body=False)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = LocalHTTPServer(("127.0.0.1", 0), Handler).start()
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}/simple/"

    def add(self, *dists: Wheel) -> None:
        with self._lock:
            for dist in dists:
                self._files[dist.filename] = dist

    def close(self) -> None:
        self.files_gate.set()
        self._server.close()

    def _serve(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = request.path.split("?", 1)[0]
        with self._lock:
            self.requests.append(path)
            files = dict(self._files)
        data: bytes | None = None
        ctype = "text/html"
        if path in ("/simple", "/simple/"):
            projects = sorted({w.project for w in files.values()})
            data = _page(f'<a href="{p}/">{p}</a>' for p in projects)
        elif path.startswith("/simple/"):
            project = normalize(path[len("/simple/") :].strip("/"))
            links = [
                f'<a href="/files/{html.escape(w.filename)}#sha256={w.sha256}">'
                f"{html.escape(w.filename)}</a>"
                for w in files.values()
                if w.project == project
            ]
            data = _page(links) if links else None
        elif path.startswith("/files/"):
            self.files_gate.wait(60)
            wheel = files.get(path[len("/files/") :])
            if wheel is not None:
                data, ctype = wheel.data, "application/octet-stream"
        if data is None:
            request.send_response(404)
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        request.send_response(200)
        request.send_header("Content-Type", ctype)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if body:
            request.wfile.write(data)


def _page(links: Iterator[str] | list[str]) -> bytes:
    return ("<!DOCTYPE html><html><body>\n" + "<br>\n".join(links) + "\n</body></html>\n").encode()


@contextmanager
def package_index(*dists: Wheel) -> Iterator[PackageIndex]:
    index = PackageIndex()
    index.add(*dists)
    try:
        yield index
    finally:
        index.close()
