"""Typed config of the training section (`training.*`).

Imports nothing heavy: the recipe loader reads it on machines without torch.distributed set up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hpctoolkit.config.fields import (
    SEED_MAX,
    Bool,
    Choice,
    Float,
    Int,
    Kind,
    ListOf,
    Seconds,
    Size,
    check_fields,
    require,
)


@dataclass
class TrainingConfig:
    steps: int = 100
    # Samples per data-parallel rank per optimizer step.
    batch_size: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    grad_clip: float = 1.0
    # DSpark supervises whole blocks; shorter samples are zero-weighted (not dropped).
    min_loss_tokens: int = 14
    # Trainer processes (GPUs on a cluster, gloo processes on CPU).
    world_size: int = 1
    fsdp_mode: str = "full_shard"  # "full_shard" | "replicate"
    device: str = "cpu"  # "cpu" | "cuda"
    # "bf16" | "fp32" (parameters; master weights stay fp32) | "auto" (`config/precision.py`)
    mixed_precision: str = "fp32"
    # Eagle3 test-time-training unroll.
    ttt_length: int = 7
    # DFlash/DSpark anchors per sample (fixed, so attention shapes stay static).
    num_anchors: int = 8
    # Samples longer than this are cut to it; the cut count is logged, never silent.
    max_seq_len: int = 2048
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 1
    # Seconds between rank 0's progress lines (`[hpctoolkit.trainer] step ...`) and records
    # (`progress/trainer.json`); the last step is always reported.
    progress_every_s: float = 10.0
    seed: int = 0
    # Passes over the published samples (hpctoolkit.plan.sizing.check_counts): 0 derives it from
    # steps x batch_size x world_size and data.num_samples. One pass reads the store only; more
    # spool each rank's first pass to the run directory and replay it, at most spool_max_size
    # (all ranks together; refused at load when the longest samples could pass it). In bytes: a
    # recipe writes `64GB` (`config.fields.Size`), parsed once at load.
    epochs: int = 0
    spool_max_size: int = 64 << 30
    # "live": read from the Mooncake store as the engine publishes; "offline": replay shards.
    data_source: str = "live"
    # What the hard-label losses (DFlash CE, DSpark's CE term) predict. "target": the target's
    # greedy token from its frozen lm_head (what speculative decoding is scored against; equal
    # to the data when the data was generated greedily by the target). "data": the captured
    # input_ids, as the DFlash paper trains on target-generated responses.
    label_source: str = "target"
    # Export the final draft to <out_dir>/export when training ends.
    export: bool = True
    # Decoder layers (the first N) whose activations are recomputed in backward instead of kept:
    # 0 keeps everything. Selective: at long context each layer holds several GiB of K/V-side
    # activations, so checkpoint just enough layers to fit (`benchmarks/train_k3_gpu.py`).
    activation_checkpoint_layers: int = 0
    # torch.compile each decoder layer: "auto" on CUDA only, "on" also on the CPU, "off" never.
    compile: str = "auto"
    # With compile: a batch pads to one of about this many lengths up to max_seq_len (multiples of
    # max_seq_len / compile_lengths, `batch.padded_length`), since compiled layers have static
    # shapes and torch runs a ninth length eager. More: less padding, more compilations early on.
    compile_lengths: int = 16
    # "mixed_adamw": one Triton kernel per tensor reads the bf16 gradient and writes the fp32
    # weight, the moments and the bf16 weight (`train/mixed_adamw.py`; one rank, bf16, CUDA).
    # "adamw": torch's AdamW (fused on CUDA). "auto": mixed_adamw where it can run, else adamw.
    # Both keep the same state, so a checkpoint resumes under either.
    optimizer: str = "auto"
    # Start draft decoder layer i from target layer init_layers_from_target[i] (the weights the
    # two share by name and shape: attention projections, MLP, layer norms) and the draft's final
    # norm from the target's; [] keeps the fresh init. A small draft trained briefly learns from
    # a language model's layer much faster than from noise.
    init_layers_from_target: list[int] = field(default_factory=list)

    KINDS: ClassVar[dict[str, Kind]] = {
        "steps": Int(1),
        "batch_size": Int(1, 1 << 20),
        "lr": Float(0.0, 1.0, lo_open=True),
        "weight_decay": Float(0.0, cap=1e3),
        "warmup_steps": Int(0),
        "grad_clip": Float(0.0, cap=1e9),
        "min_loss_tokens": Int(0),
        "world_size": Int(1, 1 << 20),
        "fsdp_mode": Choice(("full_shard", "replicate")),
        "device": Choice(("cpu", "cuda")),
        "mixed_precision": Choice(("auto", "bf16", "fp32")),
        "ttt_length": Int(1, 1024),
        "num_anchors": Int(1, 1 << 20),
        "max_seq_len": Int(1),
        "checkpoint_every": Int(1),
        "keep_checkpoints": Int(1, 1 << 20),
        "log_every": Int(1),
        "progress_every_s": Seconds(),
        "seed": Int(0, SEED_MAX),
        "epochs": Int(0, 1 << 20),
        "spool_max_size": Size(),
        "data_source": Choice(("live", "offline")),
        "label_source": Choice(("target", "data")),
        "export": Bool(),
        "activation_checkpoint_layers": Int(0, 10_000),
        "compile": Choice(("auto", "on", "off")),
        "compile_lengths": Int(1, 4096),
        "optimizer": Choice(("auto", "adamw", "mixed_adamw")),
        "init_layers_from_target": ListOf(Int(0, 10_000)),
    }

    def validate(self) -> None:
        check_fields(self)
        if self.optimizer == "mixed_adamw":  # one rank's bf16 optimizer, a Triton kernel
            for ok, why in (
                (self.device == "cuda", "runs on CUDA only (training.device: cuda)"),
                (self.world_size == 1, "is one rank's optimizer (training.world_size: 1)"),
                (self.mixed_precision != "fp32", "needs training.mixed_precision: bf16"),
            ):
                require(ok, "optimizer", f"mixed_adamw {why}", self.optimizer)
        bad = [i for i in self.init_layers_from_target if not isinstance(i, int) or i < 0]
        require(not bad, "init_layers_from_target", "must list target layer indices (ints >= 0)", bad)
        require(
            self.warmup_steps <= self.steps,
            "warmup_steps",
            f"must be <= steps={self.steps}",
            self.warmup_steps,
        )
