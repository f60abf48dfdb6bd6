"""What the regeneration tests share: the rows (multi-turn chats, a ShareGPT row, plain text),
their overrides, and the check that a run captured the target's own greedy answers to them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hpctoolkit.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[1]
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
    # Every trainer rank spooled its own share.
    readers = [ShardReader(d) for d in sorted(run.spool.glob("rank*"))]
    samples = {s.key: s for r in readers for s in (r[i] for i in range(len(r)))}
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
