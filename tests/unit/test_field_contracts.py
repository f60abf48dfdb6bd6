"""Every field of a kind gets its kind's bounds, through the real entry point (issue 44, item 1).

The four late failures of 2026-12-07 (a size that overflowed a conversion, a layer index past the
target's depth accepted by `--dry-run`, `--render-sbatch` on a local recipe, a run name that
cannot be a directory) are fixed in the contracts, not case by case: this file walks the schema
and probes each field of a kind with what its kind refuses, through `python -m hpctoolkit.submit
RECIPE ... --dry-run`. Each must exit 2 with one line naming the field and what it accepts, so a
field added later is probed too. test_bad_input.py keeps one probe per kind as a user met it.
"""

from __future__ import annotations

import sys
import typing

import pytest
import yaml
from submit_helpers import DRAFT, TINY, base, fails

from hpctoolkit.cli import run_cli
from hpctoolkit.config import fields as F
from hpctoolkit.recipe.load import DIGITS_MAX
from hpctoolkit.recipe.schema import LAYER_FIELDS, RUN_FILES_ROOM, RUN_ID_SUFFIX, RecipeConfig
from hpctoolkit.rundir.layout import local_run_id, slurm_run_id
from hpctoolkit.submit import FLAG_BACKENDS, main

FLOAT_MAX = f"{sys.float_info.max:.4g}"


