"""`tfm serve`, a real process on a free loopback port, through a real HTTP client (httpx): its answers
equal predict_texts', bad requests get a 4xx and leave it serving, concurrent requests get their own
answers, and SIGTERM lets the requests in flight finish, then exits 0."""

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO
from test_export import mixed_texts

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from transformer_cli.evaluate import predict_texts

STARTUP_SEC = 120  # a generous bound for a loaded machine; the test never asserts speed
LIMITS = ["--max-texts", "8", "--max-body-bytes", "4000", "--max-batch-size", "16"]
ONE = ["--workers", "1"]  # one server process: /health's counts are the server's (with more, each process's own)
MANY = ["--workers", "2"] if sys.platform.startswith("linux") else ONE  # more than one needs Linux


class Server:
    """`tfm serve` in a subprocess on a free loopback port (--port 0; the URL is read from its stderr)."""

    def __init__(self, model_dir, *options: str):
        cmd = [sys.executable, "-m", "transformer_cli", "serve", "-c", str(model_dir), "--port", "0", *options]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stderr], daemon=True).start()
        self.url = self._wait_for_url()

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + STARTUP_SEC
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, f"tfm serve exited {self.proc.returncode}"
                continue
            if " on http://" in line:
                return line.split(" on ", 1)[1].split(";")[0]
        raise AssertionError("tfm serve did not start")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(trained_dir):
    s = Server(trained_dir, *LIMITS, *ONE)
    yield s
    assert s.stop() == 0


def post(url, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/predict", timeout=60, **({"json": body} if not isinstance(body, bytes) else
                                                       {"content": body}), **kwargs)


def test_predictions_equal_predict_texts(server, trained_dir):
    texts = mixed_texts(5, seed=5, long_words=120)  # 8 texts: the most one request may hold
    r = post(server.url, {"texts": texts})
    assert r.status_code == 200, r.text
    assert r.json()["predictions"] == predict_texts(trained_dir, texts, "auto")  # one model call: the same batches


def test_health_and_metadata(server, trained_dir):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    meta = httpx.get(f"{server.url}/metadata").json()
    config = json.loads((trained_dir / "config.json").read_text())
    assert meta["labels"] == config["labels"]
    assert meta["model"]["d_model"] == config["model"]["d_model"] and meta["model"]["num_params"] > 0
    assert meta["data"]["max_length"] == config["data"]["max_length"]
    assert meta["training_metrics"] == json.loads((trained_dir / "metrics.json").read_text())
    assert meta["limits"]["max_texts"] == 8


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b'{"texts": ["good"', 400, "not valid JSON"),
    (b"", 400, "not valid JSON"),
    ({"review": ["good"]}, 422, "'texts' is missing"),
    ({"texts": "good"}, 422, "'texts': Input should be a valid array"),
    ({"texts": ["good", 3]}, 422, "'texts.1': Input should be a valid string"),
    ([1, 2], 422, "'body': Input should be an object"),
    ({"texts": []}, 422, "'texts' is empty"),
    ({"texts": ["fine", "  "]}, 422, "texts[1] is empty"),
    ({"texts": ["fine"] * 9}, 422, "at most 8"),
    ({"texts": ["x" * 5000]}, 413, "over the limit of 4000"),
])
def test_a_bad_request_gets_a_4xx_and_the_server_serves_on(server, body, status, fragment):
    r = post(server.url, body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]
    assert post(server.url, {"texts": ["superb"]}).json()["predictions"][0]["label"] in ("neg", "pos")


def test_an_oversized_chunked_body_gets_413(server):
    chunks = (b'{"texts": ["' + b"a" * 1000 for _ in range(5))  # a generator: sent chunked, no Content-Length
    r = httpx.post(f"{server.url}/predict", content=chunks, timeout=60)
    assert r.status_code == 413 and "over the limit" in r.json()["error"]


def test_unknown_route_gets_a_json_404(server):
    r = httpx.get(f"{server.url}/predict/now")
    assert r.status_code == 404 and "POST /predict" in r.json()["error"]


@pytest.mark.parametrize(("method", "path"), [("GET", "/predict"), ("PUT", "/predict"), ("POST", "/health")])
def test_a_wrong_method_gets_a_json_405(server, method, path):
    r = httpx.request(method, f"{server.url}{path}")
    assert r.status_code == 405 and r.headers["content-type"] == "application/json"
    assert r.json()["error"] == (f"Method Not Allowed: {method} {path}; this server has POST /predict, GET /health "
                                 "and GET /metadata")


