"""Fixtures and helpers for the store and data tests, plus the writer processes they start.

Run as a script (`python tests/store_fixtures.py <role> <json>`) it is a writer process: it
publishes the fragments of given pipeline stages to a real master and keeps its segment alive (the
objects live in the writer's memory) until the test tells it to exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import importable  # noqa: E402

from hpctoolkit.capture.manifest import Manifest, build_manifest  # noqa: E402
from hpctoolkit.store import fragments  # noqa: E402
from hpctoolkit.store.config import StoreConfig  # noqa: E402

# Not installed (the GPU node has no engine extra): its tests skip, saying so. Installed but failing
# to import (a shared library missing, an error inside it): every module that imports this one fails
# to collect, with the error, rather than skip (`conftest.importable`).
HAVE_MOONCAKE = importable("mooncake.store")

needs_mooncake = pytest.mark.skipif(
    not HAVE_MOONCAKE, reason="mooncake (the 'engine' extra) is not installed"
)


def _hex_ip(hexip: str) -> str:
    if len(hexip) == 8:
        return ".".join(str(int(hexip[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return "::" if int(hexip, 16) == 0 else f"v6:{hexip}"


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket (IPv4 and IPv6) `pid` listens on, read from /proc (no
    ss/netstat needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                hexip, hexport = cols[1].split(":")
                out.add((_hex_ip(hexip), int(hexport, 16)))
    return out


def small_store_cfg(**kw: Any) -> StoreConfig:
    """Small segments so several clients fit on a 2-core, 24 GiB test machine."""
    base: dict[str, Any] = {
        "global_segment_size": 64 << 20,
        "local_buffer_size": 16 << 20,
        "kv_lease_ttl_s": 1.0,
        "get_retry_max_wait_seconds": 2.0,
        "connect_timeout_s": 5.0,
    }
    base.update(kw)
    return StoreConfig(**base)


def tensor_for(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic contents per object key, the same in every process."""
    g = torch.Generator().manual_seed(int(hashlib.sha256(key.encode()).hexdigest()[:8], 16))
    if dtype == torch.int64:
        return torch.randint(0, 500, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dtype)


def make_manifest(key: str, *, tokens: int = 16, hidden: int = 32, pp: int = 2, sha: bool = True) -> Manifest:
    ids = tensor_for(f"{key}_input_ids", (tokens,), torch.int64)
    extra = {fragments.INPUT_IDS_SHA256: fragments.input_ids_digest(ids)} if sha else {}
    return build_manifest(key, [1, 3, 4], tokens, hidden, 4, pp, "bfloat16", extra=extra)


def unsummed(m: Manifest) -> Manifest:
    """`m` as written before the checksums (schema 1: no sums objects, sizes checked only)."""
    import dataclasses

    from hpctoolkit.capture.manifest import UNSUMMED_SCHEMA_VERSION

    return dataclasses.replace(m, sums=(), schema_version=UNSUMMED_SCHEMA_VERSION)


def stage_payload(m: Manifest, stage: int) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    layers = {
        f.layer_id: tensor_for(f.key, f.shape, torch.bfloat16)
        for f in m.fragments
        if f.stage == stage  # type: ignore[misc]
    }
    ids = tensor_for(m.input_ids.key, m.input_ids.shape, torch.int64) if stage == 0 else None
    return layers, ids  # type: ignore[return-value]


def publish_all(store: Any, m: Manifest) -> int:
    return sum(fragments.publish_stage(store, m, s, *stage_payload(m, s)) for s in range(m.pp_size))


def assert_sample_matches(sample: Any, m: Manifest) -> None:
    assert torch.equal(sample.input_ids, tensor_for(m.input_ids.key, m.input_ids.shape, torch.int64))
    for i, f in enumerate(m.fragments):
        want = tensor_for(f.key, f.shape, torch.bfloat16)
        got = sample.aux_hidden_states[i] if i < len(m.fragments) - 1 else sample.last_hidden_states
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f.key  # bitwise


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real mooncake_master on 127.0.0.1 with automatic ports, shared by a test module."""
    from hpctoolkit.store.mooncake_master import launch_master

    m = launch_master(small_store_cfg(), tmp_path_factory.mktemp("master"))
    yield m
    m.stop()


# -- writer processes ---------------------------------------------------------------------------


class WriterProc:
    """A writer process started by a test; `release()` lets it exit, `result()` reads its report."""

    def __init__(self, workdir: Path, role: str, args: dict[str, Any]):
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        args = {**args, "dir": str(self.dir)}
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.log = open(self.dir / "writer.log", "wb")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, role, json.dumps(args)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_for(self, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        path = self.dir / name
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"writer exited with {self.proc.returncode}: {self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"writer did not report {name!r} within {timeout_s}s: {self.output()}")
            time.sleep(0.05)
        return json.loads(path.read_text() or "{}")

    def signal(self, name: str) -> None:
        (self.dir / name).write_text("{}")

    def output(self) -> str:
        self.log.flush()
        return (self.dir / "writer.log").read_text(errors="replace")[-3000:]

    def wait(self, timeout_s: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"writer did not exit within {timeout_s}s: {self.output()}") from None
        finally:
            self.log.close()


def _write(dirpath: Path, name: str, obj: Any) -> None:
    tmp = dirpath / f".{name}.tmp"
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, dirpath / name)


def _wait_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


def _writer_main(role: str, args: dict[str, Any]) -> None:
    from hpctoolkit.store.mooncake import MooncakeStore

    workdir = Path(args["dir"])
    cfg = small_store_cfg(**args.get("cfg", {}))
    store = MooncakeStore(args["address"], cfg, role="writer")
    manifests = [Manifest.from_dict(d) for d in args["manifests"]]
    t0 = time.monotonic()
    nbytes = 0
    for m in manifests:
        for stage in args["stages"]:
            nbytes += fragments.publish_stage(store, m, stage, *stage_payload(m, stage))
    _write(workdir, "published", {"bytes": nbytes, "seconds": time.monotonic() - t0})
    if role == "publish":
        # The objects live in this process's segment: stay until the reader is done.
        _wait_file(workdir / "release", args.get("hold_s", 120))
        store.close()
        return
    if role == "publish-after-kill":
        _wait_file(workdir / "killed", 60)
        late = Manifest.from_dict(args["late_manifest"])
        t1 = time.monotonic()
        try:
            fragments.publish_stage(store, late, 0, *stage_payload(late, 0))
            report = {"raised": False, "seconds": time.monotonic() - t1}
        except Exception as err:
            report = {
                "raised": True,
                "type": type(err).__name__,
                "error": str(err),
                "seconds": time.monotonic() - t1,
            }
        _write(workdir, "late", report)
        # The native client's teardown blocks for ~20 s once its master is gone; this process has
        # nothing left to flush.
        os._exit(0)
    raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    _writer_main(sys.argv[1], json.loads(sys.argv[2]))
