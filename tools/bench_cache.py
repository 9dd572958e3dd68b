"""trainloom bench cache: warm-epoch samples/s of CachedDataset against raw py-lmdb and redis-py loops.

Three workloads, each read in a shuffled order in batches of 32:
  small    -- a tuple of two small numpy arrays (32 float32 + 8 int64);
  image    -- a 3x224x224 uint8 tensor and an int label;
  objects  -- annotation-style samples, as a detection dataset gives: a dict of a 3x32x32 uint8 array
              and a list of 50 Box dataclasses (4 float coordinates, an int label, a str); the codec
              pickles such a sample whole, once.

Measured side by side in one run, on the same values:
  CachedDataset (LMDB)      ds.__getitems__(batch): one read transaction per batch, decode, checksum
                            (large values' checksum+copy on torch.get_num_threads() threads)
  ..., 1 decode thread      the same with trainloom.data.codec.set_decode_threads(1)
  raw py-lmdb get           txn.get(key) per key (bytes copy, no decoding, value dropped at once)
  raw py-lmdb get, kept     the same, keeping the batch's 32 values alive (as a loader must)
  raw py-lmdb + pickle      objects only: txn.get(key) + pickle.loads per key of values stored as
                            pickle.dumps(sample, 5), one read transaction per batch (the usual
                            hand-written LMDB cache for such samples)
  CachedDataset (Redis)     one MGET per batch, decode, checksum
  raw redis-py pipeline     pipelined GETs per batch (bytes only)
  Redis 1 RTT/sample        client.get(key) + pickle.loads per sample (what Bagua's cache does)
  miss epoch                first epoch of a fresh CachedDataset (encode + write), LMDB
  DataLoader, 2 workers     batch 32, persistent workers: CachedDataset (LMDB) vs the uncached
                            in-memory dataset (objects: a collate_fn that stacks the arrays and
                            keeps the box lists, as detection loaders do)

Usage: trainloom bench cache [--quick] [--out DIR] [--no-redis] [--small N] [--images N] [--objects N]
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from benchutil import (
    bench_lock,
    machine_line,
    markdown_table,
    median,
    out_dir,
    positive_int,
    write_report,
)
from torch.utils.data import DataLoader, Dataset

from trainloom.data.cache import CachedDataset
from trainloom.data.codec import encode, set_decode_threads

BATCH = 32
BOXES = 50  # Box instances per objects sample


@dataclass
class Box:
    """One annotation of an objects sample (module level: pickled by name)."""

    x0: float
    y0: float
    x1: float
    y1: float
    label: int
    name: str


def collate_objects(batch):
    """A detection-style collate_fn: the arrays stacked into one tensor, the box lists kept as they are."""
    return torch.from_numpy(np.stack([s["image"] for s in batch])), [s["boxes"] for s in batch]


class MemDataset(Dataset):
    """The uncached dataset: samples already in memory."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def make_samples(kind: str, n: int):
    g = np.random.default_rng(0)
    if kind == "small":
        return [(g.random(32, dtype=np.float32), np.arange(i, i + 8, dtype=np.int64)) for i in range(n)]
    if kind == "objects":
        out = []
        for _ in range(n):
            xy = g.random((BOXES, 4)) * 24
            xy[:, 2:] = xy[:, :2] + xy[:, 2:] / 3  # x1 > x0, y1 > y0, inside the 32x32 image
            labels = g.integers(0, 80, BOXES)
            boxes = [
                Box(a, b, c, d, k, f"class_{k}") for (a, b, c, d), k in zip(xy.tolist(), labels.tolist())
            ]
            out.append({"image": g.integers(0, 255, (3, 32, 32), dtype=np.uint8), "boxes": boxes})
        return out
    return [(torch.from_numpy(g.integers(0, 255, (3, 224, 224), dtype=np.uint8)), i) for i in range(n)]


def batches(order):
    return [order[i : i + BATCH] for i in range(0, len(order), BATCH)]


def rate(fn, n: int, repeat: int) -> float:
    """Median samples/s of fn() processing n samples (one untimed warm-up call first)."""
    return interleaved({"x": fn}, n, repeat)["x"]


def interleaved(readers: dict, n: int, repeat: int) -> dict:
    """Median samples/s of each reader; rounds alternate between readers, so load that drifts during
    the run (other people's jobs on a shared machine) hits every reader alike."""
    for fn in readers.values():
        fn()  # warm-up
    times: dict = {name: [] for name in readers}
    for _ in range(repeat):
        for name, fn in readers.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: n / median(ts) for name, ts in times.items()}


