"""Starting an inference server that speaks SGLang's HTTP API, as a child process of the engine actor.

Two servers, one launcher class each, chosen once (`LAUNCHERS[name]`): `SGLangLauncher` runs
`python -m sglang.launch_server` (GPU nodes; `pip install 'april-ray[sglang]'`), `CPUServerLauncher` runs our
engine's server (`python -m april_ray.engine.http_server`). Both bind 127.0.0.1 unless told otherwise, on a
free port, log to a file, and are waited for on `/health`; a server that exits, or is not healthy in
time, is reported with the tail of its log. The server dies with the process that started it.

Each server gets two random keys when it starts, as SGLang takes them (`--api-key` for generation,
`--admin-api-key` for aborts, pauses, weights and memory; health and metrics stay open): only the
engine actor that started it, and the learners it hands the admin key to, can drive it.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from april_ray.process_groups import free_port


class ServerDied(RuntimeError):
    """The server process exited; the message carries its exit code and the end of its log."""


@dataclass
class ServerOptions:
    model_path: str
    host: str = "127.0.0.1"
    tp_size: int = 1
    mem_fraction: float = 0.8
    memory_saver: bool = False
    """SGLang's --enable-memory-saver: needed to release memory while a colocated learner trains."""
    max_num_seqs: int = 64
    max_model_len: int = 640
    max_prefill_tokens: int = 8192
    num_threads: int = 1
    seed: int = 0
    park_slots: int = 0
    max_versions: int = 0
    device: str = "cpu"
    """Our server only: cpu, or cuda to serve the model from the GPU Ray gave this process."""
    startup_timeout_s: float = 600.0
    weight_version: str = "0"
    """The version the server reports (and stamps tokens with) until the first update."""
    log_dir: str = field(default_factory=lambda: str(Path(tempfile.gettempdir()) / "april_ray_servers"))
    extra_args: list[str] = field(default_factory=list)
    api_key: str = field(default_factory=lambda: secrets.token_hex(32))
    """`Authorization: Bearer` key of /generate and the info endpoints (a fresh one per server)."""
    admin_api_key: str = field(default_factory=lambda: secrets.token_hex(32))
    """Key of the admin endpoints: abort, pause, weight updates, memory, cache."""
    weights_root: str = ""
    """Our server only: /update_weights_from_disk also loads from under this directory (always from the
    model's own). Empty: the model's directory only."""


def reachable_host(host: str) -> str:
    """The address clients use for a server bound to `host`: a wildcard bind is reached at this node's IP
    as Ray knows it (what other nodes reach it at); outside Ray, the one its hostname resolves to (which
    /etc/hosts may map to loopback)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None  # resolved before any fork


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (an engine actor killed by
    Ray must not leave a server holding a GPU). One raw syscall: nothing here may take a lock."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A started server: its URL, process and log."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, command: list[str], api_key: str = "",
                 admin_api_key: str = ""):
        self.proc, self.url, self.log_path, self.command = proc, url, log_path, command
        self.api_key, self.admin_api_key = api_key, admin_api_key

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log at {self.log_path}: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def died(self) -> ServerDied:
        return ServerDied(f"the server at {self.url} exited with code {self.proc.poll()} "
                          f"(log {self.log_path}); its last lines:\n{self.tail()}")

    def check(self) -> None:
        if not self.alive():
            raise self.died()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"the server at {self.url} was not healthy after {timeout_s:.0f}s "
                           f"(command: {' '.join(self.command)}); its last log lines:\n{self.tail()}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the server's process group (SGLang runs a scheduler and a detokenizer as children),
        then SIGKILL if it lingers."""
        if not self.alive():
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue


class Launcher:
    """Builds the command of one kind of server; starting and waiting are shared."""

    name = ""

    def check_installed(self) -> None:
        """Raise with the install command when the server cannot run here."""

    def command(self, opts: ServerOptions, port: int) -> list[str]:
        raise NotImplementedError

    def start(self, opts: ServerOptions, tag: str = "engine") -> ServerProcess:
        server = self.launch(opts, tag)
        server.wait_healthy(opts.startup_timeout_s)
        return server

    def launch(self, opts: ServerOptions, tag: str = "engine") -> ServerProcess:
        """The server's process, started and not yet waited for (`ServerProcess.wait_healthy`): several
        servers launched first and then waited for start side by side."""
        self.check_installed()
        port = free_port(opts.host)
        cmd = self.command(opts, port) + list(opts.extra_args)
        keys = [f"--api-key={opts.api_key}", f"--admin-api-key={opts.admin_api_key}"]  # "=": a key may start with "-"
        log_dir = Path(opts.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{self.name}-{tag}-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd + keys, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        server = ServerProcess(proc, f"http://{reachable_host(opts.host)}:{port}", log_path, cmd, opts.api_key,
                               opts.admin_api_key)
        return server


class SGLangLauncher(Launcher):
    name = "sglang"

    def check_installed(self) -> None:
        if importlib.util.find_spec("sglang") is None:
            raise RuntimeError("engine.backend=sglang needs SGLang, which is not installed in this environment "
                               f"({sys.executable}): pip install 'april-ray[sglang]' on the GPU nodes, "
                               "or use engine.backend=cpu_http")

    def command(self, opts: ServerOptions, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", opts.model_path,
               "--skip-tokenizer-init", "--tp-size", str(opts.tp_size),
               "--mem-fraction-static", str(opts.mem_fraction), "--context-length", str(opts.max_model_len),
               "--max-running-requests", str(opts.max_num_seqs), "--random-seed", str(opts.seed),
               "--weight-version", opts.weight_version, "--host", opts.host, "--port", str(port)]
        return cmd + (["--enable-memory-saver"] if opts.memory_saver else [])


class CPUServerLauncher(Launcher):
    name = "cpu_http"

    def command(self, opts: ServerOptions, port: int) -> list[str]:
        return [sys.executable, "-m", "april_ray.engine.http_server", "--model-path", opts.model_path,
                "--host", opts.host, "--port", str(port), "--device", opts.device,
                "--max-num-seqs", str(opts.max_num_seqs), "--max-model-len", str(opts.max_model_len),
                "--max-prefill-tokens", str(opts.max_prefill_tokens), "--num-threads", str(opts.num_threads),
                "--seed", str(opts.seed), "--park-slots", str(opts.park_slots),
                "--max-versions", str(opts.max_versions), "--weight-version", opts.weight_version,
                f"--weights-root={opts.weights_root}"]


LAUNCHERS: dict[str, type[Launcher]] = {"sglang": SGLangLauncher, "cpu_http": CPUServerLauncher}
"""By `engine.backend`."""
