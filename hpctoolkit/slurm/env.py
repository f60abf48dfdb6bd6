"""The Slurm environment of the current process, read through one typed object.

Everything hpctoolkit needs from `SLURM_*` variables goes through `SlurmEnvironment.from_env`; no
other module reads them. `expand_hostlist` implements `scontrol show hostnames` for the forms Slurm
prints (`node[1-3,5]`, zero-padded `gpu[001-016]`, several bracket groups, comma-separated lists),
so that placement never spawns `scontrol`.

Two identities matter and are easy to confuse: `node_id` / `SLURM_NODEID` is relative to the *job
step*, while `node_index` (the position of `SLURMD_NODENAME` in the job's node list) is what the
placement plan numbers. On the emulated cluster `hostname` prints the same name on every node, so
only `SLURMD_NODENAME` identifies the node.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hpctoolkit.config.fields import slurm_time_seconds
from hpctoolkit.errors import ConfigError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    parts.append("".join(cur))
    return [p for p in (s.strip() for s in parts) if p]


def _expand_ranges(body: str, text: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"bad range {item!r} in host list {text!r}")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ValueError(f"descending range {item!r} in host list {text!r}")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_one(pattern: str, text: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [head + v + rest for v in _expand_ranges(m.group(1), text) for rest in _expand_one(tail, text)]


def expand_hostlist(text: str) -> tuple[str, ...]:
    """`node[1-3,5],login01` -> ('node1', 'node2', 'node3', 'node5', 'login01'), in Slurm's order."""
    hosts: list[str] = []
    for part in _split_top(text):
        hosts.extend(_expand_one(part, text))
    return tuple(hosts)


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw:
            try:
                return int(raw.split("(")[0])  # SLURM_TASKS_PER_NODE style "8(x2)" -> 8
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None
    return None


@dataclass(frozen=True)
class SlurmEnvironment:
    job_id: str
    job_name: str | None
    # The whole job's hosts, expanded, in allocation order (index = placement node index).
    nodelist: tuple[str, ...]
    # This step's hosts (equal to nodelist in the batch shell).
    step_nodelist: tuple[str, ...]
    nodename: str | None
    node_id: int  # SLURM_NODEID: relative to the step
    proc_id: int  # SLURM_PROCID: global task rank within the step
    local_id: int  # SLURM_LOCALID: task rank on this node
    ntasks: int
    num_nodes: int
    step_id: str | None
    submit_dir: str | None
    cuda_visible_devices: str | None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SlurmEnvironment:
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            raise ConfigError("not inside a Slurm job: SLURM_JOB_ID is unset")
        array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        if array_job and array_task:
            job_id = f"{array_job}_{array_task}"
        raw_nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        try:
            nodes = expand_hostlist(raw_nodes)
            step_nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or raw_nodes)
        except ValueError as err:
            raise ConfigError(f"SLURM_JOB_NODELIST: {err}") from None
        return cls(
            job_id=job_id,
            job_name=env.get("SLURM_JOB_NAME"),
            nodelist=nodes,
            step_nodelist=step_nodes,
            nodename=env.get("SLURMD_NODENAME"),
            node_id=_int(env, "SLURM_NODEID") or 0,
            proc_id=_int(env, "SLURM_PROCID") or 0,
            local_id=_int(env, "SLURM_LOCALID") or 0,
            ntasks=_int(env, "SLURM_NTASKS", "SLURM_NPROCS") or 1,
            num_nodes=_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or len(nodes) or 1,
            step_id=env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"),
            submit_dir=env.get("SLURM_SUBMIT_DIR"),
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        )

    @staticmethod
    def detected(environ: Mapping[str, str] | None = None) -> bool:
        env = os.environ if environ is None else environ
        return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))

    @property
    def node_index(self) -> int:
        """This node's position in the job's node list: the placement plan's node index."""
        if self.nodename is None:
            raise ConfigError("SLURMD_NODENAME is unset: cannot tell which node of the job this is")
        try:
            return self.nodelist.index(self.nodename)
        except ValueError:
            raise ConfigError(
                f"SLURMD_NODENAME={self.nodename} is not in the job's nodes {list(self.nodelist)}"
            ) from None

    def host(self, index: int) -> str:
        if not 0 <= index < len(self.nodelist):
            raise ConfigError(f"node index {index} is outside the job's {len(self.nodelist)} node(s)")
        return self.nodelist[index]

    @property
    def gpus(self) -> tuple[int, ...]:
        cvd = self.cuda_visible_devices
        if not cvd:
            return ()
        return tuple(int(x) for x in cvd.split(",") if x.strip().isdigit())


def time_limit_minutes(time: str) -> int:
    """A Slurm time limit (`config.fields.slurm_time_seconds`'s six forms) in whole minutes, rounded up."""
    return -(-slurm_time_seconds(time, "cluster.time") // 60)