async def concurrently(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=len(bodies))) as client:
        return await asyncio.gather(*(client.post(f"{url}/predict", json=b) for b in bodies))


def requests_of(texts: list[str]) -> list[dict]:
    """The texts split into requests of 1, 2 or 3 texts."""
    bodies, i = [], 0
    while i < len(texts):
        n = 1 + i % 3
        bodies.append({"texts": texts[i : i + n]})
        i += n
    return bodies


def assert_answers(responses, bodies, expected: dict[str, dict]) -> None:
    for r, body in zip(responses, bodies):
        assert r.status_code == 200, r.text
        got = r.json()["predictions"]
        assert [p["label"] for p in got] == [expected[t]["label"] for t in body["texts"]]
        for p, t in zip(got, body["texts"]):  # other batches, other padding: equal within float error
            assert p["probabilities"] == pytest.approx(expected[t]["probabilities"], abs=1e-5)


def test_concurrent_requests_are_batched_and_get_their_own_answers(server, trained_dir):
    texts = list(dict.fromkeys(mixed_texts(40, seed=6, long_words=120)))
    expected = dict(zip(texts, predict_texts(trained_dir, texts, "auto")))
    bodies = requests_of(texts)
    before = httpx.get(f"{server.url}/health").json()
    responses = asyncio.run(concurrently(server.url, bodies))
    assert_answers(responses, bodies, expected)
    after = httpx.get(f"{server.url}/health").json()
    assert after["requests"] - before["requests"] == len(bodies)
    assert after["batches"] - before["batches"] < len(bodies)  # some requests shared a model call


def test_sigterm_lets_requests_in_flight_finish_and_exits_0(trained_dir):
    # Requests wait up to 3 s for others to join their batch: in flight for certain when SIGTERM comes.
    s = Server(trained_dir, "--max-wait-ms", "3000", "--max-batch-size", "64", *ONE)
    texts = list(dict.fromkeys(mixed_texts(12, seed=7, long_words=60)))
    expected = dict(zip(texts, predict_texts(trained_dir, texts, "auto")))
    bodies = requests_of(texts)

    async def scenario():
        pending = asyncio.ensure_future(concurrently(s.url, bodies))
        async with httpx.AsyncClient() as client:
            while (await client.get(f"{s.url}/health")).json()["in_flight"] < len(bodies):
                await asyncio.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        return await pending

    try:
        responses = asyncio.run(scenario())
        assert_answers(responses, bodies, expected)
        assert s.proc.wait(timeout=60) == 0
    finally:
        s.stop()
    with pytest.raises(httpx.ConnectError):  # and it has stopped listening
        httpx.get(f"{s.url}/health")


