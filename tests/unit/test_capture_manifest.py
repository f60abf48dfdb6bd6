"""The manifest contract: self-describing, JSON-only, and strict about what it accepts."""

from __future__ import annotations

import json

import pytest

from hpctoolkit.capture import Manifest, build_manifest, fragment_key, input_ids_key, sanitize_key
from hpctoolkit.errors import DataIntegrityError


def _m(pp=3, **kw):
    return build_manifest("run0-req7", [1, 3, 5, 6], 10, 128, 6, pp, "bfloat16", **kw)


def test_roundtrip_and_json_only():
    m = _m()
    text = m.to_json()
    assert Manifest.from_json(text) == m

    # JSON-native all the way down: nothing that could be a tensor.
    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        else:
            assert x is None or isinstance(x, (str, int, float, bool)), type(x)

    walk(json.loads(text))


def test_fragments_name_stage_shape_dtype_and_one_input_ids():
    m = _m()
    assert [f.key for f in m.fragments] == [fragment_key("run0-req7", k) for k in (1, 3, 5, 6)]
    assert [f.stage for f in m.fragments] == [0, 1, 2, 2]
    assert [f.role for f in m.fragments] == ["aux", "aux", "aux", "last_hidden_states"]
    assert all(f.shape == (10, 128) and f.dtype == "bfloat16" for f in m.fragments)
    assert m.input_ids.key == input_ids_key("run0-req7")
    assert m.input_ids.shape == (10,) and m.input_ids.dtype == "int64" and m.input_ids.stage == 0
    assert sum(1 for f in m.all_objects if f.role == "input_ids") == 1
    assert m.nbytes == 10 * 8 + 4 * 10 * 128 * 2
    assert {f.key for f in m.fragments_of_stage(2)} == {
        "run0-req7_layer5",
        "run0-req7_layer6",
        "run0-req7_sums2",
    }
    # One sums object per stage, 8 bytes per object the stage publishes (input_ids on stage 0).
    assert [(f.key, f.stage, f.shape, f.dtype) for f in m.sums] == [
        ("run0-req7_sums0", 0, (16,), "uint8"),
        ("run0-req7_sums1", 1, (8,), "uint8"),
        ("run0-req7_sums2", 2, (16,), "uint8"),
    ]
    assert [f.key for f in m.summed(0)] == ["run0-req7_input_ids", "run0-req7_layer1"]


def test_pp1_is_the_same_layout():
    m = _m(pp=1)
    assert [f.stage for f in m.fragments] == [0, 0, 0, 0]
    assert [f.key for f in m.fragments] == [f.key for f in _m().fragments]


def _corrupt(path, value):
    d = _m().to_dict()
    node = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return d


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("schema_version",), 99, "schema_version"),
        (("num_tokens",), 0, "num_tokens"),
        (("fragments", 1, "stage"), 0, "fragments[1]"),
        (("fragments", 0, "shape"), [9, 128], "fragments[0]"),
        (("fragments", 0, "dtype"), "int64", "fragments[0]"),
        (("fragments", 3, "role"), "aux", "fragments[3]"),
        (("fragments", 2, "key"), "other_layer5", "fragments[2]"),
        (("fragments", 1, "layer_id"), None, "fragments[1]"),
        (("input_ids", "shape"), [11], "input_ids"),
        (("input_ids", "stage"), 1, "input_ids"),
        (("partition",), [1, 1, 1], "partition"),
    ],
)
def test_inconsistent_manifest_names_sample_and_field(path, value, field):
    with pytest.raises(DataIntegrityError) as info:
        Manifest.from_dict(_corrupt(path, value))
    assert "run0-req7" in str(info.value)
    assert repr(field) in str(info.value)


def test_missing_field_and_bad_json():
    d = _m().to_dict()
    del d["fragments"]
    with pytest.raises(DataIntegrityError, match="'fragments' is missing"):
        Manifest.from_dict(d)
    with pytest.raises(DataIntegrityError, match="not valid JSON"):
        Manifest.from_json("{nope")


def test_reordered_fragments_rejected():
    d = _m().to_dict()
    d["fragments"][0], d["fragments"][1] = d["fragments"][1], d["fragments"][0]
    with pytest.raises(DataIntegrityError, match="not strictly ascending"):
        Manifest.from_dict(d)


