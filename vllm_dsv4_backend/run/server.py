# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm serve`` subprocess of the runner and the tests (stdlib only).

:class:`ServerProcess` owns the process group and its log: the runner's
``serve-*`` commands, the end-to-end benchmark and ``tests/vllm``'s
``tiny_server`` fixture all start servers through it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from vllm_dsv4_backend.run.common import PREFIX, RunError
from vllm_dsv4_backend.run.config import ServeConfig, build_serve_command, load_serve_config

__all__ = [
    "ServerProcess",
    "cpu_env",
    "find_free_port",
    "make_server",
    "tail",
]


# Ports this process has handed out: servers started together must not share one.
_handed_out: set[int] = set()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` and this process has not handed out
    before (racy against other processes by nature; :meth:`ServerProcess.is_healthy`
    then refuses a listener that is not the server's own).

    Never the same port twice: ``vllm serve`` binds its port at start (``SO_REUSEADDR``)
    but listens only once its engine is up, so two servers started together on one port
    both bind; the first to listen answers both URLs, the other fails later."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _listener_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP ``port`` (IPv4 and IPv6), from ``/proc/net``;
    ``None`` where the platform has no ``/proc/net/tcp``."""
    inodes: set[str] = set()
    seen = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for row in rows:
            cols = row.split()
            # local_address is ADDR:PORT in hex; state 0A is LISTEN.
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes if seen else None


def _session_holds(sid: int, inodes: set[str]) -> bool:
    """Whether a process of session ``sid`` holds one of the socket ``inodes``."""
    wanted = {f"socket:[{i}]" for i in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) != sid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
    return False


def tail(path: str | os.PathLike[str], n: int = 40) -> str:
    """The last ``n`` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except FileNotFoundError:
        return ""


class ServerProcess:
    """A ``vllm serve`` subprocess with its log file; a context manager that always stops it.

    The server runs in its own session (process group), so Ctrl-C in the
    terminal reaches only the runner, which then stops the whole group
    (API server, engine core, workers) with SIGTERM, then SIGKILL.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        host: str,
        port: int,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.cmd = list(cmd)
        self.host, self.port = host, port
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self.started_at = 0.0
        self.healthy_after_s: float | None = None
        # /health answered by a process outside this server's group (is_healthy).
        self._foreign_listener = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        """Launch the server (non-blocking)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"$ {shlex.join(self.cmd)}\n".encode())
        self._log.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        return self

    def is_healthy(self) -> bool:
        """One ``GET /health`` with a short timeout, answered by this server: where
        ``/proc`` tells, a listener on the port held by another process (a server
        started beside this one on the same port) does not count."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                if r.status != 200:
                    return False
        except (urllib.error.URLError, OSError, ValueError):
            return False
        ours = self.owns_port()
        self._foreign_listener = not ours
        return ours

    def owns_port(self) -> bool:
        """Whether the listener on :attr:`port` belongs to this server's process group
        (True where the platform cannot tell: no ``/proc/net/tcp``)."""
        inodes = _listener_inodes(self.port)
        if inodes is None or self.proc is None:
            return inodes is None
        return bool(inodes) and _session_holds(self.proc.pid, inodes)

    def wait_healthy(
        self,
        timeout: float = 600.0,
        progress: TextIO | None = None,
        interval: float = 0.5,
    ) -> float:
        """Block until ``/health`` answers 200; returns the seconds it took.

        Raises RunError with the log tail if the process exits first or
        ``timeout`` passes. ``progress`` gets a status line (rewritten in place
        on a TTY, one line every 10 s otherwise).
        """
        if self.proc is None:
            raise RunError("server not started")
        tty = bool(progress is not None and getattr(progress, "isatty", lambda: False)())
        cr, nl = ("\r", "") if tty else ("", "\n")
        last_print = -math.inf
        while True:
            waited = time.monotonic() - self.started_at
            rc = self.proc.poll()
            if rc is not None:
                if progress is not None and tty:
                    progress.write("\n")
                raise RunError(
                    f"vLLM server exited with code {rc} after {waited:.0f} s before /health "
                    f"answered.\ncommand: {shlex.join(self.cmd)}\nlog: {self.log_path}\n"
                    f"--- last lines ---\n{tail(self.log_path)}"
                )
            if self.is_healthy():
                self.healthy_after_s = waited
                if progress is not None:
                    progress.write(
                        f"{cr}{PREFIX} server healthy at {self.base_url} after {waited:.0f} s\n"
                    )
                    progress.flush()
                return waited
            if waited > timeout:
                if progress is not None and tty:
                    progress.write("\n")
                foreign = (" (another process listens on that port)"
                           if self._foreign_listener else "")
                raise RunError(
                    f"vLLM server did not answer {self.base_url}/health within {timeout:.0f} s"
                    f"{foreign}.\ncommand: {shlex.join(self.cmd)}\nlog: {self.log_path}\n"
                    f"--- last lines ---\n{tail(self.log_path)}"
                )
            if progress is not None and (tty or waited - last_print >= 10):
                last_print = waited
                progress.write(
                    f"{cr}{PREFIX} waiting for {self.base_url}/health: "
                    f"{waited:.0f} s / {timeout:.0f} s (log: {self.log_path})"
                    f"{nl}"
                )
                progress.flush()
            time.sleep(interval)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after ``timeout``; returns its exit code."""
        rc = None
        if self.proc is not None:
            rc = self.proc.poll()
            if rc is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    rc = self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    rc = self.proc.wait(timeout=30)
            # Children (engine core) may outlive a crashed API server: sweep the group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cpu_env(
    scratch: str | os.PathLike[str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus ``scripts/env.sh``'s CPU defaults.

    Offline Hub/datasets, a 1 GiB CPU KV cache, and ``TMPDIR`` /
    ``VLLM_CACHE_ROOT`` under ``scratch`` (each engine start leaves IPC sockets
    and compile caches there). Values already set win, as in env.sh.
    """
    env = dict(os.environ if base is None else base)
    s = Path(scratch)
    defaults = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "DSV4_SCRATCH": str(s),
        "TMPDIR": str(s / "tmp"),
        "VLLM_CACHE_ROOT": str(s / "cache" / "vllm"),
    }
    for k, v in defaults.items():
        env.setdefault(k, v)
    Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    Path(env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)
    return env


def make_server(
    serve_config: str | os.PathLike[str] | ServeConfig,
    *,
    log_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> ServerProcess:
    """A (not yet started) ServerProcess for a serve config on a free loopback port.

    Start several with ``.start()`` before waiting on any, so their slow
    imports overlap.
    """
    serve = (
        serve_config if isinstance(serve_config, ServeConfig) else load_serve_config(serve_config)
    )
    port = port or find_free_port(host)
    cmd = build_serve_command(serve, host=host, port=port, extra_args=extra_args)
    return ServerProcess(cmd, host=host, port=port, log_path=log_path, env=env, cwd=cwd)
