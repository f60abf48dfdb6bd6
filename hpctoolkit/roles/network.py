"""Which address a role binds and advertises: this host's address on the data-plane network.

`cluster.network` names that network, as an interface (`ib0`, `eth0`, `lo`) or a CIDR
(`10.1.0.0/16`). Each process finds its own address on it at start (`local_address`); a host with
no address on it stops with one line naming the setting. That address is what the role binds and
advertises everywhere: the Mooncake master, every Mooncake writer and reader (`local_hostname`),
vLLM (`VLLM_HOST_IP`, the multi-node `master_addr`), gloo and NCCL (`*_SOCKET_IFNAME`) and the
trainers' `MASTER_ADDR`. Other hosts learn it from the run directory (`hosts/n<k>.json`), never from
a name lookup: a node's name need not resolve, nor resolve to its data-plane address.

`choose` is pure; `interfaces` reads this host's IPv4 interface addresses (ioctl, no subprocess).

Ports are picked per run, on that address, when a listener starts (`plan.ports`), in one of two ways:

* `listen`: bind port 0 and keep the socket listening; the process hands it to the server that
  serves on it (the trainers' torch.distributed store, `train.fsdp`). No other process can take
  the port in between.
* `free_port`: bind port 0, read the port, close; for servers that bind by themselves (vLLM's
  multi-node rendezvous). Another process on the node may take the port between the pick and the
  server's bind (a small race, as with any picked port): the server then fails at start with
  "address already in use" and the run stops with that line, never a hang.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

from hpctoolkit.errors import ConfigError

LOOPBACK = "lo"
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class HostAddress:
    """This host's interface and IPv4 address on the data-plane network."""

    ifname: str
    address: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def interfaces() -> dict[str, str]:
    """{interface name: IPv4 address} of this host's (network namespace's) interfaces that have one."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            out[name] = socket.inet_ntoa(raw[20:24])
    return out


def choose(network: str, ifaces: dict[str, str], host: str) -> HostAddress:
    """The interface and address of `ifaces` on `network` (an interface name or a CIDR). Pure."""
    if "/" in network:
        try:
            net = ipaddress.ip_network(network, strict=False)
        except ValueError as err:
            raise ConfigError(
                f"cluster.network={network!r} is neither an interface nor a CIDR: {err}"
            ) from None
        hits = sorted((n, a) for n, a in ifaces.items() if ipaddress.ip_address(a) in net)
        if hits:
            return HostAddress(*hits[0])
    elif network in ifaces:
        return HostAddress(network, ifaces[network])
    have = ", ".join(f"{n}={a}" for n, a in sorted(ifaces.items())) or "none"
    raise ConfigError(
        f"cluster.network={network!r}: host {host} has no address on it (its interfaces: {have}); "
        "set cluster.network to the data-plane interface or CIDR every node has"
    )


def local_address(network: str, host: str) -> HostAddress:
    return choose(network, interfaces(), host)


def listen(address: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `address:port` (0: a free port); the caller owns it."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {address}:{port}: {err.strerror}") from None
    return sock


def free_port(address: str) -> int:
    """A port free on `address` a moment ago (see the module docstring for the race)."""
    with listen(address) as sock:
        return int(sock.getsockname()[1])
