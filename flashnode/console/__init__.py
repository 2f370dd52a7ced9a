"""The owner's console: a web page the agent serves on ``ui_listen`` (README "The console").

``start`` binds the listener, writes the login keys ``flashnode ui`` reads, and returns the
running ``Console``; ``close`` stops serving and removes the keys. Parts: ``auth`` (login links,
sessions, the checks on each request), ``wiring`` (what the agent hands it), ``listener`` (the
socket, and the thread that waits on it), ``server`` (the HTTP edge), ``app`` (what each
request means), ``lookups`` (what it asks the coordinator, on a thread of its own), ``usage``
(the node's use over the last hour, day and week, kept in the state dir), ``static/`` (the
page: no asset comes from anywhere else); totals and history come from the agent's
``flashnode.owner.ledgerview``. The edge and the app are built at the first connection
(``listener`` says why).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashnode.config.listen import parse_listen
from flashnode.console.wiring import Wiring

if TYPE_CHECKING:  # the parts are imported when the console starts (``start``), or later
    from flashnode.console.app import App
    from flashnode.console.listener import ConsoleServer

log = logging.getLogger(__name__)


@dataclass
class Console:
    url: str
    server: ConsoleServer
    wiring: Wiring
    app: App | None = None  # made at the first connection

    def close(self) -> None:
        from flashnode.console import auth

        self.server.close()
        if self.app is not None:
            self.app.lookups.close()
        auth.Gate.withdraw(self.wiring.state_dir)


def start(listen: str, wiring: Wiring) -> Console:
    """Serve the console at ``listen`` (HOST:PORT; port 0: any free one). OSError when the
    address cannot be bound."""
    from flashnode.console import auth
    from flashnode.console.listener import ConsoleServer

    parsed = parse_listen(listen)
    names = _local_names() if parsed.host in ("0.0.0.0", "::") else []
    gate = auth.Gate(clock=wiring.clock)
    server = ConsoleServer(parsed.host, parsed.port)
    hosts = auth.allowed_hosts(parsed.host, server.port, parsed.loopback, names)
    cookie = auth.cookie_name(server.port)
    shown = "127.0.0.1" if parsed.host in ("0.0.0.0", "localhost") else parsed.host
    if parsed.host == "::":
        shown = "::1"
    url = f"http://[{shown}]:{server.port}" if ":" in shown else f"http://{shown}:{server.port}"
    try:
        gate.publish(wiring.state_dir, url, os.getpid())
    except OSError:
        server.close()
        raise
    console = Console(url, server, wiring)

    def app() -> App:
        # At the first connection, on the listener's thread (``listener`` says why).
        from flashnode.console.app import App

        console.app = App(wiring, gate, hosts, cookie)
        return console.app

    server.serve(app, wiring.task_uids)
    log.info("console served at %s (log in with `flashnode ui`)", url)
    return console


def _local_names() -> list[str]:
    """What a browser may call this machine when the console listens on every address."""
    names = [socket.gethostname(), socket.getfqdn()]
    try:
        import psutil

        for addresses in psutil.net_if_addrs().values():
            for a in addresses:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    names.append(a.address.split("%")[0])
    except (OSError, RuntimeError):
        pass
    return names
