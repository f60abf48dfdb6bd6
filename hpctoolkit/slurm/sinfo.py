"""What the partition says about its nodes (`sinfo`), through the package's one command runner."""

from __future__ import annotations

import re

from hpctoolkit.slurm import shell

# sinfo answers at once, or its controller is not there.
SINFO_TIMEOUT_S = 15.0


def parse_node_memory_mb(text: str) -> int | None:
    """The smallest node memory in `sinfo -h -N -o %m` output (MB per line, `515000+` allowed)."""
    sizes = [int(m.group(1)) for line in text.splitlines() if (m := re.match(r"\s*(\d+)", line))]
    return min(sizes) if sizes else None


def node_memory_bytes(partition: str | None) -> int | None:
    """The memory of the partition's smallest node, or None where `sinfo` does not answer (no
    Slurm here, no controller) or reports none."""
    cmd = ["sinfo", "-h", "-N", "-o", "%m", *(["-p", partition] if partition else [])]
    try:
        mb = parse_node_memory_mb(shell.run(cmd, timeout_s=SINFO_TIMEOUT_S))
    except shell.CommandError:
        return None
    # Slurm's default RealMemory is 1 MB: a node that reports it has no memory configured.
    return None if mb is None or mb <= 1 else mb << 20
