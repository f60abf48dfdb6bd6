"""Regeneration turn by turn with a stand-in generator (the real target: test_roles_local.py and the
equality test below): each assistant turn is the target's answer to the regenerated history;
sampling settings, per-request seeds, and the empty/truncated/failed counts with the threshold."""

from __future__ import annotations

import os

import pytest
import torch

from hpctoolkit.data.template import ChatSpec, prompt_ids
from hpctoolkit.engine.regenerate import RegenReport, Sampling, regenerate_rows
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.store.fragments import LossMasks
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.targets.builtin import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def chat(*turns):
    roles = ["user", "assistant"]
    return {
        "kind": "chat",
        "messages": [
            {"role": roles[i % 2], "content": t, "reasoning_content": None} for i, t in enumerate(turns)
        ],
        "origin": "f: row 0",
    }


class Fake:
    """Answers `ANSWERS[k]` to the k-th request; records prompts, limits and seeds."""

    def __init__(self, tok, answers, finish="stop"):
        self.tok, self.answers, self.finish = tok, list(answers), finish
        self.calls = []
        self.outputs = []

    def __call__(self, prompts, max_tokens, seeds):
        self.calls.append((prompts, max_tokens, seeds))
        out = []
        for _ in prompts:
            text = self.answers.pop(0)
            ids = self.tok(text, add_special_tokens=False).input_ids if text else []
            out.append(([*ids, self.tok.convert_tokens_to_ids("<|im_end|>")], self.finish))
        self.outputs.append(out)
        return out


def test_multi_turn_is_regenerated_turn_by_turn(tok):
    spec = ChatSpec()
    rows = [chat("the cat", "OLD one", "the dog", "OLD two"), chat("a bird")]
    gen = Fake(tok, ["sat down", "flew", "ran off"])
    out, report = regenerate_rows(
        rows, tok, spec, gen, Sampling(16, 0.7, 0.9, 5), max_prompt_tokens=256, max_model_len=512
    )
    # Round 0: the first assistant turn of both rows; round 1: row 0's second, after its new first.
    (p0, m0, s0), (p1, _, s1) = gen.calls
    assert len(p0) == 2 and len(p1) == 1
    assert tok.decode(p1[0]).endswith(
        "the cat<|im_end|>\n<|im_start|>assistant\nsat down<|im_end|>\n<|im_start|>user\nthe dog<|im_end|>\n<|im_start|>assistant\n"
    )
    assert s0 == [5, 1005] and s1 == [5 + 1] and m0 == [16, 16]
    sup = tok.decode([i for i, m in zip(out[0]["input_ids"], out[0]["loss_mask"], strict=True) if m])
    assert sup == "sat down<|im_end|>ran off<|im_end|>"
    assert "OLD" not in tok.decode(out[0]["input_ids"])
    # The last turn is exactly what the target produced for exactly the prompt it was given.
    assert out[0]["input_ids"] == p1[0] + gen.outputs[1][0][0]
    assert (
        tok.decode([i for i, m in zip(out[1]["input_ids"], out[1]["loss_mask"], strict=True) if m])
        == "flew<|im_end|>"
    )
    assert report.to_dict() == {
        "samples": 2,
        "turns": 3,
        "empty": 0,
        "truncated": 0,
        "failed": 0,
        "bad_samples": 0,
        "degenerate": 0,
        "degenerate_samples": 0,
    }


def test_text_rows_are_prompt_plus_continuation_supervised_on_the_continuation(tok):
    gen = Fake(tok, ["the mat"])
    out, _ = regenerate_rows(
        [{"kind": "text", "text": "the cat sat on", "origin": "x"}],
        tok,
        ChatSpec(),
        gen,
        Sampling(8),
        max_prompt_tokens=64,
        max_model_len=128,
    )
    prompt = tok("the cat sat on", add_special_tokens=False).input_ids
    assert out[0]["input_ids"][: len(prompt)] == prompt
    assert out[0]["loss_mask"] == [0] * len(prompt) + [1] * (len(out[0]["input_ids"]) - len(prompt))


def test_empty_truncated_and_failed_are_counted_and_the_threshold_holds(tok):
    rows = [chat("the cat", "KEEP"), chat("the dog"), chat("x " * 300)]
    gen = Fake(tok, ["", "ran"], finish="length")
    out, report = regenerate_rows(
        rows, tok, ChatSpec(), gen, Sampling(4), max_prompt_tokens=64, max_model_len=512
    )
    assert (report.empty, report.truncated, report.failed, report.bad_samples, report.turns) == (
        1,
        2,
        1,
        2,
        3,
    )
    # The empty turn keeps the row's own response; the failed row has nothing to supervise.
    assert "KEEP" in tok.decode(out[0]["input_ids"]) and not any(out[2]["loss_mask"])
    report.check(0.7)
    with pytest.raises(
        DataIntegrityError, match=r"2 of 3 samples .*empty 1, failed 1, truncated 2 of 3 turns"
    ):
        report.check(0.5)
    assert RegenReport(samples=4, bad_samples=0).check(0.0) is None


