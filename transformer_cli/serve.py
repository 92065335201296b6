"""`tfm serve`: a trained model behind HTTP (FastAPI on uvicorn), loaded once, with concurrent requests batched.

Routes: POST /predict {"texts": [...]} -> {"predictions": [one object per text, as `tfm predict --json` prints
it]}, GET /health, GET /metadata. Requests go into a queue; a batcher task gathers those that come together into
one model call, run in one worker thread so that the event loop keeps answering meanwhile. Errors are JSON
{"error": "..."}: 400 invalid JSON, 413 body too large, 422 wrong or missing fields, empty or too many texts,
404 and 405 for other routes, 500 for a failure of the model; the server keeps serving after each. SIGTERM or
Ctrl-C stops accepting connections, lets the requests in flight finish, and returns. With `workers` above 1,
uvicorn runs that many server processes on the port, each loading the model and batching its own requests.
"""

import asyncio
import contextlib
import dataclasses
import http.client
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from transformer_cli import __version__
from transformer_cli.data import HEAD_SHARE
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import Loaded, load_for_inference, predict_loaded, warm_up
from transformer_cli.fileio import read_json

USAGE = 'send {"texts": ["a review", ...]}'
SETTINGS = "TFM_SERVE"  # environment variable: serve()'s arguments, for the app of each of uvicorn's processes


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
          device: str = "auto", precision: str | None = None, workers: int = 1,
          on_ready: Callable[[str], None] = print) -> None:
    """Load the model, open the port, serve until SIGTERM or Ctrl-C. `on_ready` gets the URL once requests are
    answered (port 0: a free port, named there). `workers` above 1: uvicorn's server processes, each with the
    model and an even share of the torch threads; `on_ready` is called once the first of them answers."""
    _require("fastapi", "uvicorn")
    if workers < 1:
        raise UsageError(f"--workers must be 1 or more, not {workers}")
    if workers > 1 and port == 0:
        raise UsageError(f"--workers {workers} needs a --port other than 0 (uvicorn's processes pick no free port)")
    import uvicorn

    loaded = load_for_inference(model_dir, device, precision)  # a bad directory fails here, before anything listens
    sock = bind(host, port)
    url = f"http://{_url_host(sock.getsockname()[0])}:{sock.getsockname()[1]}"
    options = {"log_level": "warning", "access_log": False, "lifespan": "on",
               "timeout_graceful_shutdown": limits.drain_timeout}
    if workers > 1:
        sock.close()  # bound only to fail here, in one line, where the port is taken; uvicorn binds it again
        del loaded  # each process loads its own
        os.environ[SETTINGS] = json.dumps({
            "model_dir": str(model_dir), "device": device, "precision": precision, "workers": workers,
            "limits": dataclasses.asdict(limits), "threads": max(1, torch.get_num_threads() // workers)})
        ready = threading.Event()
        threading.Thread(target=_say_when_answering, args=(host, port, ready, lambda: on_ready(url)),
                         daemon=True).start()
        uvicorn.run("transformer_cli.serve:app_from_environment", factory=True, host=host, port=port,
                    workers=workers, **options)
        if not ready.is_set():
            raise TfmError("the server processes stopped before answering a request")
        return
    warm_up(loaded, limits.batch_size)  # first-call costs paid before the first request
    server = None  # made below, with the app; the batcher asks it how many connections are open
    app = make_app(loaded, model_metadata(model_dir, loaded, limits, workers), limits, lambda: on_ready(url),
                   lambda: open_connections(server))
    server = uvicorn.Server(uvicorn.Config(app, **options))
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C, not cli.py's error
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the signal again once it has shut down gracefully: a clean stop
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def app_from_environment():
    """The app of one of uvicorn's server processes (serve with `workers` above 1), from serve's SETTINGS."""
    settings = json.loads(os.environ[SETTINGS])
    torch.set_num_threads(settings["threads"])
    limits = Limits(**settings["limits"])
    loaded = load_for_inference(settings["model_dir"], settings["device"], settings["precision"])
    warm_up(loaded, limits.batch_size)
    # uvicorn does not show the app its server's open connections: each batch waits out max_wait_ms
    return make_app(loaded, model_metadata(settings["model_dir"], loaded, limits, settings["workers"]), limits)


def _say_when_answering(host: str, port: int, ready: threading.Event, on_ready: Callable[[], None]) -> None:
    """Set `ready` and call `on_ready()` once a server process answers GET /health on host:port."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)  # every interface: loopback
    while True:
        connection = http.client.HTTPConnection(host, port, timeout=10)
        with contextlib.suppress(OSError, http.client.HTTPException):
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                break
        connection.close()
        time.sleep(0.1)
    connection.close()
    ready.set()
    on_ready()


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


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, or a one-line error saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host '{host}' is not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
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
        "data": {"max_length": cfg.data.max_length, "truncation": cfg.data.truncation, "head_fraction": HEAD_SHARE},
        "device": str(rt.device),
        "compute_dtype": rt.precision,
        "temperature": temperature,  # the calibration that predictions divide the logits by
        "training_metrics": metrics,
        "limits": dataclasses.asdict(limits),
        "workers": workers,  # server processes, each answering the connections that reach it
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


def make_app(loaded: Loaded, metadata: dict, limits: Limits, on_ready: Callable[[], None] = lambda: None,
             open_connections: Callable[[], float] = lambda: math.inf):
    """The FastAPI app around a model from load_for_inference. `on_ready()` is called once it serves;
    `open_connections()`: how many HTTP connections the server holds open now."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, ValidationError
    from starlette.exceptions import HTTPException

    class PredictRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        texts: list[str]

    class Prediction(BaseModel):
        label: str
        score: float
        probabilities: dict[str, float]

    class PredictResponse(BaseModel):
        predictions: list[Prediction]

    batcher = Batcher(lambda texts: predict_loaded(loaded, texts, limits.batch_size), limits, open_connections)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        logging.getLogger("uvicorn.error").addFilter(_no_cancelled_traceback)
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
                  openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse({"error": str(e)}, e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # 404, 405
        return JSONResponse({"error": route_error(e.detail, request.method, request.url.path)}, e.status_code,
                            headers=e.headers)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "pid": os.getpid(), "in_flight": batcher.in_flight,  # counts: this process's
                "requests": batcher.requests, "batches": batcher.batches}

    @app.get("/metadata")
    async def get_metadata() -> dict:
        return metadata

    @app.post("/predict", response_model=PredictResponse)
    async def predict(request: Request):
        """{"texts": [...]} -> {"predictions": [one object per text]}, or {"error": "..."} with its status."""
        body = await read_body(request, limits.max_body_bytes)
        try:
            texts = PredictRequest.model_validate_json(body).texts
        except ValidationError as e:
            raise validation_error(e) from None
        check_texts(texts, limits.max_texts)
        answer = asyncio.ensure_future(batcher(texts))
        gone = asyncio.ensure_future(disconnected(request.receive))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():  # the client went away: its texts leave the queue before the model reads them
            answer.cancel()
            raise ApiError(400, "the client closed the connection before its answer")  # sent to no one
        try:
            return {"predictions": answer.result()}
        except Exception as e:  # noqa: BLE001 (a failure of the model: this request fails, the server serves on)
            raise ApiError(500, f"prediction failed: {type(e).__name__}: {e}") from None

    return app


def route_error(detail: str, method: str, path: str) -> str:
    return f"{detail}: {method} {path}; this server has POST /predict, GET /health and GET /metadata"


async def read_body(request, limit: int) -> bytes:
    """The request's body, refused with 413 as soon as it is known to be over `limit` bytes."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared)} bytes is over the limit of {limit} (--max-body-bytes)")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body is over the limit of {limit} bytes (--max-body-bytes)")
    except ClientDisconnect:  # gone during its upload: nothing to answer
        raise ApiError(400, "the client closed the connection during its request body") from None
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
