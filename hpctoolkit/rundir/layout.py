"""Where each file of a run lives. Pure path arithmetic (no I/O but `create` and `link_latest`).

Every run has its own directory, `<paths.output_dir>/<run id>`, so a new run never touches an
earlier one's results: a local run's id is `<recipe name>-<UTC time>-<4 hex>`, a Slurm job's
`<recipe name>-j<SLURM_JOB_ID>` (a requeued job keeps its id, so it finds its own files again).
`<paths.output_dir>/latest` is a symbolic link to the last run that finished with a summary.

Inside a run directory (every node of a Slurm job shares it):

    config.yaml                  the resolved recipe of this run (this attempt's)
    inputs.json                  the resolved recipe and the SHA-256 of every input it names, as the
                                 first attempt found them; every attempt and role checks them
                                 (`rundir.inputs_record`)
    master.json                  the Mooncake master's addresses (`roles.master`)
    manifests/engine<i>.jsonl    engine i's manifest queue, `.done` / `.failed` records
    manifests/drained            trainer rank 0: every rank read its share; engines may leave
    manifests/engine<i>.vocab.json   engine i's counts of its samples' supervised tokens, by id;
                                 manifests/draft_vocab.json: the pruned vocabulary a live run's
                                 trainers chose from them (`train.vocab_counts`)
    manifests/engine<i>.regenerated  engine i's generating engine is done ({"run_prefix"}): the
                                 followers of a multi-node engine then join its capture engine
    manifests/engine<i>.closed   engine i's leader released its store segment and left
    manifests/engine<i>.stale.jsonl  an earlier attempt's queue: its leader removes the fragments
                                 it lists from the store, then the file (`rundir.ledger`)
    attempt.json                 {"job_id", "restart", "resume_step"}: the attempt of the Slurm
                                 job these records belong to (`rundir.ledger.begin_attempt`)
    faults/engine<i>/            store errors the engine's workers recorded
    hosts/n<k>.json              node k's data-plane address, recorded by its roles
    ports/<listener>.json        a listener's address and the port its node picked at start
                                 (`trainers`, `engine<i>`, `engine<i>-generate`; `roles.ports`)
    hosts/n<k>.<pid>.probe       a role process's probe listener and its role (`roles.watch`)
    alive/<role>.json            a role process's record of itself: its heartbeat (mtime) and how
                                 it left (`rundir.alive`); faults/died.json: the role that died
    spool/rank<r>/, read-rank<r>.json   each trainer rank's replay copy and read record (`SpoolDir`)
    train/                       checkpoints/, tensorboard/, draft/, export/, train_summary.json,
                                 draft_vocab.json, acceptance_per_position.png,
                                 data_order/rank<r>.jsonl (each step's samples and prompts):
                                 `TrainDir`, also the layout of any `run.train` output directory
    train/checkpoints/step-N/ledger-rank<r>.json  the sample ledger: the prompts rank r trained
                                 on up to step N (`rundir.ledger`; complete with the checkpoint)
    evaluate.json                served vs simulated acceptance (the evaluate role)
    summary.json                 the run's summary (written last)
    summary.earlier.json         an earlier attempt's summary while a resumed attempt runs; its
                                 figures are carried into the new one (`rundir.summary`)
    progress/<role>.json         a role's progress while it runs (trainer rank 0: step, loss, rates,
                                 ETA; evaluate: questions done), rewritten at a steady interval
                                 (`rundir.progress`; read by `python -m hpctoolkit.status`)
    ended.json                   {"ok": bool, ...}: the trainers are done; once every engine
                                 is closed too, the master stops
    logs/<role>.log              each role's output (local backend; Slurm: its own log)
    logs/<role>.failure.json     {"error", "message", "said"}: how the role failed (local backend;
                                 `cli.run_cli` writes it, the launcher reads it)
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"


def local_run_id(name: str, now: float | None = None) -> str:
    """A fresh run id for a run started on this machine."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


def slurm_run_id(name: str, job_id: str) -> str:
    """The run id of Slurm job `job_id`: the same on every node and after a requeue."""
    return f"{name}-j{job_id}"