def test_sanitize_key():
    assert sanitize_key("cmpl-abc_1.2") == "cmpl-abc_1.2"
    a, b = sanitize_key("req/1 a"), sanitize_key("req/1:a")
    assert a != b
    assert all(c.isalnum() or c in "._-" for c in a + b)
    assert len(sanitize_key("x" * 1000)) <= 200


def test_loss_mask_object_is_named_with_shape_and_dtype_and_roundtrips():
    from hpctoolkit.capture.manifest import with_loss_mask

    m = with_loss_mask(build_manifest("k", [1, 3, 4], 10, 8, 4, 2, "bfloat16"), "xxh3_64:00")
    assert m.loss_mask is not None and m.loss_mask.digest == "xxh3_64:00"
    assert (m.loss_mask.key, m.loss_mask.role, m.loss_mask.shape, m.loss_mask.dtype, m.loss_mask.stage) == (
        "k_loss_mask",
        "loss_mask",
        (10,),
        "uint8",
        0,
    )
    assert (
        m.data_objects[-1] == m.loss_mask
        and m.nbytes == build_manifest("k", [1, 3, 4], 10, 8, 4, 2, "bfloat16").nbytes + 10
    )
    assert Manifest.from_json(m.to_json()) == m
    plain = build_manifest("k", [1, 3, 4], 10, 8, 4, 2, "bfloat16")
    assert plain.loss_mask is None and Manifest.from_json(plain.to_json()).loss_mask is None


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("shape", [9], "uint8 of shape"),
        ("dtype", "int64", "uint8 of shape"),
        ("key", "x_loss_mask", "key 'k_loss_mask'"),
    ],
)
def test_malformed_loss_mask_names_the_field(field, value, match):
    from hpctoolkit.capture.manifest import with_loss_mask

    d = with_loss_mask(build_manifest("k", [1, 3, 4], 10, 8, 4, 2, "bfloat16"), "xxh3_64:00").to_dict()
    d["loss_mask"][field] = value
    with pytest.raises(DataIntegrityError, match=rf"sample 'k'.*'loss_mask'.*{match}"):
        Manifest.from_dict(d)


def test_every_object_of_a_schema_2_manifest_is_covered_by_a_checksum():
    from hpctoolkit.capture.manifest import with_loss_mask

    d = build_manifest("k", [1, 3, 4], 10, 8, 4, 2, "bfloat16").to_dict()
    assert d["schema_version"] == 2 and [f["key"] for f in d["sums"]] == ["k_sums0", "k_sums1"]
    assert "digest" not in d["input_ids"]  # a field only where a writer knew the bytes
    with pytest.raises(DataIntegrityError, match=r"'sums' must name \['k_sums0', 'k_sums1'\]"):
        Manifest.from_dict({**d, "sums": d["sums"][:1]})
    with pytest.raises(
        DataIntegrityError, match=r"'sums' is empty, and object 'k_input_ids' carries no digest"
    ):
        Manifest.from_dict({**d, "sums": []})
    masked = with_loss_mask(build_manifest("k", [1, 3, 4], 10, 8, 4, 2, "bfloat16"), "xxh3_64:00").to_dict()
    del masked["loss_mask"]["digest"]
    with pytest.raises(DataIntegrityError, match=r"'loss_mask' carries no digest"):
        Manifest.from_dict(masked)


def test_a_schema_1_manifest_without_checksums_is_still_read():
    """Written before 2026-12-04: no sums, no digests. Read with sizes checked only (a spool of
    that time can be replayed); a schema-1 manifest naming sums is malformed."""
    d = build_manifest("k", [1, 3, 4], 10, 8, 4, 2, "bfloat16").to_dict()
    old = {**d, "schema_version": 1}
    del old["sums"], old["sums_algorithm"]
    m = Manifest.from_dict(old)
    assert m.schema_version == 1 and m.sums == () and m.to_dict() == old
    with pytest.raises(DataIntegrityError, match="'sums' is not part of schema 1"):
        Manifest.from_dict({**d, "schema_version": 1})
