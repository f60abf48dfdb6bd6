"""Capture layout and manifest: pure arithmetic, no torch, no vllm, no mooncake.

Conventions (vLLM's, kept everywhere in this package):

* A draft names target layers by **0-based layer index** (`target_layer_ids`, DFlash style): layer
  `i`'s output is wanted.
* The engine captures by **capture id**: id `k` is the residual stream *after* layer `k-1` ran, so
  `capture_id = layer_index + 1` (vLLM's "+1 shift"); id 0 would be the embeddings.
* The engine appends id `L` (the layer count) for `last_hidden_states`. vLLM takes it **before** the
  target's final norm; the trainer applies the target norm itself.
"""

from hpctoolkit.capture.layout import (
    capture_ids_for,
    check_every_stage_captures,
    check_layer_layout,
    owned_layers,
    pp_partition,
    pp_range,
    stage_of,
    stages_without_capture,
)
from hpctoolkit.capture.manifest import (
    MANIFEST_SCHEMA_VERSION,
    FragmentSpec,
    Manifest,
    build_manifest,
    fragment_key,
    input_ids_key,
    sanitize_key,
)

__all__ = [
    "MANIFEST_SCHEMA_VERSION",
    "FragmentSpec",
    "Manifest",
    "build_manifest",
    "capture_ids_for",
    "check_every_stage_captures",
    "check_layer_layout",
    "fragment_key",
    "input_ids_key",
    "owned_layers",
    "pp_partition",
    "pp_range",
    "sanitize_key",
    "stage_of",
    "stages_without_capture",
]