@dataclass(frozen=True)
class TrainDir:
    """The trainer's output directory: `RunDir.train` in a run, any directory given to `run.train`."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def data_order(self) -> Path:
        return self.root / "data_order"

    def order_log(self, rank: int) -> Path:
        """Rank r's log of each step's samples and prompts (what a resume is checked against)."""
        return self.data_order / f"rank{rank}.jsonl"

    @property
    def draft(self) -> Path:
        """The trained draft under our module names (`models.checkpoint.save_draft`)."""
        return self.root / "draft"

    @property
    def export(self) -> Path:
        """What vLLM serves (`models.export.export_draft`)."""
        return self.root / "export"

    @property
    def draft_vocab(self) -> Path:
        """The pruned Eagle3 vocabulary the trainers chose (`data.draft_vocab` reuses it)."""
        return self.root / "draft_vocab.json"

    @property
    def summary(self) -> Path:
        return self.root / "train_summary.json"

    @property
    def acceptance_plot(self) -> Path:
        return self.root / "acceptance_per_position.png"


@dataclass(frozen=True)
class SpoolDir:
    """A live run's trainer spool (`RunDir.spool`): each rank's replay shards and read record."""

    root: Path

    def shards(self, rank: int) -> Path:
        """Rank r's replay copy of its first pass (offline shards)."""
        return self.root / f"rank{rank}"

    def read_record(self, rank: int) -> Path:
        """Rank r's read record (`train.source.LiveSource`), which backpressure reads."""
        return self.root / f"read-rank{rank}.json"


@dataclass(frozen=True)
class RunDir:
    """One run's directory and the name of every file in it."""

    output_dir: Path
    run_id: str

    @classmethod
    def of(cls, output_dir: str | os.PathLike[str], run_id: str) -> RunDir:
        if not run_id or "/" in run_id or run_id in (".", "..", LATEST):
            raise ValueError(f"run id {run_id!r} cannot name a directory")
        return cls(Path(output_dir), run_id)

    @property
    def root(self) -> Path:
        return self.output_dir / self.run_id

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def inputs(self) -> Path:
        """The pinned recipe and inputs (`rundir.inputs_record`)."""
        return self.root / "inputs.json"

    @property
    def master_record(self) -> Path:
        return self.root / "master.json"

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    def queue(self, engine: int) -> Path:
        return self.manifests / f"engine{engine}.jsonl"

    def queue_done(self, engine: int) -> Path:
        return self.manifests / f"engine{engine}.done"

    def queue_failed(self, engine: int) -> Path:
        return self.manifests / f"engine{engine}.failed"

    def vocab_counts(self, engine: int) -> Path:
        """Engine i's counts of its samples' supervised tokens, written before it captures."""
        return self.manifests / f"engine{engine}.vocab.json"

    @property
    def engine_vocab(self) -> Path:
        """A live run's pruned Eagle3 vocabulary, chosen by the trainers from the engines' counts."""
        return self.manifests / "draft_vocab.json"

    def regenerated(self, engine: int) -> Path:
        """The leader's record that its generating engine is done (its followers then capture)."""
        return self.manifests / f"engine{engine}.regenerated"

    def engine_closed(self, engine: int) -> Path:
        return self.manifests / f"engine{engine}.closed"

    def stale_queue(self, engine: int) -> Path:
        return self.manifests / f"engine{engine}.stale.jsonl"

    @property
    def attempt(self) -> Path:
        return self.root / "attempt.json"

    @property
    def drained(self) -> Path:
        return self.manifests / "drained"

    def faults(self, engine: int) -> Path:
        return self.root / "faults" / f"engine{engine}"

    def host(self, node: int) -> Path:
        return self.root / "hosts" / f"n{node}.json"

    @property
    def ports(self) -> Path:
        return self.root / "ports"

    def port_record(self, listener: str) -> Path:
        """Where `listener` (`plan.ports`) records the address and port it listens on."""
        return self.ports / f"{listener}.json"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def spool_files(self) -> SpoolDir:
        return SpoolDir(self.spool)

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def train_files(self) -> TrainDir:
        return TrainDir(self.train)

    @property
    def checkpoints(self) -> Path:
        return self.train_files.checkpoints

    @property
    def export(self) -> Path:
        return self.train_files.export

    @property
    def evaluate(self) -> Path:
        return self.root / "evaluate.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def summary_earlier(self) -> Path:
        """An earlier attempt's summary while a resumed one runs (`rundir.summary`)."""
        return self.root / "summary.earlier.json"

    @property
    def ended(self) -> Path:
        return self.root / "ended.json"

    @property
    def progress_dir(self) -> Path:
        return self.root / "progress"

    def progress(self, role: str) -> Path:
        """A role's progress record (`rundir.progress`)."""
        return self.progress_dir / f"{role}.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def failure(self, name: str) -> Path:
        """Role process `name`'s failure record (`cli.run_cli` writes it when the launcher asks)."""
        return self.logs / f"{name}.failure.json"

    @property
    def latest(self) -> Path:
        return self.output_dir / LATEST

    def create(self) -> RunDir:
        """Make the run's directory; a run id already taken is refused (never reused)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.root.mkdir()
        return self

    def link_latest(self) -> None:
        """Point `<output_dir>/latest` at this run (atomically: a reader never sees no link)."""
        tmp = self.output_dir / f".{LATEST}.tmp-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.run_id, target_is_directory=True)
        os.replace(tmp, self.latest)
