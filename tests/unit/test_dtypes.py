"""`hpctoolkit.dtypes`: the one table of dtype names, torch dtypes and safetensors codes."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from hpctoolkit import dtypes
from hpctoolkit.capture.manifest import DTYPE_BYTES
from hpctoolkit.errors import ConfigError


@pytest.mark.parametrize("name", dtypes.NAMES)
def test_names_round_trip_and_agree_with_the_manifests_sizes(name):
    t = dtypes.torch_dtype(name)
    assert dtypes.dtype_name(t) == name == str(t).removeprefix("torch.")
    assert torch.empty((), dtype=t).element_size() == DTYPE_BYTES[name]


def test_the_manifest_spells_no_name_the_table_lacks():
    assert set(DTYPE_BYTES) == set(dtypes.NAMES)
    assert set(dtypes.WEIGHT_DTYPES) <= set(dtypes.NAMES)


def test_safetensors_codes_are_the_ones_safetensors_writes(tmp_path):
    from safetensors.torch import save_file

    tensors = {name: torch.zeros(1, dtype=dtypes.torch_dtype(name)) for name in dtypes.NAMES}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    raw = (tmp_path / "t.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for name in dtypes.NAMES:
        assert header[name]["dtype"] == dtypes.safetensors_code(dtypes.torch_dtype(name)), name


def test_an_unknown_name_or_dtype_is_one_line():
    with pytest.raises(ConfigError, match=r"^dtype 'fp8' is not one of \["):
        dtypes.torch_dtype("fp8")
    with pytest.raises(ConfigError, match="no safetensors code"):
        dtypes.safetensors_code(torch.complex64)