def raw_request(url: str, body: bytes, declared: int | None = None) -> socket.socket:
    """A connection that has sent a POST /predict with `body`, announced as `declared` bytes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    conn.sendall(f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body) if declared is None else declared}\r\n\r\n".encode() + body)
    return conn


def test_sigterm_closes_a_stalled_upload_after_the_drain_timeout_and_exits_0(trained_dir):
    s = Server(trained_dir, "--drain-timeout", "1", *MANY)  # on Linux, SIGTERM passed on to both processes
    stalled = raw_request(s.url, b'{"texts": ["good', declared=100)  # and then nothing more
    try:
        time.sleep(0.5)  # read by the server, which waits for the rest of the body
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0  # without the timeout it waited for the client for ever
    finally:
        stalled.close()
        s.stop()
    time.sleep(0.2)  # the reader thread's last lines
    log = "".join(s.lines.queue)
    assert "Traceback" not in log and "CancelledError" not in log, log[-2000:]


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--workers above 1 needs Linux")


def health_by_process(url: str, processes: int) -> dict[int, dict]:
    """GET /health, each on a new connection (the kernel hands it to one server process), until
    `processes` processes have answered: {pid: its answer}."""
    seen = {}
    for _ in range(200):  # two processes: all 200 to one of them has odds of 2**-199
        answer = httpx.get(f"{url}/health").json()
        seen[answer["pid"]] = answer
        if len(seen) == processes:
            break
    return seen


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@linux_only
def test_workers_share_the_port_each_answering_as_predict_and_ctrl_c_stops_them(trained_dir):
    s = Server(trained_dir, *LIMITS, "--workers", "2")
    try:
        pids = set(health_by_process(s.url, 2))
        assert len(pids) == 2 and s.proc.pid not in pids  # two server processes, started by tfm serve
        assert httpx.get(f"{s.url}/metadata").json()["workers"] == 2
        texts = list(dict.fromkeys(mixed_texts(40, seed=6, long_words=120)))
        expected = dict(zip(texts, predict_texts(trained_dir, texts, "auto")))
        bodies = requests_of(texts)
        assert_answers(asyncio.run(concurrently(s.url, bodies)), bodies, expected)
        served = {pid: answer["requests"] for pid, answer in health_by_process(s.url, 2).items()}
        assert sum(served.values()) == len(bodies) and min(served.values()) > 0, served  # 20 connections, both used
        s.proc.send_signal(signal.SIGINT)  # Ctrl-C: the terminal signals tfm serve, which passes it on
        assert s.proc.wait(timeout=60) == 0
        assert not any(running(pid) for pid in pids)
    finally:
        s.stop()


@linux_only
def test_sigterm_lets_each_processs_requests_in_flight_finish_and_exits_0(trained_dir):
    # Idle connections to both processes make each one's first request wait its 5 s for others: the
    # requests are in flight for certain when SIGTERM comes.
    s = Server(trained_dir, "--workers", "2", "--max-wait-ms", "5000", "--max-batch-size", "64")
    idle = [socket.create_connection(s.url.removeprefix("http://").rsplit(":", 1)) for _ in range(16)]
    texts = list(dict.fromkeys(mixed_texts(12, seed=7, long_words=60)))
    expected = dict(zip(texts, predict_texts(trained_dir, texts, "auto")))
    bodies = requests_of(texts)

    async def scenario():
        pending = asyncio.ensure_future(concurrently(s.url, bodies))
        in_flight = {}
        while len(in_flight) < 2 or sum(in_flight.values()) < len(bodies):
            async with httpx.AsyncClient() as client:  # a new connection: either process may answer
                answer = (await client.get(f"{s.url}/health")).json()
            in_flight[answer["pid"]] = answer["in_flight"]
        s.proc.send_signal(signal.SIGTERM)
        return await pending

    try:
        responses = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
        assert_answers(responses, bodies, expected)
        assert s.proc.wait(timeout=60) == 0
    finally:
        for conn in idle:
            conn.close()
        s.stop()


@linux_only
def test_a_server_process_that_dies_stops_the_others_and_fails_in_one_line(trained_dir):
    s = Server(trained_dir, "--workers", "2")
    try:
        dead, other = health_by_process(s.url, 2)
        os.kill(dead, signal.SIGKILL)
        assert s.proc.wait(timeout=60) == 1
        assert not running(other)
    finally:
        s.stop()
    time.sleep(0.2)  # the reader thread's last lines
    errors = [line for line in s.lines.queue if "error" in line.lower()]
    assert errors == [f"tfm: error: server process {dead} was killed by SIGKILL; the others were stopped\n"], errors


@linux_only
def test_server_processes_stop_when_tfm_serve_is_killed(trained_dir):
    s = Server(trained_dir, "--workers", "2")
    pids = list(health_by_process(s.url, 2))
    s.proc.kill()  # no chance to stop them: they notice their pipe to it close
    s.proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in pids)


def test_default_workers_are_one_per_torch_thread_up_to_evaluates_cap_on_a_linux_cpu(monkeypatch):
    import torch

    from transformer_cli import serve as serve_mod
    from transformer_cli.evaluate import CPU_WORKERS

    monkeypatch.setattr(sys, "platform", "linux")
    workers = {}
    for threads in (1, 2, 3, 16):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        workers[threads] = serve_mod.default_workers("cpu")
    assert CPU_WORKERS < 16 and workers == {1: 1, 2: 2, 3: min(3, CPU_WORKERS), 16: CPU_WORKERS}
    monkeypatch.setattr(sys, "platform", "darwin")  # its SO_REUSEPORT does not spread connections
    assert serve_mod.default_workers("cpu") == 1
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(serve_mod, "resolve_device", lambda name: torch.device("cuda", 0))
    assert serve_mod.default_workers("auto") == 1


def test_more_workers_than_one_outside_linux_is_a_usage_error(trained_dir, monkeypatch):
    from transformer_cli import serve as serve_mod
    from transformer_cli.errors import UsageError

    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(UsageError, match="--workers 2 needs Linux.*pass --workers 1"):
        serve_mod.serve(trained_dir, port=0, workers=2, on_ready=lambda url: None)


def test_a_client_gone_before_its_answer_costs_no_model_call_and_no_traceback(trained_dir):
    # The first request waits up to 2 s for others to join its model call (another connection is open,
    # idle, so it does wait): its client leaves meanwhile.
    s = Server(trained_dir, "--max-wait-ms", "2000", *ONE)
    idle = socket.create_connection(s.url.removeprefix("http://").rsplit(":", 1))
    try:
        gone = raw_request(s.url, json.dumps({"texts": ["a film to forget"]}).encode())
        while httpx.get(f"{s.url}/health").json()["in_flight"] < 1:
            time.sleep(0.05)
        gone.close()
        while httpx.get(f"{s.url}/health").json()["in_flight"] > 0:  # dropped from the queue
            time.sleep(0.05)
        raw_request(s.url, b'{"texts": ["half', declared=50).close()  # gone during its upload
        time.sleep(2.5)  # past the first request's wait: its model call would have run by now
        assert post(s.url, {"texts": ["a fine film"]}).status_code == 200
        assert httpx.get(f"{s.url}/health").json()["batches"] == 1  # the answered request's alone
    finally:
        idle.close()
        assert s.stop() == 0
    log = "".join(s.lines.queue)
    assert "Traceback" not in log and "Exception" not in log, log[-2000:]


def test_a_failure_of_the_model_is_a_json_500_for_its_request_and_serving_goes_on():
    from starlette.testclient import TestClient

    from transformer_cli.serve import Limits, make_app

    app = make_app(None, {}, Limits(), lambda: None, lambda: 1)  # no model: every model call fails
    with TestClient(app) as client:
        r = client.post("/predict", json={"texts": ["a film"]})
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert r.json()["error"].startswith("prediction failed: ")
        assert client.post("/predict", content=b"{").status_code == 400  # still answering
        assert client.get("/health").json()["requests"] == 1


def test_a_cancelled_request_is_left_out_of_the_model_call():
    from transformer_cli.serve import Batcher, Limits

    seen = []

    async def scenario():
        batcher = Batcher(lambda texts: seen.append(list(texts)) or [{"label": t} for t in texts], Limits(),
                          lambda: 1)
        gone = asyncio.ensure_future(batcher(["gone"]))
        await asyncio.sleep(0)  # queued
        gone.cancel()
        runner = asyncio.ensure_future(batcher.run())
        try:
            return await batcher(["kept"])
        finally:
            runner.cancel()
            batcher.worker.shutdown(wait=True)

    assert asyncio.run(scenario()) == [{"label": "kept"}] and seen == [["kept"]]


def batches_of(arrivals: list[tuple[float, str]], connections: int, max_wait_ms: float) -> list[list[str]]:
    """The model calls a Batcher makes of requests of one text each that arrive at the given seconds,
    with `connections` open connections."""
    from transformer_cli.serve import Batcher, Limits

    calls = []

    async def scenario():
        batcher = Batcher(lambda texts: calls.append(list(texts)) or [{"label": t} for t in texts],
                          Limits(max_wait_ms=max_wait_ms), lambda: connections)
        runner = asyncio.ensure_future(batcher.run())

        async def request(at: float, text: str):
            await asyncio.sleep(at)
            return await batcher([text])

        try:  # a guard, not a timing: without an early end the batches would wait max_wait_ms, far longer
            await asyncio.wait_for(asyncio.gather(*(request(at, t) for at, t in arrivals)), timeout=60)
        finally:
            runner.cancel()
            batcher.worker.shutdown(wait=True)

    asyncio.run(scenario())
    return calls


def test_a_batch_waits_for_every_open_connection_and_no_longer():
    # Two connections: the first request waits for the second's, however late it comes within the wait,
    # and once both are in, the batch goes at once rather than waiting out its 120 s.
    assert batches_of([(0.0, "a"), (0.3, "b")], connections=2, max_wait_ms=120_000) == [["a", "b"]]


def test_a_lone_connections_requests_go_at_once():
    assert batches_of([(0.0, "a"), (0.3, "b")], connections=1, max_wait_ms=120_000) == [["a"], ["b"]]


def test_a_batch_ends_at_its_wait_when_connections_stay_idle():
    # Three open connections, two requests: the first waits its 50 ms for the third, which never comes;
    # the second request, a second later, starts a batch of its own.
    assert batches_of([(0.0, "a"), (1.0, "b")], connections=3, max_wait_ms=50) == [["a"], ["b"]]


def test_open_connections_are_uvicorns_count_or_none_that_a_batch_reaches():
    import math
    from types import SimpleNamespace

    from transformer_cli.serve import open_connections

    assert open_connections(SimpleNamespace(server_state=SimpleNamespace(connections={1, 2, 3}))) == 3
    assert open_connections(SimpleNamespace(server_state=SimpleNamespace())) == math.inf  # a uvicorn without it
    assert open_connections(SimpleNamespace()) == math.inf
    # with such a count a batch waits its max_wait_ms, as for idle connections, and serving goes on
    assert batches_of([(0.0, "a"), (1.0, "b")], connections=math.inf, max_wait_ms=50) == [["a"], ["b"]]


TRACED = """
import sys
from opentelemetry import trace
from starlette.testclient import TestClient