def test_an_answer_in_a_repetition_loop_is_not_trained_on_and_is_counted_apart_from_failures(tok):
    loop = "the end " + "so so so so " * 40  # the target looping until its token limit
    rows = [chat("the cat", "KEEP"), chat("the dog"), {"kind": "text", "text": "a b", "origin": "t"}]
    gen = Fake(tok, [loop, loop, "fine"], finish="length")
    # The text row is regenerated first: its continuation is the first answer.
    out, report = regenerate_rows(
        rows, tok, ChatSpec(), gen, Sampling(64), max_prompt_tokens=64, max_model_len=512
    )
    assert (report.degenerate, report.degenerate_samples, report.bad_samples) == (2, 2, 0)
    assert not any(out[2]["loss_mask"])  # the text row: its prompt alone
    assert "KEEP" in tok.decode(out[0]["input_ids"]) and "so so so" not in tok.decode(out[0]["input_ids"])
    assert tok.decode([i for i, m in zip(out[1]["input_ids"], out[1]["loss_mask"], strict=True) if m]) == (
        "fine<|im_end|>"
    )
    report.check(0.0)  # loops are the target's own behaviour, not a failed regeneration


def test_leader_masks_are_found_by_input_ids_and_refuse_a_stranger(tok):
    from hpctoolkit.capture.manifest import build_manifest
    from hpctoolkit.store.fragments import INPUT_IDS_SHA256, input_ids_digest

    ids = [3, 4, 5, 6]
    st = MemoryStore()
    masks = LossMasks(st, [(ids, [0, 1, 1, 0])])
    m = build_manifest(
        "k", [1, 6], 4, 8, 6, 1, "bfloat16", extra={INPUT_IDS_SHA256: input_ids_digest(torch.tensor(ids))}
    )
    named = masks.publish(m)
    assert named.loss_mask is not None and st.keys() == ["k_loss_mask"] and masks.supervised == 2
    with pytest.raises(DataIntegrityError, match="sample 'k': its input_ids match no prompt"):
        masks.publish(m)  # each mask once


def test_prompt_ids_end_with_the_generation_prompt(tok):
    ids = prompt_ids(tok, [{"role": "user", "content": "hi"}], ChatSpec())
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_an_answer_is_asked_for_no_more_than_the_engine_can_capture(tok):
    """A prompt near engine.max_model_len: the target may answer up to max_model_len - 1 tokens in
    all, what `CaptureEngine.capture` accepts (the sample must stay under max_model_len)."""
    gen = Fake(tok, ["the mat"])
    text = "the cat sat on " * 4
    prompt = tok(text, add_special_tokens=False).input_ids
    regenerate_rows(
        [{"kind": "text", "text": text, "origin": "x"}],
        tok,
        ChatSpec(),
        gen,
        Sampling(64),
        max_prompt_tokens=64,
        max_model_len=len(prompt) + 10,
    )
    assert gen.calls[0][1] == [9]


def test_the_generating_engines_environment_wins_over_the_inherited_one(monkeypatch, tmp_path):
    """A VLLM_HOST_IP / VLLM_ENABLE_V1_MULTIPROCESSING=0 the process inherited (a login shell, an
    earlier in-process engine) must not reach a multi-node generating engine: its message queue
    then listened on 127.0.0.1 and the other node's workers never joined (a hang on the emulated
    hosts). vLLM is replaced here by a stand-in that records the environment it started in; the
    real engine over two hosts is tests/e2e/test_multihost.py, whose jobs inherit such values."""
    import sys
    import types

    from hpctoolkit.engine.regenerate import Sampling, vllm_generator

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update({k: os.environ.get(k) for k in ("VLLM_HOST_IP", "VLLM_ENABLE_V1_MULTIPROCESSING")})

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = LLM, object
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env = {"VLLM_HOST_IP": "198.18.1.13", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    vllm_generator(tmp_path, Sampling(4), 64, {"enforce_eager": True}, env)
    assert seen == env


def test_replicas_each_on_a_slice_give_one_engines_rows_seeds_and_counts(tok):
    """`engine.regenerate_replicas`: replica j regenerates rows j::N with the seeds those rows
    have in the whole share, and the merge puts them back in order with the counts summed."""
    from hpctoolkit.roles.replicas import merge_replicas

    rows = [chat(f"row {i}") for i in range(5)]
    whole = Fake(tok, [f"answer {i}" for i in range(5)])
    out, report = regenerate_rows(
        rows, tok, ChatSpec(), whole, Sampling(8, 0.7, 0.9, 3), max_prompt_tokens=64, max_model_len=256
    )
    parts, seeds = [], []
    for j in range(2):
        fake = Fake(tok, [f"answer {i}" for i in range(j, 5, 2)])
        o, r = regenerate_rows(
            rows[j::2],
            tok,
            ChatSpec(),
            fake,
            Sampling(8, 0.7, 0.9, 3),
            max_prompt_tokens=64,
            max_model_len=256,
            row_ids=list(range(j, 5, 2)),
        )
        seeds += fake.calls[0][2]
        parts.append({"samples": o, "report": r.to_dict(), "synthesized": None})
    assert sorted(seeds) == sorted(whole.calls[0][2])
    merged = merge_replicas(parts, 5)
    assert merged["samples"] == out
    assert merged["report"] == report.to_dict()
    with pytest.raises(DataIntegrityError, match="replica 1 of 2 returned 1 rows, expected 2"):
        merge_replicas([parts[0], {**parts[1], "samples": parts[1]["samples"][:1]}], 5)


def test_replicas_need_a_one_gpu_engine():
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.errors import ConfigError

    EngineConfig(regenerate_replicas=4).validate()
    with pytest.raises(ConfigError, match="regenerate_replicas must be 1 for an engine of 8 GPUs"):
        EngineConfig(regenerate_replicas=2, gpus_per_node=8).validate()
