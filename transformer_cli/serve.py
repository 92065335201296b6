"""`tfm serve`: a trained model behind HTTP, loaded once, with concurrent requests batched together.

FastAPI on uvicorn: both well kept, async (many open requests cost no threads), pydantic validates
the request bodies, and uvicorn shuts down gracefully. The serve extra installs httptools and uvloop,
which uvicorn then takes for parsing HTTP and for the event loop: the loop's work per request is a
share of the server's time at many clients (docs/serving.md). Routes: POST /predict {"texts": [...]} ->
{"predictions": [one object per text, as `tfm predict --json` prints it]}, GET /health, GET /metadata.
POST /predict, where the load goes, is a plain ASGI function in front of the FastAPI app: FastAPI's
routing and middleware cost a request as much CPU as the rest of its HTTP work (docs/serving.md).

Requests go into a queue; one batcher task takes the first waiting request, adds those already
waiting and those that arrive within `max_wait_ms`, up to `max_batch_size` texts, but stops waiting
once every open connection has its request in the batch (no one else could join it). It runs the
model on them in one worker thread, so the event loop keeps accepting and answering while it runs;
then it hands each request its slice of the results. Errors are JSON {"error": "..."} with a 4xx status for
bad requests (400 invalid JSON, 413 body too large, 422 wrong or missing fields, empty or too many
texts) and 500 for a failure of the model; the server keeps serving after each. SIGTERM or Ctrl-C
stops accepting connections, lets the requests in flight finish, and exits 0.

On a CPU under Linux several such server processes share the port (`serve_processes`), each with its
own socket: one process's event loop leaves the CPUs part idle at many clients (docs/serving.md).
"""

import asyncio
import contextlib
import dataclasses
import gc
import inspect
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from transformer_cli import __version__
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import CPU_WORKERS, Loaded, load_for_inference, predict_loaded, warm_up
from transformer_cli.fileio import read_json
from transformer_cli.runtime import resolve_device

USAGE = 'send {"texts": ["a review", ...]}'


@dataclasses.dataclass(frozen=True)
class Limits:
    """How requests are batched and how large one may be."""

    max_batch_size: int = 64  # texts in one model call, gathered over requests
    max_wait_ms: float = 2.0  # how long the first request of a batch waits for others to join it
    max_texts: int = 64  # texts in one request
    max_body_bytes: int = 1_000_000  # size of one request's body
    batch_size: int = 64  # texts per forward pass within a model call (as `tfm predict --batch-size`)
    drain_timeout: float = 30.0  # seconds SIGTERM waits for requests in flight (a stalled upload) before closing

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, zero_ok = getattr(self, field.name), field.name == "max_wait_ms"
            if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
                raise UsageError(f"--{field.name.replace('_', '-')} must be a finite number "
                                 f"{'of 0 or more' if zero_ok else 'above 0'}, not {value}")


def serve(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, limits: Limits = Limits(),
          device: str = "auto", precision: str | None = None, workers: int | None = None,
          on_ready: Callable[[str], None] = print) -> None:
    """Load the model, open the port, serve until SIGTERM or Ctrl-C. `on_ready` gets the URL once the
    server accepts requests (port 0: a free port, named there). `workers` server processes share the
    port (None: default_workers); each loads the model and batches the requests that reach it."""
    _require("fastapi", "uvicorn")
    workers = default_workers(device) if workers is None else workers
    if workers < 1:
        raise UsageError(f"--workers must be 1 or more, not {workers}")
    if workers == 1:
        serve_here(model_dir, lambda: bind(host, port), limits, device, precision, workers, on_ready)
    else:
        serve_processes(model_dir, host, port, limits, device, precision, workers, on_ready)


def default_workers(device: str) -> int:
    """Server processes `tfm serve` starts by default: on a CPU under Linux, one per torch thread up to
    evaluate's CPU_WORKERS; one process has a single event loop, whose work per request leaves the
    CPUs part idle at many clients (docs/serving.md). Elsewhere 1: a GPU runs one batch at a time
    anyway, and other systems' SO_REUSEPORT does not spread connections over processes."""
    if not sys.platform.startswith("linux") or resolve_device(device).type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), CPU_WORKERS))