class Recording(trace.TracerProvider):  # a configured provider: FastAPI's own telemetry would trace with it
    asked = 0
    def get_tracer(self, *args, **kwargs):
        Recording.asked += 1
        return trace.NoOpTracer()

trace.set_tracer_provider(Recording())
if sys.argv[1] == "tfm":
    from transformer_cli.serve import Limits, make_app
    app = make_app(None, {}, Limits(), lambda: None, lambda: 1)
else:
    from fastapi import FastAPI
    app = FastAPI()
    app.get("/health")(lambda: {})
with TestClient(app) as client:
    assert client.get("/health").status_code == 200
print(Recording.asked)
"""


def test_the_server_does_no_opentelemetry_work_of_fastapis_own():
    def tracers_asked(app: str) -> int:
        done = subprocess.run([sys.executable, "-c", TRACED, app], cwd=REPO, capture_output=True, text=True,
                              timeout=120, check=True)
        return int(done.stdout.split()[-1])

    if tracers_asked("fastapi") == 0:
        pytest.skip("this FastAPI has no telemetry of its own")
    assert tracers_asked("tfm") == 0


def test_what_startup_made_is_out_of_the_collectors_way_before_serving(trained_dir, monkeypatch):
    import gc

    import uvicorn

    from transformer_cli import serve as serve_mod

    frozen = []

    class Started(Exception):
        pass

    class Server(uvicorn.Server):
        def run(self, sockets=None):
            frozen.append(gc.get_freeze_count())
            for sock in sockets:
                sock.close()
            raise Started

    monkeypatch.setattr(serve_mod, "server_class", lambda: Server)
    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(Started):
            serve_mod.serve(trained_dir, port=0, workers=1, on_ready=lambda url: None)
    finally:
        gc.unfreeze()  # the rest of the tests collect as usual
    assert frozen and frozen[0] > 10_000  # the modules, the model and the app: a full collection skips them


@pytest.mark.parametrize("workers", [ONE, MANY])
def test_a_bad_model_directory_fails_before_serving(tmp_path, trained_dir, workers):
    cmd = [sys.executable, "-m", "transformer_cli", "serve", "-c", str(tmp_path / "missing"), "--port", "0",
           *workers]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and done.stderr.startswith("tfm: error: ") and len(done.stderr.splitlines()) == 1
    assert "does not exist" in done.stderr and "serving" not in done.stderr


@pytest.mark.parametrize(("command", "module", "extra"), [("serve", "uvicorn", "serve"),
                                                          ("export", "onnxscript", "export")])
def test_a_missing_extra_is_named_in_one_line(trained_dir, tmp_path, command, module, extra):
    code = (f"import sys; sys.modules[{module!r}] = None; from transformer_cli.cli import main; "
            f"sys.argv = ['tfm', {command!r}, '-c', {str(trained_dir)!r}, '-o' if {command!r} == 'export' else "
            f"'--port', {str(tmp_path / 'm.onnx')!r} if {command!r} == 'export' else '0']; main()")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("tfm: error: ") and f"pip install transformer-cli[{extra}]" in done.stderr


@pytest.mark.parametrize("wait", [float("nan"), float("inf")])
def test_limits_refuse_a_wait_that_never_ends(wait):
    """With nan or inf the first request of a batch would wait for a deadline that never comes."""
    from transformer_cli.errors import UsageError
    from transformer_cli.serve import Limits

    with pytest.raises(UsageError, match="--max-wait-ms must be a finite number of 0 or more"):
        Limits(max_wait_ms=wait)
