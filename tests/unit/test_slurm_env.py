"""The typed Slurm environment and the pure host-list expansion (`scontrol show hostnames`)."""

from __future__ import annotations

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.slurm.env import SlurmEnvironment, expand_hostlist


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ("node1",)),
        ("node[1-3]", ("node1", "node2", "node3")),
        ("node[1-3,5]", ("node1", "node2", "node3", "node5")),
        ("node[1-2,7-8]", ("node1", "node2", "node7", "node8")),
        ("gpu[001-003]", ("gpu001", "gpu002", "gpu003")),
        ("gpu[08-11]", ("gpu08", "gpu09", "gpu10", "gpu11")),
        ("node[1-2],login01", ("node1", "node2", "login01")),
        ("a1,b[2-3],c", ("a1", "b2", "b3", "c")),
        ("rack[1-2]-n[1-2]", ("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2")),
        ("node[5]", ("node5",)),
        ("x-[9-10].cluster", ("x-9.cluster", "x-10.cluster")),
        ("", ()),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "node[1,,2]"])
def test_expand_hostlist_rejects(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def step_env(**extra: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NAME": "k3-stage1",
        "SLURM_JOB_NODELIST": "node[1-5]",
        "SLURM_STEP_NODELIST": "node3",
        "SLURMD_NODENAME": "node3",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NUM_NODES": "5",
        "SLURM_STEP_ID": "2",
        "SLURM_SUBMIT_DIR": "/work",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    }
    env.update(extra)
    return env


def test_from_env_reads_everything():
    s = SlurmEnvironment.from_env(step_env())
    assert s.job_id == "1234" and s.job_name == "k3-stage1"
    assert s.nodelist == ("node1", "node2", "node3", "node4", "node5")
    assert s.step_nodelist == ("node3",)
    # SLURM_NODEID is step-relative (0 here); the plan's index comes from the job's list.
    assert s.node_id == 0 and s.node_index == 2
    assert (s.proc_id, s.local_id, s.ntasks, s.num_nodes) == (0, 0, 1, 5)
    assert s.step_id == "2" and s.submit_dir == "/work"
    assert s.gpus == tuple(range(8))
    assert s.host(4) == "node5"


def test_trainer_task_ids():
    s = SlurmEnvironment.from_env(step_env(SLURM_PROCID="11", SLURM_LOCALID="3", SLURM_NTASKS="16"))
    assert (s.proc_id, s.local_id, s.ntasks) == (11, 3, 16)


def test_array_job_id():
    s = SlurmEnvironment.from_env(step_env(SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="4"))
    assert s.job_id == "77_4"


def test_batch_shell_defaults():
    s = SlurmEnvironment.from_env({"SLURM_JOB_ID": "9", "SLURM_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n1"})
    assert s.nodelist == s.step_nodelist == ("n1", "n2")
    assert (s.proc_id, s.local_id, s.ntasks, s.num_nodes, s.node_index) == (0, 0, 1, 2, 0)
    assert s.gpus == () and s.cuda_visible_devices is None


def test_outside_slurm():
    assert not SlurmEnvironment.detected({})
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        SlurmEnvironment.from_env({"PATH": "/bin"})


def test_node_not_in_job():
    s = SlurmEnvironment.from_env(step_env(SLURMD_NODENAME="node9"))
    with pytest.raises(ConfigError, match="node9"):
        _ = s.node_index
    s = SlurmEnvironment.from_env(step_env(SLURMD_NODENAME=""))
    with pytest.raises(ConfigError):
        _ = s.node_index


def test_bad_values_name_the_variable():
    with pytest.raises(ConfigError, match="SLURM_PROCID"):
        SlurmEnvironment.from_env(step_env(SLURM_PROCID="x"))
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        SlurmEnvironment.from_env(step_env(SLURM_JOB_NODELIST="node[1-"))
    with pytest.raises(ConfigError, match="outside"):
        SlurmEnvironment.from_env(step_env()).host(7)


def test_envvars_registered():
    from hpctoolkit import envs

    names = envs.registered()
    for name in (
        "HPCTOOLKIT_NODE_DRY",
        "HPCTOOLKIT_PLAN_DIGEST",
        "HPCTOOLKIT_PYTHON",
        "HPCTOOLKIT_SLURM_STATE",
        "HPCTOOLKIT_MIN_STEP_S",
    ):
        assert name in names and names[name].doc
