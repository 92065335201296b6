"""Load test of `tfm serve`: throughput and latency under concurrent clients, against `tfm evaluate`'s path.

Starts `tfm serve -c MODEL` on a free loopback port, then, on --texts reviews drawn (seeded) from a
split of --data:
  (a) `tfm evaluate`'s path in this process, before (b) and again after it: encode_texts +
      evaluate_model on the same reviews (reviews/s of the model alone, as `tfm evaluate` reports
      it, and from text), after the warm-up `tfm serve` also runs; (b)'s ratios are to the mean of
      the two, so that a change in what else runs on the machine meanwhile weighs on both sides, and
      a warning (JSON: "unsteady") says when the two differ by more than 20%;
  (b) for each concurrency in --concurrency (default 1, 8, 32): --requests POST /predict requests of
      --texts-per-request reviews each, sent by that many clients on keep-alive connections;
      reviews/s and p50/p99 latency per request;
  (c) at concurrency 1, requests of one review of about 200 words: p50/p99 latency;
  (d) at the highest concurrency, the (b) load again with --malformed bad requests shuffled into it
      (invalid JSON, missing or mistyped texts, empty texts, too many texts, a body over the limit):
      every bad one must get a 4xx and every good one a 200 with one prediction per review.
Targets: (b) at concurrency 32 >= 70% of (a)'s model reviews/s; (c) p99 <= 50 ms. The server and
(a) run on --device (default cpu). Rates and latencies count the good requests answered right; a
dropped connection or a wrong answer is a failed request, not the end of the run.

The clients speak HTTP/1.1 over asyncio streams (a few lines here) rather than through a client
library: they share this machine's CPUs with the server, and a lighter client leaves it more.
Each load also reports the CPU time per review of the server process (/proc) and of the clients
(this process), and (a) the CPU time of evaluate's path: figures that depend far less than the
rates on what else runs on the machine. From them, (b)'s ratio splits into the ratio that CPU time a
review would allow with every CPU busy all the time, and the share of the CPUs' time the load used.
Exit code 1 if any bad request got no 4xx or any good one failed.

    python scripts/loadtest_serve.py -c runs/tfm --data ../shared/data/imdb --json loadtest.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
import _bench_common as bc

from transformer_cli.errors import UsageError

MAX_BODY = 100_000  # the server's --max-body-bytes here: an oversized bad request stays cheap to send
MAX_TEXTS = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", "-c", type=Path, required=True, help="output directory of `tfm train`")
    p.add_argument("--data", default=bc.DEFAULT_DATA, help="dataset the reviews come from")
    p.add_argument("--split", default="test")
    p.add_argument("--texts", type=int, default=2000, help="distinct reviews drawn from the split")
    p.add_argument("--requests", type=int, default=1000, help="requests at each concurrency")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    p.add_argument("--texts-per-request", type=int, default=1)
    p.add_argument("--latency-requests", type=int, default=300, help="(c): 200-word requests at concurrency 1")
    p.add_argument("--malformed", type=int, default=1000, help="(d): bad requests mixed into the load")
    p.add_argument("--max-batch-size", type=int, default=None, help="tfm serve --max-batch-size (default: its own)")
    p.add_argument("--max-wait-ms", type=float, default=None, help="tfm serve --max-wait-ms (default: its own)")
    p.add_argument("--workers", type=int, default=None, help="tfm serve --workers (default: its own)")
    p.add_argument("--device", default="cpu", help="where both the server and (a)'s evaluate path run (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    args = p.parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: give client counts separated by commas, e.g. 1,8,32")
    if min(args.levels) < 1 or args.requests < 1 or args.texts < 1 or not 1 <= args.texts_per_request <= MAX_TEXTS:
        p.error(f"--concurrency, --requests and --texts must be positive; --texts-per-request 1 to {MAX_TEXTS}")
    if args.texts_per_request > args.texts:
        p.error(f"--texts-per-request {args.texts_per_request} is more than the {args.texts} reviews drawn (--texts)")
    if args.malformed < 0 or args.latency_requests < 0:
        p.error("--malformed and --latency-requests must be 0 or more")
    return args


# --------------------------------------------------------------------------- the reviews


def load_texts(args) -> list[str]:
    from transformer_cli.data import load_splits
    from transformer_cli.evaluate import load_model_dir

    cfg = load_model_dir(args.checkpoint).cfg
    raw, _ = load_splits(cfg.replace(data={"source": args.data}).data, (args.split,))
    texts = raw[args.split].texts
    rng = random.Random(args.seed)
    return rng.sample(texts, min(args.texts, len(texts)))


def evaluate_path(loaded: tuple, texts: list[str]) -> dict:
    """(a): reviews/s of `tfm evaluate`'s path on `texts`: evaluate_model (the model, as tfm evaluate
    reports it) and encode_texts + evaluate_model (from text, as the server starts)."""
    import numpy as np

    from transformer_cli.data import Encoded, encode_texts
    from transformer_cli.evaluate import evaluate_model

    rt, model, cfg, tokenizer, labels, _ = loaded
    d = cfg.data
    t0, c0 = time.perf_counter(), time.process_time()
    ids, offsets = encode_texts(tokenizer, texts, d.max_length, d.truncation, d.head_fraction)
    encode_sec, encode_cpu = time.perf_counter() - t0, time.process_time() - c0
    enc = Encoded(ids, offsets, np.zeros(len(texts), dtype=np.int64))
    # once untimed: its passes of short reviews are wider than warm_up's, and the first pass of each
    # width builds oneDNN's kernels, which a whole split pays in a small share of its time
    evaluate_model(model, enc, rt, cfg.train.eval_batch_size, len(labels))
    t0, c0 = time.perf_counter(), time.process_time()
    evaluate_model(model, enc, rt, cfg.train.eval_batch_size, len(labels))
    model_sec, model_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"reviews": len(texts), "model_reviews_per_sec": len(texts) / model_sec,
            "model_cpu_ms_per_review": 1000 * model_cpu / len(texts),
            "from_text_cpu_ms_per_review": 1000 * (model_cpu + encode_cpu) / len(texts),
            "from_text_reviews_per_sec": len(texts) / (model_sec + encode_sec), "encode_sec": encode_sec,
            "compute_dtype": rt.precision}


# --------------------------------------------------------------------------- the server and the clients


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "transformer_cli", "serve", "-c", str(args.checkpoint.resolve()), "--port", "0",
           "--max-body-bytes", str(MAX_BODY), "--max-texts", str(MAX_TEXTS), "--device", args.device]
    for option in ("max_batch_size", "max_wait_ms", "workers"):
        if getattr(args, option) is not None:
            cmd += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    proc = subprocess.Popen(cmd, cwd=REPO, env=bc.child_env(), stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()  # "tfm: serving DIR on http://HOST:PORT; ..." once it accepts requests
    if " on http://" not in line:
        proc.wait()
        raise SystemExit(f"tfm serve did not start: {line.strip()}")
    host, port = line.split(" on http://", 1)[1].split(";")[0].rsplit(":", 1)
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # later lines must not fill the pipe
    return proc, host, port


class Connection:
    """One keep-alive HTTP/1.1 connection: POST a body, read the status and the JSON answer."""

    def __init__(self, host: str, port: str):
        self.host, self.port = host, int(port)
        self.reader = self.writer = None

    async def post(self, body: bytes, content_length: int | None = None) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        n = len(body) if content_length is None else content_length
        self.writer.write(f"POST /predict HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {n}\r\n\r\n".encode() + body)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        length, close = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and value.strip().lower() == "close":
                close = True
        answer = await self.reader.readexactly(length)
        if close:  # the server ends the connection after some errors (a body it did not read)
            self.close()
        return status, answer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def run_load(host: str, port: str, requests: list[tuple[bytes, int]], concurrency: int) -> dict:
    """Send `requests` ((body, texts in it; 0 = a bad one)) from `concurrency` clients; per request:
    latency, status and whether its answer was right."""
    todo = iter(enumerate(requests))
    results: list[tuple[float, int, bool] | None] = [None] * len(requests)

    async def client():
        conn = Connection(host, port)
        try:
            for i, (body, n) in todo:
                t0 = time.perf_counter()
                try:
                    status, answer = await conn.post(body)
                    ok = (400 <= status < 500) if n == 0 else (status == 200 and
                                                               len(json.loads(answer)["predictions"]) == n)
                except (OSError, EOFError, ValueError, LookupError, TypeError):  # a dropped connection, a bad answer
                    status, ok = 0, False
                    conn.close()  # the next request connects again
                results[i] = (time.perf_counter() - t0, status, ok)
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"wall": time.perf_counter() - t0, "results": results}


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) used so far by a process and its descendants that are still
    running (the server processes of `tfm serve --workers`), from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        process = todo.pop()
        if fields := _stat(process):
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
            todo += children.get(process, [])
    return total if _stat(pid) else float("nan")


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name (state, ppid, ...); None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def measured_load(host: str, port: str, requests: list[tuple[bytes, int]], concurrency: int, pid: int) -> dict:
    """run_load's summary, with the CPU time per review of the server and of the clients (this
    process): figures that, unlike the rates, depend little on what else runs on the machine."""
    before, clients_before = cpu_seconds(pid), time.process_time()
    summary = summarise(asyncio.run(run_load(host, port, requests, concurrency)), requests)
    reviews = max(1, summary["reviews"])
    summary["server_cpu_ms_per_review"] = 1000 * (cpu_seconds(pid) - before) / reviews
    summary["client_cpu_ms_per_review"] = 1000 * (time.process_time() - clients_before) / reviews
    return summary


def summarise(load: dict, requests: list[tuple[bytes, int]]) -> dict:
    good = [r for r, (_, n) in zip(load["results"], requests) if n]
    bad = [r for r, (_, n) in zip(load["results"], requests) if not n]
    served = [(r, n) for r, (_, n) in zip(load["results"], requests) if n and r[2]]  # answered right
    latencies = sorted(r[0] for r, _ in served)
    reviews = sum(n for _, n in served)

    def pct(q):  # nearest rank: the smallest latency that at least q of the requests did not exceed
        return 1000 * latencies[max(0, math.ceil(q * len(latencies)) - 1)] if latencies else float("nan")

    return {"requests": len(good), "reviews": reviews, "reviews_per_sec": reviews / load["wall"],
            "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": 1000 * latencies[-1] if latencies else float("nan"),
            "good_failed": sum(not r[2] for r in good), "malformed": len(bad),
            "malformed_without_4xx": sum(not r[2] for r in bad),
            "malformed_statuses": sorted({r[1] for r in bad})}


def good_requests(texts: list[str], count: int, per: int, rng: random.Random) -> list[tuple[bytes, int]]:
    return [(json.dumps({"texts": rng.sample(texts, per)}).encode(), per) for _ in range(count)]


def malformed_requests(count: int, rng: random.Random) -> list[tuple[bytes, int]]:
    kinds = [
        b'{"texts": ["an unfinished',  # invalid JSON
        b"",  # no body
        b'{"review": ["a good film"]}',  # no texts
        b'{"texts": "a good film"}',  # not a list
        b'{"texts": ["a good film", 42]}',  # not strings
        b'{"texts": []}',  # empty
        b'{"texts": ["   "]}',  # an empty review
        json.dumps({"texts": ["a good film"] * (MAX_TEXTS + 1)}).encode(),  # too many texts
        json.dumps({"texts": ["x" * MAX_BODY]}).encode(),  # a body over the limit
    ]
    return [(kinds[i % len(kinds)], 0) for i in rng.sample(range(count), count)]


# --------------------------------------------------------------------------- main


STEADY = 1.2  # (a)'s faster run at most this many times its slower one, or the ratios are suspect


def unsteady(rates: list[float]) -> str | None:
    """Why (b)'s ratios cannot be trusted, or None: (a)'s runs before and after (b) differ by more than
    STEADY, so that the machine's speed changed during the run (another process, a neighbour)."""
    if max(rates) <= STEADY * min(rates):
        return None
    return (f"(a) ran at {' and '.join(f'{r:.0f}' for r in rates)} model reviews/s before and after (b), "
            f"{max(rates) / min(rates) - 1:.0%} apart: the machine's speed changed during the run, so the "
            "ratios to (a) are unreliable; run it again on a quiet machine")


