"""Artifact fetch benchmark: a node fetching a model file from the console and from a peer,
against a plain copy of the same file on the same disk, in the same run.

    .venv/bin/python benchmarks/artifact_fetch_bench.py [--size-mb 2048]

Creates (or reuses) a scratch PostgreSQL database (`console_artifactbench` on the server of
DATABASE_URL), puts one artifact version holding a file of --size-mb in a blob store under a
scratch folder of var/, and starts the console under uvicorn (one worker) on a free port. Then:
the baseline, `shutil.copyfile` of the blob on the same disk (and the same copy followed by the
SHA-256 a node computes before use); node A staging the version from the console (HTTP, range
requests, verified); node B staging it from node A's peer server with no console reachable.
Each fetch includes the digest check every node makes before use. Prints seconds, MiB/s and each
ratio to the plain copy.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.dashboard_bench import database_url, ensure_database, setup_django  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(label: str, work, size: int, baseline: float | None = None) -> float:
    started = time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    ratio = f"  {seconds / baseline:5.2f}x the plain copy" if baseline else ""
    print(f"{label:<44} {seconds:7.2f} s  {size / seconds / 2**20:8.1f} MiB/s{ratio}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=2048)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="artifact-bench-", dir=ROOT / "var"))
    os.environ["ARTIFACT_STORE_ROOT"] = str(scratch / "store")
    url = database_url("console_artifactbench")
    ensure_database(url)
    setup_django(url)
    from serving_app.artifacts import peer, sources, staging
    from serving_app.models import Artifact, Node, NodeCacheEntry

    size = args.size_mb * 2**20
    source = scratch / "src" / "model.safetensors"
    source.parent.mkdir(parents=True)
    block = os.urandom(2**20)
    with source.open("wb") as out:
        for i in range(args.size_mb):
            out.write(hashlib.sha256(block + i.to_bytes(8, "little")).digest() + block[32:])
    Artifact.objects.filter(name="bench").delete()
    NodeCacheEntry.objects.all().delete()
    artifact = Artifact.objects.create(name="bench", kind="model")
    version = sources.import_console_folder(artifact, source.parent)
    blob = Path(os.environ["ARTIFACT_STORE_ROOT"]) / "sha256" / version.files.get().blob_id[:2] \
        / version.files.get().blob_id
    for name in ("bench-a", "bench-b"):
        Node.objects.update_or_create(name=name, defaults={"queue": f"node.{name}",
                                                           "cache_url": ""})
    port = free_port()
    env = {**os.environ, "DATABASE_URL": url, "LOG_LEVEL": "WARNING"}
    console = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "console.asgi:application", "--port", str(port),
         "--no-access-log", "--log-level", "warning"], cwd=ROOT, env=env)
    try:
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        print(f"one file of {args.size_mb} MiB, on {scratch}")
        copy = scratch / "copy"
        baseline = timed("plain copy (shutil.copyfile)", lambda: shutil.copyfile(blob, copy),
                         size)
        copy.unlink()
        timed("copy + SHA-256 of the copy", lambda: (shutil.copyfile(blob, copy), _hash(copy)),
              size, baseline)
        a = staging.NodeCacheConfig("bench-a", scratch / "cache-a", 4 * size,
                                    f"http://127.0.0.1:{port}")
        timed("node A from the console (HTTP, verified)",
              lambda: staging.stage_version(version, a), size, baseline)
        server = peer.PeerServer(a).start()
        try:
            b = staging.NodeCacheConfig("bench-b", scratch / "cache-b", 4 * size,
                                        "http://127.0.0.1:9")  # no console: the peer only
            timed("node B from node A's peer server (verified)",
                  lambda: staging.stage_version(version, b), size, baseline)
        finally:
            server.stop()
    finally:
        console.terminate()
        console.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)


def _hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


if __name__ == "__main__":
    main()