def _walk(cls: type, prefix: str = "") -> list[tuple[str, F.Kind]]:
    """(dotted key, kind) of every field reachable through nested sections (lists of them aside)."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, F.Kind]] = []
    for name, kind in F.kinds_of(cls).items():
        if isinstance(kind, F.Nested):
            out += _walk(hints[name], f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", kind))
    return out


FIELDS = _walk(RecipeConfig)
KINDS = dict(FIELDS)


def keys_of(*kinds: type) -> list[str]:
    return [key for key, kind in FIELDS if type(kind) in kinds]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTOOLKIT_CACHE", str(tmp_path / "cache"))


def test_the_walk_finds_each_kind():
    assert len(keys_of(F.Size)) >= 4 and len(keys_of(F.Float)) >= 15
    assert {"name", "paths.output_dir", "data.magpie.seed", "engine.extra_args"} <= set(KINDS)


# --- sizes and counts: bounded to what the code can represent --------------------------------


@pytest.mark.parametrize("key", keys_of(F.Size))
def test_every_size_too_large_to_hold(capsys, tmp_path, key):
    # 400 digits: float() made inf of them and int(inf) raised OverflowError, late.
    line = fails(capsys, [*base(tmp_path), f"{key}={'9' * 400}MB"])
    assert line.startswith(f"{key} must be at most {F.SIZE_MAX} bytes (1 PiB), got '9999")


def test_sizes_are_parsed_exactly():
    assert F.parse_size("1.5GB", "k") == 3 << 29
    assert F.parse_size("0001.25KiB", "k") == 1280
    assert F.parse_size("1." + "0" * 5000 + "1GB", "k") == 1 << 30  # no float, no int() limit
    with pytest.raises(F.ConfigError, match=r"^k must be at most 1125899906842624 bytes"):
        F.parse_size("9" * 5000, "k")


@pytest.mark.parametrize("key", keys_of(F.Float))
def test_every_float_given_an_integer_past_a_float(capsys, tmp_path, key):
    # OmegaConf converts a float field's value with float(): OverflowError, late, before this fix.
    line = fails(capsys, [*base(tmp_path), f"{key}={'9' * 400}"])
    assert line.startswith(f"{key} must be a finite number (at most {FLOAT_MAX}), got 9999")


@pytest.mark.parametrize("key", keys_of(F.Int, F.Port))
def test_every_count_past_its_bound(capsys, tmp_path, key):
    hi = KINDS[key].hi if isinstance(KINDS[key], F.Int) else F.PORT_MAX
    assert fails(capsys, [*base(tmp_path), f"{key}={'9' * 400}"]).startswith(
        f"{key} must be <= {hi}, got 9999"
    )


@pytest.mark.parametrize("key", keys_of(F.Int, F.Port, F.Float, F.Size))
def test_every_number_longer_than_python_reads(capsys, tmp_path, key):
    # Past 4300 digits int() raises ValueError (inside OmegaConf's parser, before this fix).
    line = fails(capsys, [*base(tmp_path), f"{key}={'9' * (DIGITS_MAX + 1)}"])
    assert line == (
        f"{key} must be a number of at most {DIGITS_MAX} digits (no field takes more: a count is at "
        f"most 2147483647, a size 1 PiB), got one of {DIGITS_MAX + 1} digits"
    )


def test_a_long_number_in_the_recipe_file_names_its_key_and_line(capsys, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY.read_text().replace("  steps: 800", f"  steps: {'9' * (DIGITS_MAX + 1)}"))
    n = recipe.read_text().splitlines().index(f"  steps: {'9' * (DIGITS_MAX + 1)}") + 1
    line = fails(capsys, [str(recipe), f"paths.output_dir={tmp_path / 'out'}"])
    assert line.startswith(f"recipe {recipe}: training.steps (line {n}) must be a number of at most")


@pytest.mark.parametrize("key", keys_of(F.Mapping))
def test_every_free_mapping_holds_int64_integers(capsys, tmp_path, key):
    line = fails(capsys, [*base(tmp_path), f"{key}.x={2**63}"])
    assert line == f"{key}.x must be an integer an int64 holds (at most {2**63 - 1}), got {2**63}"


# --- names and paths: what the filesystem and Slurm accept -----------------------------------

STRING_KINDS = (F.Text, F.SlurmText, F.Path, F.Name, F.Network, F.HostPort)


def recipe_with(tmp_path, key: str, quoted: str) -> str:
    """tiny.yaml with `key` set to the YAML double-quoted scalar `quoted` (escapes kept)."""
    data = yaml.safe_load(TINY.read_text())
    data["paths"]["output_dir"] = str(tmp_path / "out")
    data["draft"]["config"] = str(DRAFT)
    *parents, last = key.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = "PLACEHOLDER"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data).replace("PLACEHOLDER", quoted))
    return str(path)


@pytest.mark.parametrize("key", keys_of(*STRING_KINDS))
def test_every_string_is_utf8(capsys, tmp_path, key):
    # A lone surrogate made UnicodeEncodeError where the string became a path or an argument.
    line = fails(capsys, [recipe_with(tmp_path, key, '"a\\ud800b"')])
    assert line == f"{key} must be UTF-8 text (found '\\ud800', a lone surrogate), got 'a\\ud800b'"


def test_an_override_that_is_not_utf8(capsys, tmp_path):
    # Python reads a byte of argv that is not UTF-8 as a surrogate: OmegaConf's parser raised.
    line = fails(capsys, [*base(tmp_path), "name=caf\udce9"])
    assert line == "name must be UTF-8 text (found byte 0xe9, not UTF-8), got 'caf\\udce9'"


@pytest.mark.parametrize("key", keys_of(F.Path))
def test_every_path_fits_the_filesystem(capsys, tmp_path, key):
    long = "d" * (F.NAME_MAX + 1)
    line = fails(capsys, [*base(tmp_path), f"{key}=/tmp/{long}/x"])
    assert line.startswith(
        f"{key} must name each directory and file in at most 255 bytes ('{'d' * 16}'... has 256)"
    )
    deep = "/".join(["d" * 200] * 21)  # 4220 bytes, each part short
    line = fails(capsys, [*base(tmp_path), f"{key}=/{deep}"])
    assert line.startswith(f"{key} must be at most {F.PATH_MAX - KINDS[key].room} bytes long")


def test_output_dir_leaves_room_for_the_run_and_no_slurm_pattern(capsys, tmp_path):
    most = F.PATH_MAX - RUN_FILES_ROOM
    deep = "/" + "/".join(["d" * 99] * (most // 100 + 1))
    assert fails(capsys, [*base(tmp_path), f"paths.output_dir={deep}"]).startswith(
        f"paths.output_dir must be at most {most} bytes long ({F.PATH_MAX} less {RUN_FILES_ROOM} "
        "for the run's files below it), got"
    )
    for bad in ("/runs/100%", "/runs/a\\b"):
        assert fails(capsys, [*base(tmp_path), f"paths.output_dir={bad}"]) == (
            "paths.output_dir must hold no % or \\ (it names the job's log in #SBATCH --output, "
            f"where Slurm expands them), got {bad!r}"
        )


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("a/b", "name must be one file name (no /), got 'a/b'"),
        ("..", "name must be one file name (no /), got '..'"),
        ("x" * 235, "name must be at most 234 bytes (a file name holds 255; the code appends 21), got 'xxx"),
        ("é" * 118, "name must be at most 234 bytes"),  # 236 bytes of UTF-8
    ],
)
def test_run_name_must_become_a_directory(capsys, tmp_path, value, line):
    assert fails(capsys, [*base(tmp_path), f"name={value}"]).startswith(line)


def test_the_longest_run_name_makes_a_directory(capsys, tmp_path):
    name = "x" * (F.NAME_MAX - RUN_ID_SUFFIX)
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*base(tmp_path), f"name={name}", "--dry-run"])
    assert done.value.code == 0, capsys.readouterr().err
    (tmp_path / local_run_id(name)).mkdir()  # the filesystem takes it


def test_run_id_suffix_is_what_the_layout_appends():
    assert len(local_run_id("n")) - 1 == RUN_ID_SUFFIX
    assert len(slurm_run_id("n", str(2**32 - 1))) - 1 <= RUN_ID_SUFFIX


# --- layer indices: against the resolved target's and draft's depth, --dry-run included ------


def test_every_field_that_names_layers_is_declared():
    # A new field naming layers must be in schema.LAYER_FIELDS, or a bad index is found late.
    named = {key for key, kind in FIELDS if "layer" in key.rsplit(".", 1)[-1]}
    assert named == set(LAYER_FIELDS)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "training.init_layers_from_target=[0,99]",
            "training.init_layers_from_target[1] must be a layer index of the target, 0..5 "
            "(builtin:tiny-qwen3 has 6 layers), got 99",
        ),
        (
            "training.init_layers_from_target=[0,1,2]",
            f"training.init_layers_from_target must list at most one entry per draft layer ({DRAFT} has 2), "
            "got [0, 1, 2]",
        ),
        (
            "training.activation_checkpoint_layers=3",
            f"training.activation_checkpoint_layers must be at most the draft's 2 layers ({DRAFT}), got 3",
        ),
        (
            "engine.target_layer_ids=[1,2,5]",
            "engine.target_layer_ids[2] must be a layer index of the target, 0..4 (builtin:tiny-qwen3 has "
            "6 layers; the last is captured separately as last_hidden_states), got 5",
        ),
    ],
)
def test_layer_fields_against_the_depths(capsys, tmp_path, override, line):
    assert fails(capsys, [*base(tmp_path), override]) == line


def test_layer_fields_within_the_depths_pass(capsys, tmp_path):
    ok = ["training.init_layers_from_target=[4,5]", "training.activation_checkpoint_layers=2"]
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*base(tmp_path), *ok, "--dry-run"])
    assert done.value.code == 0, capsys.readouterr().err


# --- flags: against the recipe's backend -----------------------------------------------------


@pytest.mark.parametrize("dest", sorted(FLAG_BACKENDS))
def test_every_flag_against_the_recipes_backend(capsys, tmp_path, dest):
    flag = "--" + dest.replace("_", "-")
    other = next(b for b in ("local", "slurm") if b not in FLAG_BACKENDS[dest])
    line = fails(capsys, [*base(tmp_path), f"cluster.backend={other}", flag], dry_run=False)
    assert line == (
        f"cluster.backend must be {' or '.join(FLAG_BACKENDS[dest])} for {flag}, got {other!r} "
        f"(in {TINY} or its overrides)"
    )