def cpu_split(level: dict, evaluate_rate: float, cpus: int) -> dict:
    """A load's ratio to (a) as the product of two factors: `cpu_bound_ratio`, the ratio that its CPU
    time a review (server and clients) would give with all `cpus` CPUs busy all the time, and
    `cpus_busy`, the share of the CPUs' time that the load used. A ratio short of its target then says
    whether a review costs too much CPU, or the CPUs sat idle, or both."""
    cost_ms = level["server_cpu_ms_per_review"] + level["client_cpu_ms_per_review"]
    return {"cpu_bound_ratio": cpus * 1000 / cost_ms / evaluate_rate,
            "cpus_busy": level["reviews_per_sec"] * cost_ms / 1000 / cpus}


def show_evaluate(ev: dict, when: str) -> None:
    print(f"(a) tfm evaluate's path, {when}: {ev['model_reviews_per_sec']:.0f} reviews/s (model), "
          f"{ev['from_text_reviews_per_sec']:.0f} reviews/s from text ({ev['compute_dtype']}); CPU "
          f"{ev['model_cpu_ms_per_review']:.2f} ms a review (model), {ev['from_text_cpu_ms_per_review']:.2f} from text")


def main(argv=None) -> int:
    args = parse_args(argv)
    info = bc.hardware_info()
    bc.print_header("tfm serve load test", info)
    rng = random.Random(args.seed)
    texts = load_texts(args)
    if len(texts) < args.texts_per_request:
        raise UsageError(f"--texts-per-request {args.texts_per_request}: split '{args.split}' of {args.data} has only "
                         f"{len(texts)} reviews; lower it")
    print(f"{len(texts)} reviews of {args.data} [{args.split}]; model {args.checkpoint}")
    results = {"hardware": info, "args": {k: str(v) for k, v in vars(args).items()}}
    from transformer_cli.evaluate import load_for_inference, warm_up

    loaded = load_for_inference(args.checkpoint, args.device, None)  # as tfm evaluate --device loads it
    # as tfm serve warms up: oneDNN's kernels for the passes' widths, built once a process, are not
    # what a review costs (on a whole split tfm evaluate builds them in a small share of its time)
    warm_up(loaded)
    results["evaluate"] = [evaluate_path(loaded, texts)]
    show_evaluate(results["evaluate"][0], "before the load")
    proc, host, port = start_server(args)
    try:
        results["levels"] = []
        for c in args.levels:
            reqs = good_requests(texts, args.requests, args.texts_per_request, rng)
            s = measured_load(host, port, reqs, c, proc.pid)
            s["concurrency"] = c
            results["levels"].append(s)
        results["evaluate"].append(evaluate_path(loaded, texts))
        show_evaluate(results["evaluate"][1], "after (b)")
        evaluate_rate = statistics.mean(e["model_reviews_per_sec"] for e in results["evaluate"])
        warning = unsteady([e["model_reviews_per_sec"] for e in results["evaluate"]])
        results["unsteady"] = warning is not None
        if warning:
            print(f"\nwarning: {warning}")
        results["cpus"] = cpus = len(os.sched_getaffinity(0))  # the server's, which it inherits
        for s in results["levels"]:
            s["ratio_to_evaluate"] = s["reviews_per_sec"] / evaluate_rate
            s.update(cpu_split(s, evaluate_rate, cpus))
        print(f"\n(b) {args.requests} requests of {args.texts_per_request} review(s) at each concurrency; "
              f"ratio to (a)'s mean model reviews/s, {evaluate_rate:.0f}; the ratio is the one the CPU time a "
              f"review allows with the {cpus} CPUs busy all the time, times the share of their time used")
        bc.print_table(results["levels"], [("concurrency", "clients"), ("reviews_per_sec", "reviews/s"),
                                           ("ratio_to_evaluate", "/ evaluate"), ("p50_ms", "p50 ms"),
                                           ("p99_ms", "p99 ms"), ("server_cpu_ms_per_review", "server CPU ms/review"),
                                           ("client_cpu_ms_per_review", "clients CPU ms/review"),
                                           ("cpu_bound_ratio", "ratio at CPUs all busy"), ("cpus_busy", "CPUs busy"),
                                           ("good_failed", "failed")],
                       digits={"ratio_to_evaluate": 2, "server_cpu_ms_per_review": 2, "client_cpu_ms_per_review": 2,
                               "cpu_bound_ratio": 2, "cpus_busy": 2})
        words200 = [t for t in texts if 190 <= len(t.split()) <= 210]
        lat = None
        if not words200:
            print(f"\n(c) skipped: none of the {len(texts)} reviews drawn has 190 to 210 words (draw more: --texts)")
        elif args.latency_requests:
            reqs = good_requests(words200, args.latency_requests, 1, rng)
            results["latency_200_words"] = lat = measured_load(host, port, reqs, 1, proc.pid)
            lat["reviews"], lat["mean_words"] = len(words200), statistics.mean(len(t.split()) for t in words200)
            print(f"\n(c) {len(reqs)} requests of one 190-210-word review at concurrency 1 ({len(words200)} such "
                  f"reviews): p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms; server CPU "
                  f"{lat['server_cpu_ms_per_review']:.2f} ms a request")
        top = max(args.levels)
        reqs = good_requests(texts, args.requests, args.texts_per_request, rng) + malformed_requests(args.malformed, rng)
        rng.shuffle(reqs)
        results["mixed"] = mixed = measured_load(host, port, reqs, top, proc.pid)
        print(f"\n(d) {mixed['requests']} good and {mixed['malformed']} malformed requests at concurrency {top}: "
              f"{mixed['malformed'] - mixed['malformed_without_4xx']} malformed got a 4xx "
              f"(statuses {mixed['malformed_statuses']}), {mixed['good_failed']} good ones failed; "
              f"{mixed['reviews_per_sec']:.0f} reviews/s")
    finally:
        proc.terminate()
        results["server_exit_code"] = proc.wait(timeout=120)
    print()
    checks = results["checks"] = []
    by_c = {lv["concurrency"]: lv for lv in results["levels"]}
    if 32 in by_c:
        checks.append(bc.check("serve at concurrency 32 / evaluate (reviews/s)", by_c[32]["ratio_to_evaluate"], 0.70))
    if lat is not None:
        checks.append(bc.check("p99 latency of a ~200-word review at concurrency 1", lat["p99_ms"], 50, " ms",
                               higher_is_better=False))
    failures = sum(lv["good_failed"] for lv in results["levels"]) + (lat or {}).get("good_failed", 0) + mixed[
        "good_failed"]
    correct = failures == 0 and mixed["malformed_without_4xx"] == 0 and results["server_exit_code"] == 0
    print(f"correctness: {'ok' if correct else 'FAILED'} (good requests failed: {failures}; malformed without "
          f"a 4xx: {mixed['malformed_without_4xx']}; server exit code after SIGTERM: {results['server_exit_code']})")
    results["correct"] = correct
    bc.write_json(args.json, results)
    return 0 if correct else 1


if __name__ == "__main__":
    bc.run_script(main)
