"""The finished environments under the cache root (``Entries``): ``<key>/env``, the venv, and
``<key>/meta.json``, its record (``new_meta``: what it holds); whether an entry is complete, its
record read and touched (``last_used``), and every entry listed as the owner and eviction see
it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from flashnode.caches.envbuild import FORMAT, EnvSpec
from flashnode.caches.envcache.layout import is_key
from flashnode.caches.envrecords import EnvInfo, write_json
from flashnode.caches.envtree import TreeStats
from flashnode.clock import Clock


def new_meta(spec: EnvSpec, stats: TreeStats, seconds: float, now: float) -> dict[str, object]:
    """The record of an environment just built (``now``: the wall clock), credentials in its
    lines redacted."""
    return {
        "format": FORMAT,
        "key": spec.key,
        "python": spec.python,
        "platform": spec.platform,
        "lines": spec.shown_lines(),
        "bytes": stats.bytes,
        "files": stats.files,
        "created": now,
        "last_used": now,
        "build_seconds": round(seconds, 3),
    }


class Entries:
    def __init__(self, root: Path, clock: Clock) -> None:
        self.root = root
        self._clock = clock

    def path(self, key: str) -> Path:
        return self.root / key

    def env(self, key: str) -> Path:
        """The venv of the entry ``key``."""
        return self.root / key / "env"

    def complete(self, key: str) -> bool:
        entry = self.root / key
        # exists() follows bin/python to the base interpreter: gone means the env is stale.
        return (entry / "meta.json").is_file() and (entry / "env" / "bin" / "python").exists()

    def touch(self, key: str) -> None:
        """Its ``last_used`` set to now (nothing when its record cannot be read)."""
        meta = self._read_meta(key)
        if meta is not None:
            meta["last_used"] = self._clock.wall()
            write_json(self.root / key / "meta.json", meta)

    def infos(self, in_use: Callable[[str], bool]) -> list[EnvInfo]:
        """Every finished environment with a readable record, least recently used first;
        ``in_use`` tells whether one is used now."""
        infos = []
        for meta_path in self.root.glob("*/meta.json"):
            key = meta_path.parent.name
            if not is_key(key):
                continue
            info = self._info(key, in_use)
            if info is not None:
                infos.append(info)
        return sorted(infos, key=lambda i: (i.last_used, i.key))

    def _read_meta(self, key: str) -> dict[str, object] | None:
        try:
            data = json.loads((self.root / key / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _info(self, key: str, in_use: Callable[[str], bool]) -> EnvInfo | None:
        meta = self._read_meta(key)
        if meta is None:
            return None
        lines = meta.get("lines")
        return EnvInfo(
            key=key,
            python=str(meta.get("python", "?")),
            bytes=_int(meta.get("bytes")),
            last_used=_float(meta.get("last_used")),
            in_use=in_use(key),
            path=self.env(key),
            created=_float(meta.get("created")),
            build_seconds=_float(meta.get("build_seconds")),
            lines=tuple(str(x) for x in lines) if isinstance(lines, list) else (),
        )


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