def bench_kind(kind: str, n: int, repeat: int, tmp: Path, redis_hosts, rows: list, notes: list) -> dict:
    import lmdb

    samples = make_samples(kind, n)
    if kind == "objects":
        # The n * 50 Box objects held in memory (by the uncached dataset) would make every full garbage
        # collection slow, and those land on whichever reader happens to be running; a cache's user does
        # not hold them. Frozen, they are never traversed (gc.unfreeze() at the end).
        gc.collect()
        gc.freeze()
    order = np.random.default_rng(1).permutation(n).tolist()
    bs = batches(order)
    out = {}

    # Miss epoch: fresh cache, every sample encoded and written.
    def miss():
        path = tmp / f"miss-{kind}-{time.monotonic_ns()}"
        ds = CachedDataset(MemDataset(samples), path=path, dataset_name=kind)
        for b in bs:
            ds.__getitems__(b)
        ds.close()
        shutil.rmtree(path, ignore_errors=True)

    out["miss epoch (LMDB)"] = rate(miss, n, max(1, repeat // 2))

    ds = CachedDataset(MemDataset(samples), path=tmp / "lmdb", dataset_name=kind)
    ds.warmup(progress=False, batch_size=256)
    readers = {}

    def cached():
        for b in bs:
            ds.__getitems__(b)

    readers["CachedDataset (LMDB)"] = cached

    def cached_one_thread():  # batches decoded on the calling thread only (set_decode_threads(1))
        old = set_decode_threads(1)
        try:
            cached()
        finally:
            set_decode_threads(old)

    readers["CachedDataset (LMDB), 1 decode thread"] = cached_one_thread

    # Raw py-lmdb on the same encoded values, one read transaction per batch, bytes copied out.
    env = lmdb.open(str(tmp / f"raw-{kind}"), map_size=1 << 34, readahead=False, sync=False)
    keys = [f"{kind}_{i}".encode() for i in range(n)]
    values = [encode(s) for s in samples]
    with env.begin(write=True) as t:
        for k, v in zip(keys, values):
            t.put(k, v)
    kb = [[keys[i] for i in b] for b in bs]

    def raw_lmdb():
        for b in kb:
            with env.begin() as t:
                for k in b:
                    t.get(k)

    readers["raw py-lmdb get"] = raw_lmdb

    def raw_lmdb_kept():  # the batch is kept until the next one, as a data loader must
        for b in kb:
            with env.begin() as t:
                batch = [t.get(k) for k in b]
        return batch

    readers["raw py-lmdb get, batch kept"] = raw_lmdb_kept

    if kind == "objects":
        got = ds.__getitems__([0])[0]  # the cache gives the samples back (not only bytes)
        assert got["boxes"] == samples[0]["boxes"] and np.array_equal(got["image"], samples[0]["image"])
        # The natural hand-written peer: the same samples pickled whole, pickle.loads per key.
        penv = lmdb.open(str(tmp / f"pickled-{kind}"), map_size=1 << 34, readahead=False, sync=False)
        with penv.begin(write=True) as t:
            for k, s in zip(keys, samples):
                t.put(k, pickle.dumps(s, protocol=5))

        def raw_lmdb_pickle():
            for b in kb:
                with penv.begin() as t:
                    batch = [pickle.loads(t.get(k)) for k in b]
            return batch

        readers["raw py-lmdb get + pickle.loads"] = raw_lmdb_pickle

    client = None
    if redis_hosts is not None:
        import redis

        rds = CachedDataset(MemDataset(samples), "redis", f"bench-{kind}", hosts=redis_hosts)
        rds.cache_loader.clear()
        rds.warmup(progress=False, batch_size=256)

        def cached_redis():
            for b in bs:
                rds.__getitems__(b)

        readers["CachedDataset (Redis)"] = cached_redis
        h = redis_hosts[0]
        client = redis.Redis(host=h["host"], port=h["port"], password=h["password"])
        pkeys = [b"pickled:" + k for k in keys]
        pipe = client.pipeline(transaction=False)
        for k, v, s in zip(keys, values, samples):
            pipe.set(b"raw:" + k, v)
            pipe.set(b"pickled:" + k, pickle.dumps(s, protocol=5))
        pipe.execute()
        rkb = [[b"raw:" + keys[i] for i in b] for b in bs]

        def raw_redis():
            for b in rkb:
                p = client.pipeline(transaction=False)
                for k in b:
                    p.get(k)
                p.execute()

        readers["raw redis-py pipeline"] = raw_redis
        porder = [pkeys[i] for i in order]

        def per_sample():
            for k in porder:
                pickle.loads(client.get(k))

        readers["Redis 1 RTT/sample + pickle"] = per_sample

    out.update(interleaved(readers, n, repeat))
    env.close()
    if kind == "objects":
        penv.close()
    if client is not None:
        rds.cache_loader.clear()
        client.delete(*[b"raw:" + k for k in keys], *pkeys)
        client.close()

    # Through a DataLoader with 2 workers (persistent, so worker start-up is not counted).
    collate = collate_objects if kind == "objects" else None
    loaders = {
        name: DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True,
                         multiprocessing_context="fork", collate_fn=collate)
        for name, dataset in (("uncached", MemDataset(samples)), ("CachedDataset (LMDB)", ds))
    }  # fmt: skip

    def epoch_of(dl):
        def epoch():
            for _ in dl:
                pass

        return epoch

    for name, r in interleaved({k: epoch_of(v) for k, v in loaders.items()}, n, repeat).items():
        out[f"DataLoader 2 workers: {name}"] = r
    loaders.clear()  # stops the persistent workers
    ds.close()
    if kind == "objects":
        gc.unfreeze()

    for name, v in out.items():
        rows.append([kind, name, v])
    lm = out["CachedDataset (LMDB)"] / out["raw py-lmdb get"]
    lk = out["CachedDataset (LMDB)"] / out["raw py-lmdb get, batch kept"]
    l1 = out["CachedDataset (LMDB), 1 decode thread"] / out["raw py-lmdb get"]
    notes.append(
        f"- {kind}: CachedDataset(LMDB) / raw py-lmdb get = {lm:.2f} (batch kept: {lk:.2f}; "
        f"1 decode thread: {l1:.2f})"
    )
    if kind == "objects":
        lp = out["CachedDataset (LMDB)"] / out["raw py-lmdb get + pickle.loads"]
        lp1 = out["CachedDataset (LMDB), 1 decode thread"] / out["raw py-lmdb get + pickle.loads"]
        notes.append(
            f"- {kind}: CachedDataset(LMDB) / raw py-lmdb get + pickle.loads = {lp:.2f} "
            f"(1 decode thread: {lp1:.2f})"
        )
    if redis_hosts is not None:
        rr = out["CachedDataset (Redis)"] / out["Redis 1 RTT/sample + pickle"]
        notes.append(f"- {kind}: CachedDataset(Redis) / Redis 1 RTT per sample = {rr:.1f}x")
    dl_ratio = out["DataLoader 2 workers: CachedDataset (LMDB)"] / out["DataLoader 2 workers: uncached"]
    notes.append(f"- {kind}: DataLoader(2 workers) cached / uncached = {dl_ratio:.2f}")
    return out


def plot(path: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5))
    axes = np.atleast_1d(axes)
    for ax, (kind, out) in zip(axes, results.items()):
        names = list(out)
        ax.barh(names, [out[k] for k in names])
        ax.set_xscale("log")
        ax.set_title(f"{kind}: warm samples/s (higher is better)")
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``trainloom bench cache`` (each value checked as it is parsed)."""
    ap = argparse.ArgumentParser(
        prog="trainloom bench cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    ap.add_argument("--out", default=None, type=out_dir, help="write cache.md and cache.png here")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis measurements")
    ap.add_argument(
        "--small",
        type=positive_int,
        default=None,
        help="number of small samples (default 20000; 1000 with --quick)",
    )
    ap.add_argument(
        "--images", type=positive_int, default=None, help="number of images (default 1000; 64 with --quick)"
    )
    ap.add_argument(
        "--objects",
        type=positive_int,
        default=None,
        help=f"number of objects samples ({BOXES} Box dataclasses each; default 5000; 256 with --quick)",
    )
    return ap


def main(argv=None) -> int:
    """Run the benchmark and print (and with --out, write) its report."""
    args = build_parser().parse_args(argv)
    n_small = args.small if args.small is not None else (1000 if args.quick else 20000)
    n_img = args.images if args.images is not None else (64 if args.quick else 1000)
    n_obj = args.objects if args.objects is not None else (256 if args.quick else 5000)
    repeat = 1 if args.quick else 5
    tmp = Path(tempfile.mkdtemp(prefix="trainloom-bench-cache-"))
    store = None
    rows: list = []
    notes: list = []
    results = {}
    try:
        with bench_lock():
            redis_hosts = None
            if not args.no_redis:
                from trainloom._locate import find_redis_server

                if find_redis_server() is None:
                    notes.append("- Redis skipped: no redis-server binary")
                else:
                    from trainloom.data.stores.redis_store import RedisStore

                    store = RedisStore(namespace="bench-probe", capacity_per_node=8 << 30)
                    redis_hosts = store.hosts
            results["small"] = bench_kind("small", n_small, repeat, tmp, redis_hosts, rows, notes)
            results["image"] = bench_kind("image", n_img, repeat, tmp, redis_hosts, rows, notes)
            results["objects"] = bench_kind("objects", n_obj, repeat, tmp, redis_hosts, rows, notes)
    finally:
        if store is not None:
            store.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    md = "\n".join(
        [
            "# trainloom bench cache",
            "",
            f"{machine_line()}; small n={n_small}, image n={n_img}, objects n={n_obj} ({BOXES} boxes each), "
            f"batch {BATCH}, median of {repeat}.",
            "Other processes may be loading the CPUs: read ratios, not absolute figures.",
            "",
            markdown_table(["workload", "reader", "samples/s"], rows),
            "",
            *notes,
        ]
    )
    print(md)
    path = write_report(args.out, "cache", md)
    if path is not None:
        plot(path.parent / "cache.png", results)
        print(f"wrote {path} and {path.parent / 'cache.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
