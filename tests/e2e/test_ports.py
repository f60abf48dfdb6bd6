"""Per-run ports and data-plane bind addresses, with real listeners: two runs on one host get ports
of their own and both work, and every listener we start binds the address it was given, never
all interfaces (issue 28 item 6). Cheap: two Mooncake masters and two 2-rank gloo rendezvous."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from store_fixtures import ROOT, listening, needs_mooncake, small_store_cfg

from hpctoolkit.rundir.atomic import read_json
from hpctoolkit.rundir.layout import RunDir
from hpctoolkit.store.mooncake_master import launch_master
from hpctoolkit.store.probe import check_reachable, master_healthy

pytestmark = [pytest.mark.real]

# Any address of the loopback net proves the bind address is the one given (127.0.0.1 could be a
# default); 0.0.0.0 / :: would be every interface.
DATA_PLANE = "127.0.0.2"


@needs_mooncake
@pytest.mark.timeout(60)
def test_two_masters_on_one_host_pick_their_own_ports_and_bind_the_given_address(tmp_path):
    """Two runs' masters at once (ports picked at start): distinct ports, both healthy, and the
    RPC service and the metrics server of each on the data-plane address only."""
    cfg = dataclasses.replace(small_store_cfg(), bind_host=DATA_PLANE)
    with launch_master(cfg, tmp_path / "a") as a, launch_master(cfg, tmp_path / "b") as b:
        ports = {a.rpc_port, a.metrics_port, b.rpc_port, b.metrics_port}
        assert len(ports) == 4
        for m in (a, b):
            assert check_reachable(m.address, 5) and master_healthy(m.metrics_address)
            got = listening(m.pid)
            assert got == {(DATA_PLANE, m.rpc_port), (DATA_PLANE, m.metrics_port)}, got


RANK = r"""
import json, os, sys
import torch
from hpctoolkit.roles import context
from hpctoolkit.train.fsdp import init_distributed

ctx = context.load_context("recipes/tiny.yaml", sys.argv[1:])
proc = context.select_process(ctx, "trainer")
rendezvous, sock = context.trainer_rendezvous(ctx, proc)
os.environ.update(context.trainer_env(ctx, proc, rendezvous))
if sock is not None:
    os.environ["HPCTOOLKIT_RENDEZVOUS_FD"] = str(sock.detach())
dist = init_distributed(proc.node_rank, 2, "env://", "cpu")
total = torch.tensor([proc.node_rank + 1.0])
dist.all_reduce_sum(total)
print(json.dumps({"rank": proc.node_rank, "sum": total.item(), "pid": os.getpid()}), flush=True)
sys.stdin.readline()  # the test reads this rank's listeners meanwhile
dist.barrier()
dist.close()
"""


@pytest.mark.timeout(120)
def test_two_local_runs_trainer_rendezvous_get_their_own_ports_on_the_data_plane(tmp_path):
    """Two local runs' trainers at once, through the trainer role's own calls: rank 0 of each
    listens on `cluster.network`'s address at a port it picked and recorded, its rank 1 finds it
    there, both groups work, and no rendezvous listens on all interfaces."""
    import json

    runs, procs = [], []
    for name in ("run-a", "run-b"):
        out = tmp_path / name
        overrides = [
            f"paths.output_dir={out}",
            "training.world_size=2",
            "training.device=cpu",
            "cluster.network=lo",
            "cluster.gpus_per_node=4",
        ]
        runs.append(RunDir.of(out, name))
        for rank in (0, 1):
            env = {**os.environ, "HPCTOOLKIT_RUN_ID": name, "RANK": str(rank), "GLOO_SOCKET_IFNAME": "lo"}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", RANK, *overrides],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
    try:
        said = [json.loads(p.stdout.readline() or "{}") for p in procs]  # type: ignore[union-attr]
        assert [s.get("sum") for s in said] == [3.0] * 4, said
        records = [read_json(run.port_record("trainers")) for run in runs]
        assert [r["run_id"] for r in records] == ["run-a", "run-b"]
        assert all(r["address"] == "127.0.0.1" for r in records)
        assert records[0]["port"] != records[1]["port"]
        for rank0, record in ((said[0], records[0]), (said[2], records[1])):
            mine = {(ip, port) for ip, port in listening(rank0["pid"]) if port == record["port"]}
            assert mine == {("127.0.0.1", record["port"])}, mine
            # gloo's own listeners follow GLOO_SOCKET_IFNAME; none of this rank's is on all interfaces.
            assert not {ip for ip, _ in listening(rank0["pid"])} & {"0.0.0.0", "::"}
        for p in procs:
            p.stdin.write("\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        assert [p.wait(60) for p in procs] == [0] * 4
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
