"""A throwaway PostgreSQL cluster: the conversation log's tests and benchmark run against a real server.

    with ThrowawayCluster() as cluster:
        url = cluster.create_database("log")   # postgresql+psycopg://postgres@/log?host=...
        ...

The server comes from the distribution's packages (``apt-get install postgresql``;
its binaries are found on PATH or under ``/usr/lib/postgresql/*/bin``). The cluster
lives in a temporary folder, listens only on a Unix socket there (no TCP port), trusts
local connections, skips fsync (nothing in it outlives a machine crash), and is
stopped and deleted on exit. ``initdb`` refuses to run as
root, so as root the cluster is made and run by the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from chatcore.log.errors import LogError

SERVER_USER = "postgres"


def find_binaries() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``, or None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parent.parent.name) if Path(path).parent.parent.name.isdigit() else 0,
    )
    return Path(candidates[-1]).parent if candidates else None


def unavailable_reason() -> str | None:
    """Why no cluster can be started here, or None when one can."""
    if find_binaries() is None:
        return "PostgreSQL is not installed (apt-get install postgresql; `make test` does it)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the PostgreSQL driver is not installed (pip install 'chatcore[postgres]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root and there is no {SERVER_USER!r} user to run the server"
    return None


class ThrowawayCluster:
    """Start with :meth:`start` (or ``with``); :meth:`stop` stops the server and deletes its folder."""

    def __init__(self) -> None:
        binaries = find_binaries()
        if binaries is None:
            raise LogError(unavailable_reason() or "PostgreSQL is not installed")
        self.binaries: Path = binaries
        # Directly under the temporary folder: the server user must reach it.
        self.folder = Path(tempfile.mkdtemp(prefix="chatcore-pg-"))
        self.data = self.folder / "data"
        self.socket_dir = self.folder
        self.port = 5432  # names the socket file only: the server listens on no TCP port
        self._as_root = os.geteuid() == 0
        self.started = False

    def _run(self, *command: str) -> None:
        prefix = ["runuser", "-u", SERVER_USER, "--"] if self._as_root else []
        done = subprocess.run(prefix + list(command), capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise LogError(f"{Path(command[0]).name} failed: {detail[-1] if detail else done.returncode}")

    def start(self) -> "ThrowawayCluster":
        if self._as_root:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(self.folder, user.pw_uid, user.pw_gid)
        self._run(
            str(self.binaries / "initdb"),
            "-D",
            str(self.data),
            "-U",
            SERVER_USER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        )
        # fsync off: the cluster is thrown away, never recovered after a machine crash.
        options = f"-k {self.socket_dir} -c listen_addresses='' -p {self.port} -c fsync=off"
        self._run(
            str(self.binaries / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.folder / "server.log"),
            "-w",
            "start",
        )
        self.started = True
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{SERVER_USER}@/{database}?host={self.socket_dir}&port={self.port}"

    def create_database(self, prefix: str = "log") -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self._admin(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        from sqlalchemy.engine import make_url

        self._admin(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')

    def _admin(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(
            host=str(self.socket_dir), port=self.port, user=SERVER_USER, dbname="postgres", autocommit=True
        ) as connection:
            connection.execute(statement)

    def server_pids(self) -> list[int]:
        """The postmaster and every process it started (backends, checkpointer, ...)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        found, waiting = [], [postmaster]
        while waiting:
            pid = waiting.pop()
            found.append(pid)
            for children in Path(f"/proc/{pid}/task").glob("*/children"):
                waiting.extend(int(child) for child in children.read_text().split())
        return found

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """The whole server stopped (SIGSTOP) for the block, as a hung machine looks to its clients:
        connections stay open and nothing answers."""
        pids = self.server_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        try:
            if self.started:
                self._run(str(self.binaries / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
                self.started = False
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "ThrowawayCluster":
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
