"""The cluster section's own checks (`cluster.*`)."""

from __future__ import annotations

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.config import ClusterConfig
from hpctoolkit.recipe.load import compose


def test_defaults_are_valid():
    ClusterConfig().validate()
    ClusterConfig(backend="slurm", nodes=5, network="ib0").validate()  # no container: the python on PATH
    ClusterConfig(backend="slurm", nodes=1).validate()  # one node: loopback is its data plane


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"backend": "k8s"}, "backend"),
        ({"nodes": 0}, "nodes"),
        ({"trainer_nodes": 3, "nodes": 2}, "trainer_nodes"),
        ({"job_name": "two words"}, "job_name"),
        ({"container": ""}, "container"),
        ({"backend": "slurm", "nodes": 2}, "network"),  # several nodes must name their network
        ({"network": ""}, "network"),
        ({"signal_before_s": 0}, "signal_before_s"),
        ({"sbatch_extra": ["-p gpu"]}, "sbatch_extra"),
        ({"sbatch_extra": ["--qos=a\n#SBATCH --x"]}, "sbatch_extra"),
    ],
)
def test_bad_fields_name_the_key(fields, key):
    with pytest.raises(ConfigError) as err:
        ClusterConfig(**fields).validate()
    assert str(err.value).startswith(key)


def test_recipe_prefixes_the_section(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "paths: {output_dir: x, target_model: y}\ndraft: {config: z}\ncluster: {job_name: 'a b'}\n"
    )
    with pytest.raises(ConfigError, match=r"^cluster\.job_name"):
        compose(recipe)
