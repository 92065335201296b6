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


def free_port() -> int:
    """A loopback port free now (for --workers above 1, which needs a --port other than 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`tfm serve` in a subprocess on a loopback port (by default --port 0: a free one; the URL is read from
    its stderr)."""

    def __init__(self, model_dir, *options: str, port: int = 0):
        cmd = [sys.executable, "-m", "transformer_cli", "serve", "-c", str(model_dir), "--port", str(port), *options]
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
    s = Server(trained_dir, *LIMITS)
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
    assert meta["limits"]["max_texts"] == 8 and meta["workers"] == 1


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


@pytest.mark.slow
def test_sigterm_lets_requests_in_flight_finish_and_exits_0(trained_dir):
    # Requests wait up to 3 s for others to join their batch: in flight for certain when SIGTERM comes.
    s = Server(trained_dir, "--max-wait-ms", "3000", "--max-batch-size", "64")
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
    s = Server(trained_dir, "--drain-timeout", "1")
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


def health_by_process(url: str, processes: int) -> dict[int, dict]:
    """GET /health, each on a new connection (which one server process accepts), until `processes`
    processes have answered: {pid: its answer}. The later processes may still be loading the model."""
    seen, deadline = {}, time.monotonic() + STARTUP_SEC
    while len(seen) < processes and time.monotonic() < deadline:
        answer = httpx.get(f"{url}/health").json()
        seen[answer["pid"]] = answer
        time.sleep(0.02)
    return seen


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_workers_both_answer_as_predict_and_sigterm_stops_them_with_exit_0(trained_dir):
    s = Server(trained_dir, *LIMITS, "--workers", "2", port=free_port())
    try:
        pids = set(health_by_process(s.url, 2))
        assert len(pids) == 2 and s.proc.pid not in pids  # two server processes, started by tfm serve
        assert httpx.get(f"{s.url}/metadata").json()["workers"] == 2
        texts = list(dict.fromkeys(mixed_texts(12, seed=6, long_words=60)))
        expected = dict(zip(texts, predict_texts(trained_dir, texts, "auto")))
        bodies = requests_of(texts)
        assert_answers(asyncio.run(concurrently(s.url, bodies)), bodies, expected)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        assert not any(running(pid) for pid in pids)
    finally:
        s.stop()


def test_more_workers_than_one_on_port_0_is_a_usage_error(trained_dir):
    from transformer_cli.errors import UsageError
    from transformer_cli.serve import serve

    with pytest.raises(UsageError, match="--workers 2 needs a --port other than 0"):
        serve(trained_dir, port=0, workers=2, on_ready=lambda url: None)


@pytest.mark.slow
def test_a_client_gone_before_its_answer_costs_no_model_call_and_no_traceback(trained_dir):
    # The first request waits up to 2 s for others to join its model call (another connection is open,
    # idle, so it does wait): its client leaves meanwhile.
    s = Server(trained_dir, "--max-wait-ms", "2000")
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

    app = make_app(None, {}, Limits())  # no model: every model call fails
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


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_bad_model_directory_fails_before_serving(tmp_path, workers):
    cmd = [sys.executable, "-m", "transformer_cli", "serve", "-c", str(tmp_path / "missing"), "--port",
           str(free_port()), "--workers", workers]
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
