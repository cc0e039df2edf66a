"""A training job as a user starts it (`python -m jobs.train` in the user's environment, with a local Ray of
its own), run to its end, with the listening sockets of its processes recorded while it trains: one run that
`conftest.py` shares between the tests of its training and the test of its listeners (tests/test_listeners.py)."""
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["task.num_train=300", "task.num_eval=16", "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8",
         "rollout.n_samples_per_prompt=4", "sampling.max_response_len=24", "engine.max_model_len=64",
         # a random policy never solves countdown; overlong shaping gives its rewards variance to learn from
         "algorithm.overlong_buffer=8", "learner.lr=1e-3", "logging.wandb_mode=disabled",
         "engine.num_engines=1"]
"""A few short steps of the random tiny model (tests/conftest.py's `random_model_dir`), on one engine: each
engine process costs the suite its imports and model load, so a job whose checks are not about several
engines starts one (the HTTP jobs, whose broadcast group spans the engines, ask for two); and no wandb run,
but in the job whose tests read one."""


def listeners(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of `root` and its descendants. On Linux
    from /proc: the listening sockets of the job's network namespace read once, matched to each process's
    open sockets (psutil reads both tables again for every process, 0.1 CPU-s a call for a job's ~15
    processes here, a fifth of a core at two calls a second)."""
    out = []
    try:
        inodes = listening_sockets(root.pid) if Path(f"/proc/{root.pid}/net/tcp").is_file() else None
    except OSError:  # the job ended meanwhile
        return out
    for p in [root, *root.children(recursive=True)]:
        try:
            title = p.cmdline()[:1]  # a Ray worker: "ray::LearnerActor.train", though its comm may read "python"
            name = title[0] if title and title[0].startswith("ray::") else p.name()
            if inodes is None:
                out += [(name, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN]
            else:
                out += [(name, *inodes[inode]) for inode in socket_inodes(p.pid) if inode in inodes]
        except (psutil.Error, OSError):
            continue
    return out


def listening_sockets(pid: int) -> dict[str, tuple[str, int]]:
    """Inode -> (address, port) of the TCP sockets in the LISTEN state in `pid`'s network namespace."""
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in list(f)[1:]:
                fields = row.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                ip = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                found[fields[9]] = (ip, int(port, 16))
    return found


def socket_inodes(pid: int) -> list[str]:
    """The inodes of the sockets `pid` holds open."""
    inodes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.append(link[8:-1])
    return inodes


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def lan_address() -> str | None:
    """This machine's first non-loopback IPv4 address (None if it has none)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not loopback(a.address):
                return a.address
    return None


def on_lan_hostname(cmd: list[str], tmp_path: Path) -> tuple[list[str], str | None]:
    """`cmd` run where this machine's hostname resolves to its LAN address, as on many cloud VMs (here it
    resolves to 127.0.0.1): in a private mount namespace with its own /etc/hosts (`unshare -m`, as root).
    Returns (the command, the address), or (`cmd`, None) where that cannot be done."""
    address = lan_address()
    if address is None or shutil.which("unshare") is None:
        return cmd, None
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{address} {socket.gethostname()}\n")
    wrap = ["unshare", "-m", "sh", "-c", f"mount --bind {hosts} /etc/hosts && exec \"$@\"", "sh"]
    resolve = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    probe = subprocess.run([*wrap, sys.executable, "-c", resolve], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or probe.stdout.strip() != address:
        return cmd, None
    return [*wrap, *cmd], address


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    listeners: list[tuple[str, str, int]]
    """Every listening socket of the job's processes, sampled every half second from its start to its end."""
    hostname_address: str | None = None
    """What the job's hostname resolved to, when it ran on a LAN hostname (`on_lan_hostname`)."""


def run_job(cmd: list[str], out: Path, env: dict, timeout_s: float = 900, hostname_address: str | None = None) -> Run:
    """`cmd` (a training job writing to `out`) to its end, the listening sockets of its processes sampled
    from its start: its steps can all pass in a second or two, so sampling only once training began could
    see none before the job ended."""
    stdout, stderr = out.parent / "job.stdout", out.parent / "job.stderr"
    with open(stdout, "w") as o, open(stderr, "w") as e:
        job = subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=e, env=env)
    found: set = set()
    try:
        deadline = time.time() + timeout_s
        while job.poll() is None:
            assert time.time() < deadline, f"the job did not end within {timeout_s} s"
            try:
                found |= set(listeners(psutil.Process(job.pid)))
            except psutil.Error:  # it ended meanwhile
                pass
            time.sleep(0.5)
    finally:
        if job.poll() is None:
            under = psutil.Process(job.pid).children(recursive=True)
            job.send_signal(signal.SIGKILL)
            job.wait()
            _, alive = psutil.wait_procs(under, timeout=30)  # the job's watchdog ends its local Ray
            for p in alive:
                p.kill()
    return Run(job.returncode, stdout.read_text(), stderr.read_text(), sorted(found), hostname_address)


def train_command(config: str, model_dir, tmp_path: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "jobs.train", "--config", config, f"model.path={model_dir}",
            f"model.cache_dir={tmp_path}", f"train.output_dir={tmp_path}/out", *overrides,
            "--summary", f"{tmp_path}/summary.json"]
