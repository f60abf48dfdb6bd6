"""The field kinds of `config/fields.py`, exhaustively, and the rule that every field of every
section config declares one (so a new field gets the same checks). Pure; milliseconds."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from hpctoolkit.config import fields as F
from hpctoolkit.errors import ConfigError
from hpctoolkit.recipe.load import UniqueKeyLoader
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.slurm.env import time_limit_minutes


def _section_classes(cls: type, seen: dict[str, type] | None = None, prefix: str = "") -> dict[str, type]:
    """Every dataclass reachable from `cls` through its fields (nested sections, lists of them)."""
    seen = {} if seen is None else seen
    seen[prefix or "<recipe>"] = cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        for arg in (t, *typing.get_args(t)):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                _section_classes(arg, seen, f"{prefix}{f.name}.")
    return seen


SECTION_CLASSES = _section_classes(RecipeConfig)


def test_the_walk_finds_every_section():
    names = {c.__name__ for c in SECTION_CLASSES.values()}
    assert {"RecipeConfig", "ClusterConfig", "DataConfig", "DataSource", "MagpieConfig"} <= names
    assert {"EngineConfig", "StoreConfig", "TrainingConfig", "EvaluateConfig", "PathsConfig"} <= names


@pytest.mark.parametrize("where", sorted(SECTION_CLASSES))
def test_every_field_declares_its_kind(where):
    cls = SECTION_CLASSES[where]
    kinds = F.kinds_of(cls)  # raises naming the fields without a kind
    assert all(isinstance(k, F.Kind) for k in kinds.values())
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default in (None, "???", "") or dataclasses.is_dataclass(default):
            continue
        F.check_value(kinds[f.name], f.name, default)  # every default is accepted by its own kind


def test_a_field_without_a_kind_is_caught():
    @dataclasses.dataclass
    class Bad:
        a: int = 1
        b: int = 2
        KINDS: typing.ClassVar[dict[str, F.Kind]] = {"a": F.Int()}

    with pytest.raises(TypeError, match=r"missing \['b'\]"):
        F.check_fields(Bad())


def bad(kind: F.Kind, value, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        F.check_value(kind, "k", value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kind", [F.Float(), F.Float(0.0, 1.0), F.Seconds(), F.Seconds(zero=True)])
def test_non_finite_numbers_are_refused(kind, value):
    bad(kind, value, r"^k must be a finite number, got")


def test_float_bounds():
    k = F.Float(0.0, 1.0, lo_open=True)
    for ok in (1e-9, 0.5, 1.0, 1):
        F.check_value(k, "k", ok)
    bad(k, 0.0, r"must lie in \(0, 1\]")
    bad(k, 1.5, r"must lie in \(0, 1\]")
    bad(F.Float(lo=0.0), -1.0, r"must be >= 0")
    bad(F.Float(lo=0.0, lo_open=True), 0.0, r"must be > 0")
    bad(F.Float(hi=2.0, hi_open=True), 2.0, r"must be < 2")
    bad(F.Float(cap=10.0), 11.0, r"must be <= 10")
    bad(F.Float(), True, r"must be a number")
    bad(F.Float(), "1", r"must be a number")
    bad(F.Seconds(), 0.0, r"must be > 0")
    bad(F.Seconds(), 1e30, r"must be <= 3\.1536e\+07")
    F.check_value(F.Seconds(zero=True), "k", 0.0)


def test_int_bounds():
    F.check_value(F.Int(1), "k", F.COUNT_MAX)
    bad(F.Int(1), F.COUNT_MAX + 1, rf"must be <= {F.COUNT_MAX}")
    bad(F.Int(1), 10**30, rf"must be <= {F.COUNT_MAX}")
    bad(F.Int(1), 0, r"must be > 0")
    bad(F.Int(0), -1, r"must be >= 0")
    bad(F.Int(-1), -2, r"must be >= -1")
    bad(F.Int(), True, r"must be an integer")
    bad(F.Int(), 1.0, r"must be an integer")
    bad(F.Int(), None, r"must be set")
    F.check_value(F.Int(optional=True), "k", None)


def test_ports():
    for ok in (1, 80, 65535):
        F.check_value(F.Port(), "k", ok)
    F.check_value(F.Port(zero=True), "k", 0)
    bad(F.Port(), 0, r"must be > 0")
    bad(F.Port(zero=True), 65536, r"must be <= 65535")
    bad(F.Port(zero=True), -1, r"must be >= 0")


@pytest.mark.parametrize("ch", ["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\u2028"])
def test_slurm_text_refuses_control_characters(ch):
    bad(F.SlurmText(), f"a{ch}b", r"must hold no control characters")
    bad(F.Path(), f"/runs/a{ch}b", r"must hold no control characters")
    bad(F.ListOf(F.SlurmText()), ["--qos=x", f"--a{ch}"], r"^k\[1\] must hold no control characters")


def test_slurm_text_words_and_emptiness():
    F.check_value(F.SlurmText(word=True, nonempty=True), "k", "gpu-h200_x")
    F.check_value(F.SlurmText(), "k", "")
    F.check_value(F.Path(), "k", "/runs/über dir")  # non-ASCII and spaces are fine in a path
    bad(F.SlurmText(word=True), "a b", r"one word")
    bad(F.SlurmText(nonempty=True), "  ", r"must not be empty")
    bad(F.SlurmText(), 5, r"must be a string")
    F.check_value(F.Text(), "k", "line one\nline two\t")  # free text keeps its newlines


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30 * 60),  # MM
        ("90", 90 * 60),
        ("0:30", 30),  # MM:SS
        ("10:30", 10 * 60 + 30),
        ("04:00:00", 4 * 3600),  # HH:MM:SS
        ("48:00:00", 48 * 3600),
        ("00:00:01", 1),
        ("1-12", 36 * 3600),  # D-HH
        ("2-0", 48 * 3600),
        ("1-12:30", 36 * 3600 + 30 * 60),  # D-HH:MM
        ("1-00:00:00", 86400),  # D-HH:MM:SS
        ("7-23:59:59", 7 * 86400 + 23 * 3600 + 59 * 60 + 59),
    ],
)
def test_slurm_time_forms(text, seconds):
    assert F.slurm_time_seconds(text) == seconds
    F.check_value(F.SlurmTime(), "time", text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " 30",
        "30 ",
        "1:2:3:4",
        "1-1:2:3:4",
        "-5",
        "1-",
        "a",
        "1h",
        "1.5",
        "nan",
        "inf",
        "10:60",  # MM:SS with SS >= 60
        "1:60:00",
        "1:00:60",
        "1-24",
        "1-1:60",
        "1-1:1:60",
        "UNLIMITED",
        "INFINITE",
        "0",
        "00:00:00",
        "0-0",
        "٣٠",  # non-ASCII digits
        "1\n#SBATCH --x",
        "9999999999",
    ],
)
def test_slurm_time_refuses(text):
    with pytest.raises(ConfigError, match=r"^cluster\.time "):
        F.slurm_time_seconds(text)


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("04:00:00", 240), ("1-12", 2160), ("1-12:30", 2190), ("30", 30), ("10:30", 11), ("00:00:01", 1)],
)
def test_submitit_minutes_round_up(text, minutes):
    assert time_limit_minutes(text) == minutes


def test_network():
    for ok in ("ib0", "eth0", "enp1s0f0.100", "10.1.0.0/16", "10.1.2.3/24", "fd00::/8"):
        F.check_value(F.Network(), "k", ok)
    bad(F.Network(), "10.0.0.0/99", r"is not a valid CIDR")
    bad(F.Network(), "10.0.0.300/8", r"is not a valid CIDR")
    bad(F.Network(), "a-very-long-interface-name", r"must be an interface name")
    bad(F.Network(), "eth0\n", r"control characters")
    bad(F.Network(), "", r"must not be empty")


def test_sizes():
    assert F.parse_size("512MB", "k") == 512 << 20
    assert F.parse_size("4GiB", "k") == 4 << 30
    assert F.parse_size(1, "k") == 1
    bad(F.Size(), "0MB", r"positive size")
    bad(F.Size(), "2048TB", r"at most")
    bad(F.Size(), 1 << 60, r"at most")
    bad(F.Size(), "lots", r"a size like 512MB")
    F.check_value(F.Size(empty=True), "k", "")
    bad(F.Size(), "", r"a size like")


def test_host_port():
    F.check_value(F.HostPort(), "k", "node1:50051")
    for text in ("node1", ":80", "node1:0", "node1:65536", "node1:99999999999999", "n\n1:80", "n 1:80"):
        with pytest.raises(ConfigError):
            F.check_value(F.HostPort(), "k", text)


def test_choice_bool_list_mapping():
    F.check_value(F.Choice(("a", "b")), "k", "a")
    bad(F.Choice(("a", "b")), "c", r"must be one of \['a', 'b'\]")
    bad(F.Bool(), 1, r"true or false")
    bad(F.ListOf(F.Int(0)), [1, -1], r"^k\[1\] must be >= 0")
    bad(F.ListOf(F.Int(0), max_len=1), [1, 2], r"at most 1")
    bad(F.Mapping(), [1], r"must be a mapping")


def test_read_text(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes("héllo\n".encode())
    assert F.read_text(p, "x") == "héllo\n"
    p.write_bytes(b"ok\n\xff\n")
    with pytest.raises(
        ConfigError, match=r"^x: .*a\.txt is not UTF-8 text \(byte 0xff at line 2, offset 3\)$"
    ):
        F.read_text(p, "x")
    with pytest.raises(ConfigError, match=r"does not exist"):
        F.read_text(tmp_path / "none", "x")
    with pytest.raises(ConfigError, match=r"is a directory"):
        F.read_text(tmp_path, "x")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a: 1\na: 2\n", r"key 'a' is given twice \(lines 1 and 2\)"),
        ("s:\n  x: 1\n  y: 2\n  x: 3\n", r"key 'x' is given twice \(lines 2 and 4\)"),
    ],
)
def test_duplicate_yaml_keys(text, match):
    import yaml

    with pytest.raises(ConfigError, match=match):
        yaml.load(text, Loader=UniqueKeyLoader)


def test_yaml_merge_keys_and_distinct_keys_still_load():
    import yaml

    doc = "base: &b {x: 1, y: 2}\nover:\n  <<: *b\n  y: 3\n"
    assert yaml.load(doc, Loader=UniqueKeyLoader) == {"base": {"x": 1, "y": 2}, "over": {"x": 1, "y": 3}}
