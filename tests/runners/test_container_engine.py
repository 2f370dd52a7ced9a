"""The container engine the runner and its handles share (``runners/container/engine.py``),
against a scripted client: an engine that stops answering is said once, and a container that
could not be removed meanwhile is removed once it is back."""

from __future__ import annotations

import logging
from typing import Any

import docker.errors
import pytest

from flashnode.runners.container import engine as engine_module
from flashnode.runners.container.engine import Engine


class Container:
    def __init__(self, client: Client, cid: str) -> None:
        self.client, self.id = client, cid

    def remove(self, force: bool = False) -> None:
        self.client.check()
        self.client.removed.append(self.id)


class Containers:
    def __init__(self, client: Client) -> None:
        self.client = client

    def get(self, cid: str) -> Container:
        self.client.check()
        if cid in self.client.gone:
            raise docker.errors.NotFound(f"no such container: {cid}")
        return Container(self.client, cid)


class Client:
    def __init__(self) -> None:
        self.up = True
        self.removed: list[str] = []
        self.gone: set[str] = set()
        self.containers: Any = Containers(self)

    def check(self) -> None:
        if not self.up:
            raise ConnectionRefusedError("the engine is away")

    def ping(self) -> bool:
        self.check()
        return True


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Client:
    monkeypatch.setattr(engine_module, "RECHECK_S", 0)  # ask a lost engine again at each turn
    return Client()


def test_a_lost_engine_is_said_once_and_ready_again_once_it_answers(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=engine_module.__name__)
    engine = Engine(client)
    assert engine.answers() and engine.ready()
    client.up = False
    assert not engine.answers()
    engine.lost()
    engine.lost()
    assert caplog.text.count("stopped answering") == 1
    assert not engine.ready()
    client.up = True
    assert engine.ready() and "answers again" in caplog.text


def test_a_container_not_removed_while_the_engine_is_away_is_removed_once_it_is_back(
    client: Client,
) -> None:
    engine = Engine(client)
    client.up = False
    engine.remove("c1")
    engine.lost()
    assert client.removed == []
    client.up = True
    assert engine.ready()
    assert client.removed == ["c1"]
    engine.lost()  # lost again: nothing is left to remove a second time
    assert engine.ready() and client.removed == ["c1"]


def test_a_container_already_gone_counts_as_removed(client: Client) -> None:
    engine = Engine(client)
    client.gone.add("c2")
    engine.remove("c2")
    engine.lost()
    assert engine.ready() and client.removed == []
