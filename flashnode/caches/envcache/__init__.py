"""The cache of job environments: built once (``envbuild``), keyed, pinned while tasks use
them, shared read-only, within a byte budget, least recently used evicted first; failed builds
remembered for a while (``envfailed``, under the cache's lock). What it writes of an
environment and tells the owner is ``envrecords``.

Layout of the cache root (``<state dir>/envs/``, mode 0711: task users can reach an environment
whose name they are given, never list the cache)::

    <key>/env/          a finished environment: a relocatable venv, owned by the agent, dirs 0755,
                        files 0644 or 0755 (task users read and execute it, never write it)
    <key>/meta.json     what it is: python, the lines (credentials redacted), bytes, last use; 0600
    .tmp/<key>.<rand>/  a build in progress; renamed to <key>/ only when complete, so a crash
                        mid-build leaves nothing that looks usable (swept at the next start)
    .locks/<key>        flock: shared while a task uses the environment (a pin), exclusive to
                        build or evict it; this is what keeps ``flashnode envs prune`` in another
                        process from removing an environment a running task uses
    .failed/<key>.json  the negative cache: a build that failed because of the job's lines
    .python/            interpreters uv downloads, when the owner allows downloads

The key is the sha256 of the Python version (``major.minor``), the platform and the normalised
lines (comments, surrounding space and blank lines dropped; order kept, because index directives
are order-sensitive).

The parts, one module each: ``cache`` (``EnvCache``: acquire, pin, prune; who builds, who
waits), ``handle`` (``EnvHandle``, a pin), ``pins`` (what this process holds, under the cache's
lock), ``locks`` (the lock files), ``layout`` (the directories), ``entries`` (finished
environments and their records), ``publish`` (one build, published whole), ``evict`` (the
budget), ``sweep`` (what a crash left) and ``trash`` (trees taken out of sight, then removed).
"""

from __future__ import annotations

from flashnode.caches.envcache.cache import EnvCache
from flashnode.caches.envcache.handle import EnvHandle
from flashnode.caches.envcache.layout import ENVS_DIR, PYTHON_DIR

__all__ = ["ENVS_DIR", "PYTHON_DIR", "EnvCache", "EnvHandle"]
