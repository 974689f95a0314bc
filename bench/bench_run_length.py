"""A long run must not cost more per poll: the trainer's poll and ledger at 1k, 10k and 100k shards.

    python -m bench.bench_run_length [--sizes 1000,10000,100000] [--s3-sizes 1000,10000] [--rounds 5]

Each size is a run as a trainer sees it after writing a shard a second for that many seconds: the
shards in partitions of 100 (a policy version every 100 shards), each with its index entry (every
shard a hard link to one real shard on local disk, the same bytes uploaded on S3), and a
ShardReader whose ledger consumed all of them but the last 10 (the ones in flight). A poll is
`reader.new_shards()`: list what is new and filter it through the ledger, what the trainer does
between steps. Per size: the median poll over --polls polls, the ledger's JSON bytes (what every
checkpoint's STABLE carries), and, for reference, a full listing of the run (`find_shards`, the poll
before the index). Sizes take turns in each of --rounds rounds; the ratio of each size's poll to
1k's per round, with its 95% interval, and a second 1k run built apart from the first as the
control (how far from 1.0 this machine puts two identical sides). On a real S3 API server (moto,
on loopback) the LIST requests per poll are counted from the server's request log.

The reload watcher's poll (`latest_checkpoint`) is measured the same way over 100 and 10,000
published steps. Targets: poll at 100k within 2x of 1k, ledger < 64 KB at every size, LIST requests
per poll at 10k within 2x of 1k. Written to bench/results/run_length.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import fsspec

from bench.results import interval, write_result
from clotho.testing.groups import make_groups
from clotho.testing.s3_server import create_bucket, start_s3_server, stop_s3_server
from storage.checkpoints import STABLE, latest_checkpoint, step_name
from storage.index import GRACE_S, entry_path, id_at
from storage.layout import ShardLocation
from storage.ledger import Ledger
from storage.reader import ShardReader
from storage.shard_file import find_shards
from storage.writer import ShardWriter

REPO = Path(__file__).resolve().parents[1]

IN_FLIGHT = 10
LINKS_PER_TEMPLATE = 50_000
PER_VERSION = 100


def shard_ids(count: int, now: float) -> list[str]:
    """One shard a second, the newest made now."""
    return [f"{id_at(now - (count - i))}-{i:012x}" for i in range(count)]


def template_bytes(workdir: Path) -> bytes:
    with ShardWriter(f"file://{workdir}/template", "run", tokenizer="tok") as writer:
        writer.add_many(make_groups(2, seed=0))
    return next((workdir / "template").rglob("*.parquet")).read_bytes()


def build_local(run_dir: Path, count: int, data: bytes, now: float) -> list[str]:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    names = []
    for i, shard_id in enumerate(shard_ids(count, now)):
        if i % LINKS_PER_TEMPLATE == 0:  # a file system allows ~65k hard links to one file
            template = run_dir.parent / f"{run_dir.name}.template-{i}.parquet"
            template.write_bytes(data)
        location = ShardLocation("bench", i // PER_VERSION, shard_id)
        path = run_dir / "rollouts" / location.name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.link(template, path)
        entry = Path(entry_path(str(run_dir), location))
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.touch()
        names.append(location.name)
    (run_dir / "_index" / "complete").touch()
    return names


def build_s3(root: str, run: str, count: int, data: bytes, now: float) -> list[str]:
    fs, run_path = fsspec.core.url_to_fs(f"{root}/{run}")
    files, names = {}, []
    for i, shard_id in enumerate(shard_ids(count, now)):
        location = ShardLocation("bench", i // PER_VERSION, shard_id)
        files[f"{run_path}/rollouts/{location.name}"] = data
        files[entry_path(run_path, location)] = b""
        names.append(location.name)
    files[f"{run_path}/_index/complete"] = b""
    items = list(files.items())
    for start in range(0, len(items), 2000):
        fs.pipe(dict(items[start : start + 2000]))
    return names


def caught_up_reader(root: str, run: str, names: list[str]) -> ShardReader:
    """A reader whose ledger consumed every shard but the last IN_FLIGHT, after its first poll."""
    ledger = Ledger()
    for name in names[:-IN_FLIGHT]:
        ledger.mark_consumed(name)
    reader = ShardReader(root, run, ledger=ledger)
    assert len(reader.new_shards()) == IN_FLIGHT  # the first poll after a resume folds the ledger in
    return reader


def median_poll(reader: ShardReader, polls: int, in_flight: int = IN_FLIGHT) -> float:
    times = []
    for _ in range(polls):
        started = time.perf_counter()
        found = reader.new_shards()
        times.append(time.perf_counter() - started)
        assert len(found) == in_flight
    return statistics.median(times)


def build_checkpoints(run_dir: Path, steps: int) -> None:
    checkpoints = run_dir / "checkpoints"
    for step in range(1, steps + 1):
        directory = checkpoints / step_name(step)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        (directory / STABLE).write_text(json.dumps({"step": step, "files": {"config.json": 2}}))
    (checkpoints / "LATEST").write_text(step_name(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--s3-sizes", default="1000,10000", help="sizes on the S3 server ('' for none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--polls", type=int, default=20)
    parser.add_argument("--checkpoint-steps", default="100,10000")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    workdir = Path(tempfile.mkdtemp(prefix="clotho-bench-run-length-"))
    data = template_bytes(workdir)
    now = time.time() - 1.0
    result: dict = {"grace_s": GRACE_S, "shards_per_second": 1, "in_flight": IN_FLIGHT, "local": {}}
    try:
        # Local disk: the sizes and the control, each built once, polled in turns every round.
        sides = {f"{size}": size for size in sizes} | {"control_1000": sizes[0]}
        readers, ledger_bytes = {}, {}
        for side, size in sides.items():
            started = time.perf_counter()
            names = build_local(workdir / side / "run", size, data, now)
            readers[side] = caught_up_reader(f"file://{workdir / side}", "run", names)
            ledger_bytes[side] = len(readers[side].ledger.to_json())
            started_full = time.perf_counter()
            find_shards(f"file://{workdir / side}/run")
            full = time.perf_counter() - started_full
            result["local"][side] = {
                "shards": size,
                "ledger_bytes": ledger_bytes[side],
                "full_listing_s": round(full, 4),
                "build_s": round(started_full - started, 1),
            }
            print(f"built {side}: {size} shards, ledger {ledger_bytes[side]} B, full listing {full:.3f} s", flush=True)
        rounds = []
        for index in range(args.rounds):
            order = list(sides)[index % len(sides) :] + list(sides)[: index % len(sides)]
            rounds.append({side: median_poll(readers[side], args.polls) for side in order})
            print(json.dumps({side: round(v * 1e3, 3) for side, v in rounds[-1].items()}) + " ms", flush=True)
        base = str(sizes[0])
        for side in sides:
            per_round = [r[side] / r[base] for r in rounds]
            result["local"][side]["poll_s_median"] = round(statistics.median(r[side] for r in rounds), 6)
            if side != base:
                result["local"][side]["ratio_poll_to_1000"] = round(statistics.fmean(per_round), 3)
                result["local"][side]["ratio_poll_to_1000_interval"] = interval(per_round)
        for side, reader in readers.items():  # caught up: everything consumed, the watermark at now - grace
            for shard in reader.new_shards():
                reader.ledger.mark_consumed(shard.name)
            reader.new_shards()
            ledger_bytes[f"{side}_all_consumed"] = result["local"][side]["ledger_bytes_all_consumed"] = len(
                reader.ledger.to_json()
            )
        result["ledger_bytes_max"] = max(ledger_bytes.values())

        # The reload watcher's poll over many published steps.
        watcher = {}
        for steps in [int(s) for s in args.checkpoint_steps.split(",") if s]:
            build_checkpoints(workdir / f"steps-{steps}" / "run", steps)
            times = []
            for _ in range(args.polls):
                started = time.perf_counter()
                assert latest_checkpoint(f"file://{workdir / f'steps-{steps}'}", "run").step == steps
                times.append(time.perf_counter() - started)
            watcher[str(steps)] = round(statistics.median(times), 6)
        result["latest_checkpoint_s"] = watcher

        # S3: LIST requests per poll, counted by the server.
        s3_sizes = [int(s) for s in args.s3_sizes.split(",") if s]
        if s3_sizes:
            server = start_s3_server()
            os.environ.update(server.environment)
            try:
                create_bucket(server, "bench")
                result["s3"] = {}
                for size in s3_sizes:
                    started = time.perf_counter()
                    names = build_s3("s3://bench", f"run-{size}", size, data, now)
                    reader = caught_up_reader("s3://bench", f"run-{size}", names)
                    before = server.log_path.read_text().count("list-type=2")
                    poll_s = median_poll(reader, args.polls)
                    lists = (server.log_path.read_text().count("list-type=2") - before) / args.polls
                    result["s3"][str(size)] = {
                        "shards": size,
                        "list_requests_per_poll": lists,
                        "poll_s_median": round(poll_s, 4),
                        "ledger_bytes": len(reader.ledger.to_json()),
                        "build_s": round(time.perf_counter() - started, 1),
                    }
                    print(f"s3 {size}: {lists} LIST requests per poll, {poll_s * 1e3:.1f} ms", flush=True)
                first, last = (result["s3"][str(s)]["list_requests_per_poll"] for s in (s3_sizes[0], s3_sizes[-1]))
                result["s3"]["ratio_list_requests"] = round(last / first, 3)
            finally:
                stop_s3_server(server)
        result["targets"] = {
            "ratio_poll_100000_to_1000": "<= 2",
            "ledger_bytes_max": "< 65536",
            "s3_ratio_list_requests_10000_to_1000": "<= 2",
        }
        print(json.dumps(result, indent=1))
        write_result("run_length", result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