def serve_here(model_dir: str | Path, open_socket: Callable[[], socket.socket], limits: Limits, device: str,
               precision: str | None, workers: int, on_ready: Callable[[str], None]) -> None:
    """Serve in this process on the socket `open_socket()` makes once the model is loaded and warm."""
    import uvicorn

    loaded = load_for_inference(model_dir, device, precision)
    warm_up(loaded, limits.batch_size)  # first-call costs (allocator, oneDNN's kernels) paid before serving
    metadata = model_metadata(model_dir, loaded, limits, workers)
    sock = open_socket()
    url = f"http://{_url_host(sock.getsockname()[0])}:{sock.getsockname()[1]}"
    server = None  # made below, with the app; the batcher asks it how many connections are open
    app = make_app(loaded, metadata, limits, lambda: on_ready(url), lambda: open_connections(server))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=limits.drain_timeout)
    logging.getLogger("uvicorn.error").addFilter(_no_cancelled_traceback)  # after Config, which sets up the loggers
    server = server_class()(config)
    gc.collect()  # startup's garbage goes now, and what it kept (torch, the model, the app) leaves the
    gc.freeze()  # collector, whose full passes over it stalled every request in flight (docs/serving.md)
    server.run(sockets=[sock])  # run, not asyncio.run(serve): it sets up uvloop where installed


