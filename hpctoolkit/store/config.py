"""Typed config of the Mooncake store section (`store.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hpctoolkit.config.fields import (
    Bool,
    Choice,
    Float,
    HostPort,
    Kind,
    Port,
    Seconds,
    Size,
    SlurmText,
    check_fields,
    require,
)


@dataclass
class StoreConfig:
    # host:port of a running master. Unset: the run launches its own master.
    master_address: str | None = None
    # Interface the launched master (and its metrics server) binds to; never 0.0.0.0 by default.
    bind_host: str = "127.0.0.1"
    # 0 picks a free port.
    master_port: int = 0
    metrics_port: int = 0
    # Master lease on objects after a read, seconds (mooncake_master --default_kv_lease_ttl).
    kv_lease_ttl_s: float = 5.0
    # How long a reader keeps retrying a fragment that is not there yet before it fails.
    get_retry_max_wait_seconds: float = 60.0
    # Pin published fragments so eviction cannot take them before the trainer reads them.
    enable_hard_pin: bool = False
    # Memory each *writer* mounts into the store, in the host memory of its node: one writer per
    # PP stage per engine (the stage's TP rank 0), holding that stage's fragments of every unread
    # sample of its engine (hpctoolkit.plan.sizing). Readers mount none. `local_buffer_size` is
    # every client's (writers and trainer ranks) registered transfer buffer. Both in bytes: a
    # recipe writes them as `512MB` (`config.fields.Size`), parsed once at load.
    global_segment_size: int = 512 << 20
    local_buffer_size: int = 256 << 20
    protocol: str = "tcp"
    device_name: str = ""
    # P2PHANDSHAKE keeps every connection on the interface we name (HTTP metadata binds the
    # transfer engine to the external interface).
    metadata_server: str = "P2PHANDSHAKE"
    # Reachability check at engine start; an unreachable master fails within this many seconds.
    connect_timeout_s: float = 10.0
    # host:port of the master's HTTP metrics server, for counting keys through the master when the
    # run connects to an external master. A launched master knows its own.
    master_metrics_address: str | None = None
    # A launched master must answer its health check within this many seconds.
    master_startup_timeout_s: float = 30.0
    # A put refused with NO_AVAILABLE_HANDLE (writer segment full) is retried with backoff for at
    # most this long before the writer raises.
    put_retry_max_wait_seconds: float = 30.0
    # Backpressure: an engine leader pauses capture, between batches, while the unread bytes in
    # one of its writers' segments are above `backpressure_high` of the segment, and resumes
    # below `backpressure_low`. A pause longer than `backpressure_max_pause_s` fails the engine.
    backpressure_high: float = 0.8
    backpressure_low: float = 0.5
    backpressure_max_pause_s: float = 3600.0

    KINDS: ClassVar[dict[str, Kind]] = {
        "master_address": HostPort(optional=True),
        "bind_host": SlurmText(word=True, nonempty=True),
        "master_port": Port(zero=True),
        "metrics_port": Port(zero=True),
        "kv_lease_ttl_s": Seconds(),
        "get_retry_max_wait_seconds": Seconds(),
        "enable_hard_pin": Bool(),
        "global_segment_size": Size(),
        "local_buffer_size": Size(),
        "protocol": Choice(("tcp", "rdma")),
        "device_name": SlurmText(word=True),
        "metadata_server": SlurmText(word=True, nonempty=True),
        "connect_timeout_s": Seconds(),
        "master_metrics_address": HostPort(optional=True),
        "master_startup_timeout_s": Seconds(),
        "put_retry_max_wait_seconds": Seconds(zero=True),
        "backpressure_high": Float(),  # in (backpressure_low, 1): validate()
        "backpressure_low": Float(0.0, 1.0, lo_open=True, hi_open=True),
        "backpressure_max_pause_s": Seconds(),
    }

    def validate(self) -> None:
        check_fields(self)
        require(
            0 < self.backpressure_low < self.backpressure_high < 1,
            "backpressure_high",
            f"must lie in (backpressure_low={self.backpressure_low:g}, 1)",
            self.backpressure_high,
        )
