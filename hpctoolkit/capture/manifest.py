"""The sample manifest: the contract between the engine that publishes fragments and the reader.

One sample is published as separate store objects, whatever the pipeline size:

* `<key>_layer<id>` for every capture id, shape `[num_tokens, hidden_size]`, written by the stage
  that owns that id (`layout.stage_of`);
* `<key>_input_ids`, shape `[num_tokens]`, int64, written once, by stage 0;
* `<key>_loss_mask`, shape `[num_tokens]`, uint8 (1 where the token is supervised), optional:
  the engine leader publishes it beside the fragments and names it in `loss_mask` (None: the
  sample carries no mask and every token may be supervised).

* `<key>_sums<s>`, shape `[8 * n]`, uint8, one per stage `s` (schema 2): the checksums
  (`hpctoolkit.integrity.checksum`, 8 bytes each, little-endian) of the `n` objects stage `s` publishes, in
  manifest order (`Manifest.summed`), put by the stage with them in one batch. A stage computes
  them where its bytes are, after the manifest left the scheduler, so they travel as an object
  the manifest names rather than in the manifest itself. `sums_algorithm` names their checksum:
  `xxh3_64` (`hpctoolkit.integrity.checksum`, on the host) or `wmix64` (`hpctoolkit.integrity.devsum`, which a CUDA
  engine computes on its GPU before its copy to the host, and a CUDA trainer checks on its GPU).

The manifest names every object with its role, stage, shape and dtype, so a reader never guesses a
shape or a dtype. An object may also carry its own `digest` (`"<algorithm>:<hex>"`): the loss mask
(its publisher, the engine leader, writes the manifest the trainers read) and every object of a
sample saved to a shard (`data.offline`). A schema-2 manifest covers every object, by its own
digest or by its stage's sums; the reader checks them before a byte reaches a batch and refuses a
mismatch naming the key (`DataIntegrityError`). A schema-1 manifest (written before 2026-12-04, no
checksums) is still read, with sizes checked only, so a spool written then can be replayed. It
carries metadata only (JSON-native values, never a tensor) and travels from the engine to the
trainer in the request's `kv_transfer_params`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hpctoolkit.capture.layout import check_layer_layout, pp_partition, stage_of
from hpctoolkit.errors import ConfigError, DataIntegrityError

MANIFEST_SCHEMA_VERSION = 2
# Read, never written: manifests from before the checksums (sizes checked only).
UNSUMMED_SCHEMA_VERSION = 1
ROLE_AUX = "aux"
ROLE_LAST = "last_hidden_states"
ROLE_INPUT_IDS = "input_ids"
ROLE_LOSS_MASK = "loss_mask"
ROLE_SUMS = "sums"
DIGEST_BYTES = 8
# What a stage's sums object may hold (`Manifest.sums_algorithm`); the first is the default.
SUMS_ALGORITHMS = ("xxh3_64", "wmix64")
# Element sizes of the dtypes a fragment may carry; the names are torch's.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_KEY_LEN = 200


def sanitize_key(raw: str) -> str:
    """Map a request id to a store-safe sample key: `[A-Za-z0-9._-]`, bounded length.

    Characters outside the set become `_`; a digest suffix keeps distinct ids distinct after
    the mapping.
    """
    safe = _SAFE.sub("_", raw)
    if safe == raw and len(raw) <= MAX_KEY_LEN:
        return raw
    import hashlib

    digest = hashlib.sha1(raw.encode()).hexdigest()[:12]
    return f"{safe[: MAX_KEY_LEN - 13]}-{digest}"


def fragment_key(sample_key: str, layer_id: int) -> str:
    return f"{sample_key}_layer{layer_id}"


def input_ids_key(sample_key: str) -> str:
    return f"{sample_key}_input_ids"


def loss_mask_key(sample_key: str) -> str:
    return f"{sample_key}_loss_mask"


def sums_key(sample_key: str, stage: int) -> str:
    return f"{sample_key}_sums{stage}"


@dataclass(frozen=True)
class FragmentSpec:
    """One store object of a sample."""

    key: str
    role: str  # "aux" | "last_hidden_states" | "input_ids" | "loss_mask"
    stage: int
    shape: tuple[int, ...]
    dtype: str
    layer_id: int | None = None
    # `"<algorithm>:<hex>"` of the object's bytes, when its writer knew them (`hpctoolkit.integrity.checksum`).
    digest: str | None = None

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to fetch and reassemble one sample."""

    sample_key: str
    num_tokens: int
    hidden_size: int
    num_layers: int
    pp_size: int
    partition: tuple[int, ...]
    input_ids: FragmentSpec
    fragments: tuple[FragmentSpec, ...]
    schema_version: int = MANIFEST_SCHEMA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)
    loss_mask: FragmentSpec | None = None
    # One per stage (schema 2), stage order; empty when every object carries its own digest.
    sums: tuple[FragmentSpec, ...] = ()
    # The checksum the sums objects hold (`SUMS_ALGORITHMS`).
    sums_algorithm: str = SUMS_ALGORITHMS[0]

    @property
    def layer_ids(self) -> list[int]:
        """The capture id of each of `fragments`, in order; a fragment without one is malformed."""
        ids = []
        for i, f in enumerate(self.fragments):
            if f.layer_id is None:
                raise DataIntegrityError(
                    f"manifest of sample {self.sample_key!r}: field 'fragments[{i}]' has no layer_id"
                )
            ids.append(f.layer_id)
        return ids

    @property
    def aux(self) -> tuple[FragmentSpec, ...]:
        return tuple(f for f in self.fragments if f.role == ROLE_AUX)

    @property
    def last(self) -> FragmentSpec:
        return self.fragments[-1]

    @property
    def data_objects(self) -> tuple[FragmentSpec, ...]:
        """The sample's own objects, in buffer order (`data.sample`)."""
        mask = () if self.loss_mask is None else (self.loss_mask,)
        return (self.input_ids, *self.fragments, *mask)

    @property
    def all_objects(self) -> tuple[FragmentSpec, ...]:
        return (*self.data_objects, *self.sums)

    def summed(self, stage: int) -> tuple[FragmentSpec, ...]:
        """The objects stage `stage`'s sums object covers, in its order (the loss mask carries its
        own digest: the engine leader, not a stage, publishes it)."""
        return tuple(f for f in (self.input_ids, *self.fragments) if f.stage == stage)

    @property
    def nbytes(self) -> int:
        """The sample's bytes (its buffer, `data.sample`); the sums objects are not counted."""
        return sum(f.nbytes for f in self.data_objects)

    def fragments_of_stage(self, stage: int) -> tuple[FragmentSpec, ...]:
        return tuple(f for f in self.all_objects if f.stage == stage)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["partition"] = list(self.partition)
        d["extra"] = dict(self.extra)
        d["fragments"] = list(d["fragments"])
        d["sums"] = list(d["sums"])
        for f in [d["input_ids"], *d["fragments"], *([d["loss_mask"]] if d["loss_mask"] else []), *d["sums"]]:
            f["shape"] = list(f["shape"])
            if f["digest"] is None:
                del f["digest"]
        if self.schema_version == UNSUMMED_SCHEMA_VERSION:
            del d["sums"], d["sums_algorithm"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        """Parse and validate; a malformed manifest raises `DataIntegrityError` naming key and field."""
        key = d.get("sample_key", "<no sample_key>") if isinstance(d, Mapping) else "<not a mapping>"

        def bad(field_name: str, why: str) -> DataIntegrityError:
            return DataIntegrityError(f"manifest of sample {key!r}: field {field_name!r} {why}")

        if not isinstance(d, Mapping):
            raise bad("<root>", f"must be a mapping, got {type(d).__name__}")
        version = d.get("schema_version")
        if version not in (MANIFEST_SCHEMA_VERSION, UNSUMMED_SCHEMA_VERSION):
            raise bad("schema_version", f"is {version!r}, expected {MANIFEST_SCHEMA_VERSION}")
        required = ("sample_key", "num_tokens", "hidden_size", "num_layers", "pp_size", "partition")
        for name in (*required, "input_ids", "fragments"):
            if name not in d:
                raise bad(name, "is missing")
        for name in required[1:5]:
            if not isinstance(d[name], int) or isinstance(d[name], bool) or d[name] < 1:
                raise bad(name, f"must be a positive integer, got {d[name]!r}")

        def frag(raw: Any, where: str) -> FragmentSpec:
            if not isinstance(raw, Mapping):
                raise bad(where, "must be a mapping")
            try:
                return FragmentSpec(
                    key=str(raw["key"]),
                    role=str(raw["role"]),
                    stage=int(raw["stage"]),
                    shape=tuple(int(x) for x in raw["shape"]),
                    dtype=str(raw["dtype"]),
                    layer_id=None if raw.get("layer_id") is None else int(raw["layer_id"]),
                    digest=None if raw.get("digest") is None else str(raw["digest"]),
                )
            except (KeyError, TypeError, ValueError) as err:
                raise bad(where, f"is malformed ({err!r})") from err

        if not isinstance(d["fragments"], Sequence) or isinstance(d["fragments"], str):
            raise bad("fragments", "must be a list")
        sums = d.get("sums") or []
        if not isinstance(sums, Sequence) or isinstance(sums, str):
            raise bad("sums", "must be a list")
        m = cls(
            sample_key=str(d["sample_key"]),
            num_tokens=d["num_tokens"],
            hidden_size=d["hidden_size"],
            num_layers=d["num_layers"],
            pp_size=d["pp_size"],
            partition=tuple(int(x) for x in d["partition"]),
            input_ids=frag(d["input_ids"], "input_ids"),
            fragments=tuple(frag(f, f"fragments[{i}]") for i, f in enumerate(d["fragments"])),
            extra=dict(d.get("extra") or {}),
            loss_mask=None if d.get("loss_mask") is None else frag(d["loss_mask"], "loss_mask"),
            sums=tuple(frag(f, f"sums[{i}]") for i, f in enumerate(sums)),
            sums_algorithm=d.get("sums_algorithm", SUMS_ALGORITHMS[0]),
            schema_version=int(version),
        )
        m.validate()
        return m

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataIntegrityError(f"manifest is not valid JSON: {err}") from err
        return cls.from_dict(d)

    def validate(self) -> None:
        """Check internal consistency; raise `DataIntegrityError` naming the sample and field."""
        key = self.sample_key

        def bad(field_name: str, why: str) -> DataIntegrityError:
            return DataIntegrityError(f"manifest of sample {key!r}: field {field_name!r} {why}")

        if sanitize_key(key) != key:
            raise bad("sample_key", "contains characters outside [A-Za-z0-9._-]")
        layer_ids = self.layer_ids
        try:
            parts = pp_partition(self.num_layers, self.pp_size, list(self.partition))
            check_layer_layout(layer_ids, self.num_layers)
        except ConfigError as err:
            raise bad("fragments" if "capture" in str(err) else "partition", str(err)) from err
        ii = self.input_ids
        if ii.role != ROLE_INPUT_IDS or ii.key != input_ids_key(key):
            raise bad("input_ids", f"must be role 'input_ids' with key {input_ids_key(key)!r}")
        if ii.shape != (self.num_tokens,) or ii.dtype != "int64" or ii.stage != 0:
            raise bad("input_ids", f"must be int64 of shape [{self.num_tokens}] written by stage 0")
        for i, (f, layer_id) in enumerate(zip(self.fragments, layer_ids, strict=True)):
            where = f"fragments[{i}]"
            want_role = ROLE_LAST if i == len(self.fragments) - 1 else ROLE_AUX
            if f.role != want_role:
                raise bad(where, f"has role {f.role!r}, expected {want_role!r}")
            if f.key != fragment_key(key, layer_id):
                raise bad(where, f"has key {f.key!r}, expected {fragment_key(key, layer_id)!r}")
            if f.shape != (self.num_tokens, self.hidden_size):
                raise bad(
                    where, f"has shape {list(f.shape)}, expected [{self.num_tokens}, {self.hidden_size}]"
                )
            if f.dtype not in FLOAT_DTYPES:
                raise bad(where, f"has dtype {f.dtype!r}, expected a floating dtype")
            want_stage = stage_of(layer_id, self.num_layers, self.pp_size, parts)
            if f.stage != want_stage:
                raise bad(
                    where, f"says stage {f.stage} but capture id {layer_id} is owned by stage {want_stage}"
                )
        lm = self.loss_mask
        if lm is not None:
            if lm.role != ROLE_LOSS_MASK or lm.key != loss_mask_key(key):
                raise bad("loss_mask", f"must be role 'loss_mask' with key {loss_mask_key(key)!r}")
            if lm.shape != (self.num_tokens,) or lm.dtype != "uint8" or lm.stage != 0:
                raise bad("loss_mask", f"must be uint8 of shape [{self.num_tokens}] on stage 0")
        self._validate_sums(bad)

    def _validate_sums(self, bad: Any) -> None:
        """Schema 2: every object is covered by its own digest or its stage's sums object."""
        if self.schema_version == UNSUMMED_SCHEMA_VERSION:
            if self.sums:
                raise bad("sums", f"is not part of schema {UNSUMMED_SCHEMA_VERSION}")
            return
        if self.sums_algorithm not in SUMS_ALGORITHMS:
            raise bad(
                "sums_algorithm", f"is {self.sums_algorithm!r}, expected one of {list(SUMS_ALGORITHMS)}"
            )
        if self.sums:
            want = tuple(self.sums_spec(s) for s in range(self.pp_size))
            if tuple(dataclasses.replace(f, digest=None) for f in self.sums) != want:
                raise bad("sums", f"must name {[f.key for f in want]}, one uint8 object per stage")
        else:
            for f in (self.input_ids, *self.fragments):
                if f.digest is None:
                    raise bad("sums", f"is empty, and object {f.key!r} carries no digest")
        if self.loss_mask is not None and self.loss_mask.digest is None:
            raise bad("loss_mask", "carries no digest")

    def sums_spec(self, stage: int) -> FragmentSpec:
        """The sums object of `stage` (`summed(stage)`'s checksums)."""
        n = len(self.summed(stage))
        return FragmentSpec(sums_key(self.sample_key, stage), ROLE_SUMS, stage, (DIGEST_BYTES * n,), "uint8")


def build_manifest(
    sample_key: str,
    capture_ids: Sequence[int],
    num_tokens: int,
    hidden_size: int,
    num_layers: int,
    pp_size: int,
    dtype: str,
    partition: Sequence[int] | None = None,
    extra: Mapping[str, Any] | None = None,
    sums_algorithm: str = SUMS_ALGORITHMS[0],
) -> Manifest:
    """The manifest for one sample. The single place that lays out fragment keys and owners.
    `sums_algorithm`: what the stages' sums objects hold (`wmix64` where the engine runs on CUDA)."""
    parts = tuple(pp_partition(num_layers, pp_size, partition))
    frags = tuple(
        FragmentSpec(
            key=fragment_key(sample_key, k),
            role=ROLE_LAST if k == num_layers else ROLE_AUX,
            stage=stage_of(k, num_layers, pp_size, list(parts)),
            shape=(num_tokens, hidden_size),
            dtype=dtype,
            layer_id=k,
        )
        for k in capture_ids
    )
    ids = FragmentSpec(
        key=input_ids_key(sample_key), role=ROLE_INPUT_IDS, stage=0, shape=(num_tokens,), dtype="int64"
    )
    m = Manifest(
        sample_key=sample_key,
        num_tokens=num_tokens,
        hidden_size=hidden_size,
        num_layers=num_layers,
        pp_size=pp_size,
        partition=parts,
        input_ids=ids,
        fragments=frags,
        extra=dict(extra or {}),
        sums_algorithm=sums_algorithm,
    )
    m = dataclasses.replace(m, sums=tuple(m.sums_spec(s) for s in range(pp_size)))
    m.validate()
    return m


def with_loss_mask(manifest: Manifest, digest: str | None) -> Manifest:
    """`manifest` naming its sample's `<key>_loss_mask` object (published beside the fragments),
    with the checksum of its bytes (`hpctoolkit.integrity.checksum`; a schema-2 manifest needs one)."""
    spec = FragmentSpec(
        key=loss_mask_key(manifest.sample_key),
        role=ROLE_LOSS_MASK,
        stage=0,
        shape=(manifest.num_tokens,),
        dtype="uint8",
        digest=digest,
    )
    m = dataclasses.replace(manifest, loss_mask=spec)
    m.validate()
    return m