def serve_processes(model_dir: str | Path, host: str, port: int, limits: Limits, device: str,
                    precision: str | None, workers: int, on_ready: Callable[[str], None]) -> None:
    """Serve from `workers` processes, each listening on host:port with SO_REUSEPORT, where the kernel
    hands each new connection to one of them, and each with an even share of the torch threads. This
    process starts them, says ready once all are, passes SIGTERM and Ctrl-C on to them, and fails
    (stopping the rest) when one of them fails."""
    if not sys.platform.startswith("linux"):
        raise UsageError(f"--workers {workers} needs Linux, whose SO_REUSEPORT spreads connections over "
                         "processes; pass --workers 1")
    import multiprocessing

    probe = bind(host, port, listen=False)  # fails as one process's bind would, with the port in use
    address, port = probe.getsockname()[:2]  # port 0: the free one the processes share
    probe.close()
    reserved = bind(host, port, reuse_port=True, listen=False)  # the port is ours until the processes listen
    threads = max(1, torch.get_num_threads() // workers)
    spawn = multiprocessing.get_context("spawn")  # not fork: torch's thread pools do not survive a fork
    processes, pipes = [], []
    try:
        for _ in range(workers):
            ours, theirs = spawn.Pipe()
            process = spawn.Process(target=_serve_process, name="tfm-serve", args=(
                theirs, model_dir, host, port, limits, device, precision, workers, threads))
            process.start()
            theirs.close()
            processes.append(process)
            pipes.append(ours)  # kept open while serving: a process whose pipe closes stops
        for pipe in pipes:
            try:
                failure = pipe.recv()  # None once the process serves
            except EOFError:
                raise TfmError("a server process exited while starting (its error is above)") from None
            if failure is not None:
                raise failure
    except BaseException:
        for process in processes:
            process.terminate()
            process.join()
        raise
    finally:
        reserved.close()
    on_ready(f"http://{_url_host(address)}:{port}")
    _supervise(processes)


def _serve_process(pipe, model_dir, host, port, limits, device, precision, workers, threads) -> None:
    """A server process of serve_processes: serve, and say on `pipe` when ready or why not."""
    os.setpgid(0, 0)  # out of the terminal's process group: Ctrl-C reaches the parent, which passes it on once
    torch.set_num_threads(threads)
    threading.Thread(target=_stop_with_parent, args=(pipe,), daemon=True).start()
    try:
        serve_here(model_dir, lambda: bind(host, port, reuse_port=True), limits, device, precision, workers,
                   lambda url: pipe.send(None))
    except TfmError as e:
        pipe.send(e)
        sys.exit(e.exit_code)


def _stop_with_parent(pipe) -> None:
    """SIGTERM this process (draining as usual) once its parent is gone: its end of `pipe` then closes."""
    with contextlib.suppress(EOFError, OSError):
        pipe.recv()  # the parent sends nothing
    os.kill(os.getpid(), signal.SIGTERM)


def _supervise(processes: list) -> None:
    """Wait for the server processes, passing SIGTERM and SIGINT on to them; if one fails, stop the rest
    and raise. Returns once all have exited 0 (after a signal, having drained their requests)."""
    from multiprocessing.connection import wait

    stopping = False

    def stop(signum, frame=None) -> None:
        nonlocal stopping
        stopping = True
        for process in processes:
            if process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    failed = None
    try:
        running = list(processes)
        while running:
            wait([process.sentinel for process in running])
            for process in [process for process in running if not process.is_alive()]:
                running.remove(process)
                if process.exitcode != 0 and failed is None:
                    failed = process
                    if not stopping:
                        stop(signal.SIGTERM)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failed is not None:
        code = failed.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        raise TfmError(f"server process {failed.pid} {how}; the others were stopped")


def open_connections(server) -> float:
    """How many HTTP connections uvicorn's `server` holds open now. uvicorn's protocols keep them in
    `server_state.connections`, which it does not document: where a uvicorn has no such set, the
    count is infinite, which no batch reaches, so each batch waits out --max-wait-ms instead."""
    connections = getattr(getattr(server, "server_state", None), "connections", None)
    return math.inf if connections is None else len(connections)


def _no_cancelled_traceback(record: logging.LogRecord) -> bool:
    """Leave out the traceback uvicorn logs for a request it cancelled at the drain timeout (a stalled
    upload): its own line before it ("Cancel N running task(s)...") says what happened."""
    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def _require(*modules: str) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise TfmError(f"tfm serve needs 'pip install transformer-cli[serve]' ({e})") from None


def bind(host: str, port: int, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A TCP socket on host:port, listening unless told not to, or a one-line error saying why not.
    `reuse_port`: shared with this user's other sockets that set it (SO_REUSEPORT, Linux)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host '{host}' is not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
        if listen:
            sock.listen(2048)
    except OSError as e:
        sock.close()
        raise TfmError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or --host") from None
    sock.setblocking(False)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def model_metadata(model_dir: str | Path, loaded: Loaded, limits: Limits, workers: int) -> dict:
    """GET /metadata: labels, the model's sizes, the training run's metrics.json and how it is served."""
    rt, model, cfg, _, labels, temperature = loaded
    metrics_path = Path(model_dir) / "metrics.json"
    try:
        metrics = read_json(metrics_path, "metrics") if metrics_path.is_file() else None
    except TfmError:
        metrics = None
    return {
        "version": __version__,
        "labels": labels,
        "model": {**dataclasses.asdict(cfg.model), "vocab_size": model.encoder.tok_emb.num_embeddings,
                  "num_params": model.num_params()},
        "data": {"max_length": cfg.data.max_length, "truncation": cfg.data.truncation,
                 "head_fraction": cfg.data.head_fraction},
        "device": str(rt.device),
        "compute_dtype": rt.precision,
        "temperature": temperature,  # the calibration that predictions divide the logits by
        "training_metrics": metrics,
        "limits": dataclasses.asdict(limits),
        "workers": workers,  # server processes, each answering the connections the kernel hands it
    }


class Batcher:
    """Gathers concurrent requests' texts into model calls run in one worker thread."""

    def __init__(self, predict: Callable[[list[str]], list[dict]], limits: Limits,
                 open_connections: Callable[[], float]):
        self.predict, self.limits, self.open_connections = predict, limits, open_connections
        self.queue: asyncio.Queue = asyncio.Queue()
        self.held = None  # a request that did not fit into the last batch: it starts the next one
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="tfm-model")
        self.in_flight = self.requests = self.batches = 0  # GET /health shows them

    async def __call__(self, texts: list[str]) -> list[dict]:
        future = asyncio.get_running_loop().create_future()
        self.in_flight += 1
        try:
            await self.queue.put((texts, future))
            return await future
        finally:
            self.in_flight -= 1
            self.requests += 1

    async def run(self) -> None:
        while True:
            await self._run_batch(await self._gather())

    async def _gather(self) -> list[tuple]:
        """The next batch: the first waiting request, and those waiting or coming within max_wait_ms that
        fit. It stops waiting once the batch holds a request of every open connection: an HTTP/1.1
        connection has one request at a time, so no one else can join, and a lone client's requests,
        or the next round of many clients', go to the model at once."""
        loop = asyncio.get_running_loop()
        first = self.held if self.held is not None else await self.queue.get()
        self.held = None
        batch, n = [first], len(first[0])
        deadline = loop.time() + self.limits.max_wait_ms / 1000
        while n < self.limits.max_batch_size:
            if self.queue.empty() and len(batch) >= self.open_connections():
                break
            item = await self._next(deadline - loop.time())
            if item is None:
                break
            if n + len(item[0]) > self.limits.max_batch_size:
                self.held = item
                break
            batch.append(item)
            n += len(item[0])
        return batch

    async def _next(self, timeout: float):
        """A waiting request, or one that arrives within `timeout` seconds; None if none does."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        if timeout <= 0:
            return None
        getter = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({getter}, timeout=timeout)
        if not getter.done():
            getter.cancel()
        try:
            return await getter  # an item that came as it was cancelled is kept, not lost
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            return None

    async def _run_batch(self, batch: list[tuple]) -> None:
        batch = [(request, future) for request, future in batch if not future.done()]  # done: its client went away
        if not batch:
            return
        texts = [t for request, _ in batch for t in request]
        self.batches += 1
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self.worker, self.predict, texts)
        except Exception as e:  # noqa: BLE001 (handed to each request, which answers 500; serving goes on)
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        start = 0
        for request, future in batch:
            if not future.done():  # done: the client went away while the model ran
                future.set_result(results[start : start + len(request)])
            start += len(request)


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def make_app(loaded: Loaded, metadata: dict, limits: Limits, on_ready: Callable[[], None],
             open_connections: Callable[[], float]):
    """The ASGI app around a model from load_for_inference: /predict (`predict`) in front of a FastAPI app
    with the other routes and the 404/405 answers to the rest. `open_connections()`: how many HTTP
    connections the server holds open now."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, ValidationError
    from starlette.exceptions import HTTPException

    class PredictRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        texts: list[str]

    batcher = Batcher(lambda texts: predict_loaded(loaded, texts, limits.batch_size), limits, open_connections)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher.run())
        on_ready()
        try:
            yield
        finally:  # uvicorn has let the requests in flight finish
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            batcher.worker.shutdown(wait=True)

    app = FastAPI(title="tfm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, **no_telemetry(FastAPI))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # 404, 405
        return JSONResponse({"error": route_error(e.detail, request.method, request.url.path)}, e.status_code)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "pid": os.getpid(), "in_flight": batcher.in_flight,  # counts: this process's
                "requests": batcher.requests, "batches": batcher.batches}

    @app.get("/metadata")
    async def get_metadata() -> dict:
        return metadata

    async def predict(scope, receive, send) -> None:
        """{"texts": [...]} -> {"predictions": [one object per text]}, or {"error": "..."} with its status."""
        try:
            if scope["method"] != "POST":
                raise ApiError(405, route_error("Method Not Allowed", scope["method"], scope["path"]))
            body = await read_body(scope, receive, limits.max_body_bytes)
            try:
                texts = PredictRequest.model_validate_json(body).texts
            except ValidationError as e:
                raise validation_error(e) from None
            check_texts(texts, limits.max_texts)
            answer = asyncio.ensure_future(batcher(texts))
            gone = asyncio.ensure_future(disconnected(receive))
            try:
                await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not answer.done():  # the client went away: its texts leave the queue before the model reads them
                answer.cancel()
                raise ApiError(400, "the client closed the connection before its answer")  # sent to no one
            try:
                status, answered = 200, {"predictions": answer.result()}
            except Exception as e:  # noqa: BLE001 (a failure of the model: this request fails, the server serves on)
                raise ApiError(500, f"prediction failed: {type(e).__name__}: {e}") from None
        except ApiError as e:
            status, answered = e.status, {"error": str(e)}
        payload = json.dumps(answered).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def serve_app(scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/predict":
            await predict(scope, receive, send)
        else:
            await app(scope, receive, send)

    return serve_app


def no_telemetry(fastapi_class) -> dict:
    """FastAPI's options that turn its own OpenTelemetry off, where it has it (newer versions): tfm serve
    exports no traces or metrics, yet FastAPI looks for a configured provider on every request, which
    the event loop's time per request at many clients can ill afford (docs/serving.md)."""
    if "telemetry" not in inspect.signature(fastapi_class).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


def route_error(detail: str, method: str, path: str) -> str:
    return f"{detail}: {method} {path}; this server has POST /predict, GET /health and GET /metadata"


async def read_body(scope, receive, limit: int) -> bytes:
    """The request's body, refused with 413 as soon as it is known to be over `limit` bytes."""
    declared = dict(scope["headers"]).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared)} bytes is over the limit of {limit} (--max-body-bytes)")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":  # gone during its upload: nothing to answer
            raise ApiError(400, "the client closed the connection during its request body")
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes (--max-body-bytes)")
        if not message.get("more_body", False):
            return b"".join(chunks)


async def disconnected(receive) -> None:
    """Returns once the client has closed the connection (its body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def validation_error(e) -> ApiError:
    """pydantic's first complaint about the body, as one line."""
    first = e.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])}); "
                        f"{USAGE}")
    where = ".".join(str(part) for part in first["loc"]) or "body"
    if first["type"] == "missing":
        return ApiError(422, f"'{where}' is missing; {USAGE}")
    return ApiError(422, f"'{where}': {first['msg']}; {USAGE}")


def check_texts(texts: list[str], max_texts: int) -> None:
    if not texts:
        raise ApiError(422, f"'texts' is empty; {USAGE}")
    if len(texts) > max_texts:
        raise ApiError(422, f"{len(texts)} texts in one request; at most {max_texts} (--max-texts)")
    for i, text in enumerate(texts):
        if not text.strip():
            raise ApiError(422, f"texts[{i}] is empty; every text must be a non-empty review")


def server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose SIGTERM or Ctrl-C ends in exit code 0 after the graceful shutdown
        (uvicorn's own raises the signal again once it is done)."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return Server

