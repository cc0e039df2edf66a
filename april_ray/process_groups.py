"""torch.distributed groups that listen only where the job says: the learner ranks' group and the weight
broadcast group (a learner's rank 0 with every server) both rendezvous through a TCPStore that rank 0 hosts
on the master address alone, and their gloo sockets bind to the local address that reaches that master
(127.0.0.1 for a job on one node), never the one the hostname resolves to. torch is imported by the functions
that make a group: `free_port` (an HTTP server's port) imports nothing heavy.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_address_towards(master_address: str) -> str:
    """This host's address on the route to `master_address` (no packet is sent): loopback for loopback."""
    family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master_address, 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address` (None if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def bind_gloo_towards(master_address: str) -> None:
    """Gloo binds each rank's sockets to the address the hostname resolves to (a LAN address on many cloud
    VMs) unless `GLOO_SOCKET_IFNAME` names an interface: name the one that reaches the master, so a job on
    loopback stays on loopback. An interface the operator named already is kept."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    interface = interface_of(local_address_towards(master_address))
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def tcp_store(address: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore whose server (on the master) listens on `address` only: left to itself it listens on every
    interface (::) whatever address it is given; handed a socket bound to the address
    (`master_listen_fd`), it listens there (127.0.0.1 on one node; tests/test_listeners.py)."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(address, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen()
    store = dist.TCPStore(address, port, world_size, True, timeout, master_listen_fd=sock.fileno())
    sock.detach()  # the store's server owns the descriptor now
    return store


def init_default_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                       timeout_s: float = 600.0) -> None:
    """The learner ranks' (default) group, over a store rank 0 hosts on `master_address`."""
    import torch.distributed as dist

    if backend == "gloo":
        bind_gloo_towards(master_address)
    store = tcp_store(master_address, master_port, world_size, rank == 0, timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def init_custom_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout_s: float = 300.0):
    """A process group of its own (never the default one): rendezvous on master_address:master_port,
    where rank 0 hosts the store. Mirrors SGLang's `init_custom_process_group`, so a learner built on it
    broadcasts into a real SGLang server, and our server receives from a learner that uses SGLang's."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    if backend == "gloo":
        bind_gloo_towards(master_address)
    timeout = timedelta(seconds=timeout_s)
    store = PrefixStore(group_name, tcp_store(master_address, master_port, world_size, rank == 0, timeout))
    pg, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)
