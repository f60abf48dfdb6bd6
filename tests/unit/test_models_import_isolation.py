"""`hpctoolkit.models` (and the exporter) must work on GPU hosts without vLLM, Mooncake or OmegaConf."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys

class Block:
    blocked = ("vllm", "mooncake", "omegaconf")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.blocked:
            raise ImportError(f"{name} is blocked by the isolation test")
        return None

sys.meta_path.insert(0, Block())
try:
    import vllm  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not work")

import torch
import hpctoolkit.models.export  # noqa: F401
import hpctoolkit.evaluate.simulate  # noqa: F401
from hpctoolkit.models.dflash.layout import make_block_layout
from hpctoolkit.models.registry import build_draft_model, load_draft_config

config = load_draft_config(sys.argv[1])
model = build_draft_model(config)
ids = torch.randint(0, 500, (1, 20))
ctx = torch.randn(1, 20, config.num_target_layers * config.target_hidden_size)
out = model(ctx, ids, make_block_layout(torch.tensor([[4]]), config.block_size, 20))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in Block.blocked)
print("OK", tuple(out.hidden_BTH.shape), loaded)
"""


def test_models_import_without_vllm_mooncake_or_omegaconf():
    recipe = ROOT / "recipes" / "draft_models" / "tiny_k3_dspark_mla.json"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(recipe)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("OK (1, 7, 128) []"), proc.stdout


# The GPU tier's publish path (tests/gpu/test_publish_gpu.py) runs where only torch is installed.
def test_publish_path_imports_without_vllm_or_mooncake():
    code = (
        "import sys\n"
        "for m in ('vllm', 'mooncake'): sys.modules[m] = None\n"
        "import hpctoolkit.engine.publish, hpctoolkit.engine.tracker\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
