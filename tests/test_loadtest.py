"""scripts/loadtest_serve.py on the tiny model and synthetic reviews, with a few requests: its correctness
checks and JSON (never its speed)."""

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time

import pytest
from conftest import REPO, make_examples, make_review, write_jsonl

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_loadtest_checks_every_request_and_reports_each_level(trained_dir, tmp_path):
    out, data = tmp_path / "load.json", tmp_path / "reviews"
    rng = random.Random(0)  # 30 short reviews and, for (c), 10 of about 200 words
    data.mkdir()
    write_jsonl(data / "test.jsonl", make_examples(30, seed=5) + [
        {"text": make_review(rng, i % 2, n_words=195), "label": i % 2} for i in range(10)])
    # -c and --data relative to the folder it runs in (the server runs in the repository)
    cmd = [sys.executable, str(REPO / "scripts" / "loadtest_serve.py"), "-c", os.path.relpath(trained_dir, tmp_path),
           "--data", os.path.relpath(data, tmp_path), "--texts", "40", "--requests", "30", "--concurrency", "1,4",
           "--texts-per-request", "2", "--latency-requests", "5", "--malformed", "27", "--json", str(out)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    latency = result["latency_200_words"]
    assert latency["reviews"] == 10 and 190 <= latency["mean_words"] <= 210 and latency["requests"] == 5
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    assert all(lv["requests"] == 30 and lv["reviews"] == 60 and lv["good_failed"] == 0 for lv in result["levels"])
    assert all(lv["server_cpu_ms_per_review"] > 0 and lv["client_cpu_ms_per_review"] > 0 for lv in result["levels"])
    mixed = result["mixed"]
    assert mixed["malformed"] == 27 and mixed["malformed_without_4xx"] == 0 and mixed["good_failed"] == 0
    assert set(mixed["malformed_statuses"]) == {400, 413, 422}
    assert result["correct"] and result["server_exit_code"] == 0
    assert isinstance(result["unsteady"], bool)
    assert result["cpus"] == len(os.sched_getaffinity(0))
    for lv in result["levels"]:  # the ratio is the product of its two factors
        assert lv["cpu_bound_ratio"] * lv["cpus_busy"] == pytest.approx(lv["ratio_to_evaluate"])
        assert 0 < lv["cpus_busy"] and 0 < lv["cpu_bound_ratio"]
    assert "correctness: ok" in done.stdout


def test_a_split_too_small_for_the_requests_is_one_line_before_the_server_starts(trained_dir, tmp_path):
    (tmp_path / "few").mkdir()
    write_jsonl(tmp_path / "few" / "test.jsonl", make_examples(3, seed=0))
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "loadtest_serve.py"), "-c", str(trained_dir), "--data",
                           str(tmp_path / "few"), "--texts", "10", "--texts-per-request", "5"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == ("loadtest_serve: error: --texts-per-request 5: split 'test' of "
                           f"{tmp_path / 'few'} has only 3 reviews; lower it\n")
    assert "(b)" not in done.stdout


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("loadtest_serve", REPO / "scripts" / "loadtest_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_time_counts_the_processes_a_server_started():
    script = _script()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\nprint(flush=True)\ninput()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # it has used its 0.5 s and waits
        assert script.cpu_seconds(child.pid) >= 0.45
        assert script.cpu_seconds(os.getpid()) >= time.process_time() + 0.45  # this process's, and its child's
    finally:
        child.communicate("")
    assert math.isnan(script.cpu_seconds(child.pid))  # gone


def test_percentiles_are_nearest_rank():
    script = _script()
    latencies = [ms / 1000 for ms in range(100, 0, -1)]  # 100 requests of 1..100 ms, in any order
    load = {"wall": 1.0, "results": [(s, 200, True) for s in latencies]}
    got = script.summarise(load, [(b"", 1)] * 100)
    assert (got["p50_ms"], got["p99_ms"], got["max_ms"]) == pytest.approx((50.0, 99.0, 100.0))


def test_failed_requests_count_as_failures_not_as_served_reviews():
    script = _script()
    load = {"wall": 2.0, "results": [(0.010, 200, True), (0.001, 503, False), (0.002, 0, False), (0.020, 200, True),
                                     (0.003, 400, True)]}
    got = script.summarise(load, [(b"", 2), (b"", 2), (b"", 2), (b"", 2), (b"", 0)])
    assert (got["requests"], got["good_failed"], got["malformed"], got["malformed_without_4xx"]) == (4, 2, 1, 0)
    assert (got["reviews"], got["reviews_per_sec"]) == (4, 2.0)  # the two answered right, 2 reviews each
    assert (got["p50_ms"], got["max_ms"]) == pytest.approx((10.0, 20.0))  # the fast error replies left out


def test_a_dropped_connection_is_a_failed_request_and_the_load_goes_on():
    """A server that closes every other connection without an answer: those requests fail, the rest
    are served on a fresh connection."""
    script = _script()
    seen = 0

    async def handle(reader, writer):
        nonlocal seen
        while await reader.readline() not in (b"\r\n", b""):
            pass
        seen += 1
        if seen % 2 == 0:
            writer.close()
            return
        body = json.dumps({"predictions": [{"label": "pos"}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await script.run_load("127.0.0.1", str(port), [(b"", 1)] * 6, 1)

    load = asyncio.run(main())
    assert [r[1:] for r in load["results"]] == [(200, True), (0, False)] * 3


def test_a_machine_whose_speed_changed_during_the_run_is_flagged():
    script = _script()
    assert script.unsteady([1734.0, 1794.0]) is None and script.unsteady([1000.0, 1200.0]) is None
    warning = script.unsteady([1096.0, 1820.0])
    assert warning.startswith("(a) ran at 1096 and 1820 model reviews/s before and after (b), 66% apart")
    assert script.unsteady([1820.0, 1096.0]) is not None  # slower after as well as before


def test_the_ratio_splits_into_what_the_cpu_time_allows_and_how_busy_the_cpus_were():
    script = _script()
    # 1,000 reviews/s at 1.5 + 0.1 CPU-ms a review on 2 CPUs: 1.6 of their 2 seconds a second used,
    # and at 2 / 1.6 ms = 1,250 reviews/s with both always busy, 0.625x of (a)'s 2,000
    level = {"reviews_per_sec": 1000.0, "server_cpu_ms_per_review": 1.5, "client_cpu_ms_per_review": 0.1}
    got = script.cpu_split(level, 2000.0, 2)
    assert got == pytest.approx({"cpu_bound_ratio": 0.625, "cpus_busy": 0.8})


@pytest.mark.parametrize("args", [["--texts", "1", "--texts-per-request", "2"], ["--malformed", "-1"]])
def test_impossible_loads_are_usage_errors(args, capsys):
    with pytest.raises(SystemExit) as stop:
        _script().parse_args(["-c", "RUN", *args])
    assert stop.value.code == 2 and "error:" in capsys.readouterr().err
