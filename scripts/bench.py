"""tfm against what a user would pick instead, timed in one process on one machine.

    python scripts/bench.py train [--config configs/seed.toml] [--data path/to/imdb]
    python scripts/bench.py infer [--config configs/seed.toml] [--data path/to/imdb]
    python scripts/bench.py train --config configs/cpu-pretrain.toml   # the CPU pair's encoder sizes
    python scripts/bench.py serve -c RUN [--data path/to/imdb]

train and infer time tfm's CTransformer against Hugging Face transformers' BertForSequenceClassification
at the same sizes, dropout (none on attention weights), precision (bf16 autocast on CUDA and on a CPU
with native bf16, else fp32) and SDPA attention, on the same token ids and masks; untrained, speed only:
  (a) equal work: batches of random ids, --seq-len tokens each (tfm's word dropout off); steps/s.
  (b) --samples train reviews of --data, encoded by a WordPiece tokenizer trained on them, each side
      batched as its users run it; reviews/s. Training: tfm's length-bucketed batches with its recipe's
      word dropout, HF's random batches padded to their longest (as HF Trainer); inference: tfm as
      `tfm evaluate` runs it (all_logits), HF's batches in order, padded to their longest.
The sides alternate over --rounds rounds; each figure is the median round, with the ratio tfm / HF.

serve load-tests `tfm serve -c RUN`: p99 latency of a 200-word review at 1 client; reviews/s at --clients
clients against `tfm evaluate`'s reviews/s on the same reviews in this process; --malformed bad requests
in the load each get a JSON 4xx while no good one fails; SIGTERM ends the server with exit code 0. Exit
code 1 when one of those fails.

transformers is not one of tfm's dependencies: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from transformer_cli.errors import TfmError
from transformer_cli.runtime import hardware, make_runtime
from transformer_cli.tokens import CLS_ID, PAD_ID

MAX_TEXTS, MAX_BODY = 64, 100_000  # the server's --max-texts and --max-body-bytes here


def need_transformers():
    try:
        import transformers
    except ImportError:
        raise TfmError('this benchmark needs Hugging Face transformers: pip install -e ".[bench]"') from None
    return transformers


# --------------------------------------------------------------------------- the two models


def models(cfg, vocab: int, max_length: int, num_labels: int, seed: int, **changes) -> tuple:
    """tfm's CTransformer (its model config with `changes`) and BertForSequenceClassification at its sizes, with
    its dropout and none on the attention weights."""
    from transformer_cli.model import CTransformer

    t, m = need_transformers(), replace(cfg.model, **changes)
    config = t.BertConfig(vocab_size=vocab, hidden_size=m.d_model, num_hidden_layers=m.n_layers,
                          num_attention_heads=m.n_heads, intermediate_size=m.ff_mult * m.d_model,
                          max_position_embeddings=max_length, hidden_dropout_prob=m.dropout,
                          attention_probs_dropout_prob=0.0, num_labels=num_labels, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return CTransformer(m, vocab, max_length, num_labels), t.BertForSequenceClassification(config)


def params(model) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"


def steps_of(tfm, hf, rt, tc, training: bool) -> dict:
    """Each side's step on a batch (ids, mask, labels). Training: forward, backward, clipping at
    train.grad_clip, fused AdamW (tfm train's and HF Trainer's default optimizer); returns the loss.
    Inference: the logits, on the CPU."""
    if not training:
        def predictor(model, logits_of):
            model.to(rt.device).eval()

            def step(batch) -> torch.Tensor:
                with torch.inference_mode(), rt.autocast():
                    return logits_of(batch).float().cpu()
            return step

        return {"tfm": predictor(tfm, lambda b: tfm(b[0], b[1])),
                "HF": predictor(hf, lambda b: hf(input_ids=b[0], attention_mask=b[1]).logits)}

    def trainer(model, loss_of):
        model.to(rt.device).train()
        fused = rt.device.type in ("cpu", "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, fused=fused, foreach=None if fused else True)

        def step(batch) -> float:
            opt.zero_grad(set_to_none=True)
            with rt.autocast():
                loss = loss_of(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
            opt.step()
            return loss.item()
        return step

    return {"tfm": trainer(tfm, lambda b: tfm(*b)[1]),
            "HF": trainer(hf, lambda b: hf(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss)}


def random_batches(n: int, batch_size: int, seq_len: int, vocab: int, seed: int, device) -> list[tuple]:
    """(a)'s batches (ids, mask, labels): [CLS], then random ids past the special tokens; no padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, batch_size, seq_len), generator=g)
    ids[:, :, 0] = CLS_ID
    labels = torch.randint(0, 2, (n, batch_size), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)
    return [(ids[i].to(device), mask, labels[i].to(device)) for i in range(n)]


def padded(enc, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch padded to its longest review (HF's DataCollatorWithPadding): ids, mask, labels."""
    lengths = enc.lengths[idx]
    ids = np.full((len(idx), int(lengths.max())), PAD_ID, dtype=np.int64)
    for row, (i, n) in enumerate(zip(idx, lengths)):
        ids[row, :n] = enc.ids[enc.offsets[i] : enc.offsets[i] + n]
    return ids, np.arange(ids.shape[1])[None, :] < lengths[:, None], enc.labels[idx]


def review_sample(cfg, data: str, n: int, seed: int, max_length: int):
    """(b)'s reviews: a seeded sample of n train reviews of `data`, encoded (cut to max_length as tfm cuts them)
    by a WordPiece tokenizer trained on them; (Encoded, vocabulary size, number of classes)."""
    from transformer_cli.data import Encoded, encode_texts, load_splits, train_tokenizer

    raw, names = load_splits(replace(cfg.data, source=data), ("train",))
    train = raw["train"]
    sample = train.subset(np.sort(np.random.default_rng(seed).permutation(len(train))[:n]))
    tok = train_tokenizer(sample.texts, cfg.data)
    d = cfg.data
    ids, offsets = encode_texts(tok, sample.texts, max_length, d.truncation)
    return Encoded(ids, offsets, sample.labels), tok.get_vocab_size(), len(names)


def timed(run, r: int, device) -> float:
    t0 = time.perf_counter()
    run(r)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def compare(what: str, unit: str, count: int, sides: dict, rounds: int, device) -> float:
    """Time each side's pass (sides: name -> function of the round that runs it), alternating, `rounds` times;
    print each side's `count` units over its median pass, per second, and the ratio tfm / HF."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:  # each side goes first in every other round
            seconds[name].append(timed(sides[name], r, device))
    rates = {name: count / statistics.median(s) for name, s in seconds.items()}
    for name, s in seconds.items():
        print(f"  {name:<5} {rates[name]:10.2f} {unit}/s  (median of {rounds}; rounds "
              + ", ".join(f"{count / x:.2f}" for x in s) + ")")
    ratio = rates["tfm"] / rates["HF"]
    print(f"  ratio {what}, tfm / HF: {ratio:.2f}x")
    return ratio


def equal_work(args, cfg, rt, training: bool) -> float:
    """(a): the same random batches through both models; steps/s and the ratio."""
    vocab, positions = cfg.data.vocab_size, max(cfg.data.max_length, args.seq_len)
    tfm, hf = models(cfg, vocab, positions, 2, args.seed, token_dropout=0.0)
    batches = random_batches(args.warmup + args.steps, args.batch_size, args.seq_len, vocab, args.seed, rt.device)
    steps = steps_of(tfm, hf, rt, cfg.train, training)
    for step in steps.values():
        for b in batches[: args.warmup]:
            step(b)
    work = "forward + backward + AdamW step" if training else "forward in inference mode"
    print(f"\n(a) equal work: {work}, batch {args.batch_size} x {args.seq_len} random ids (no padding), "
          f"{args.steps} timed steps after {args.warmup} warm-up, {rt.precision}; tfm {params(tfm)} (word dropout "
          f"off), HF {params(hf)}")
    passes = {name: lambda r, step=step: [step(b) for b in batches[args.warmup :]] for name, step in steps.items()}
    return compare("steps/s (a)", "steps", args.steps, passes, args.rounds, rt.device)


def real_reviews(args, cfg, rt, training: bool) -> float:
    """(b): both models on the same encoded reviews, each batched as its users run it; reviews/s and the ratio."""
    from transformer_cli.data import BucketSampler, collate

    d, tc = cfg.data, cfg.train
    length = (d.train_max_length or d.max_length) if training else d.max_length
    enc, vocab, k = review_sample(cfg, args.data, args.samples, args.seed, length)
    tfm, hf = models(cfg, vocab, d.max_length, k, args.seed)
    n, batch = len(enc), (args.batch_size if training else tc.eval_batch_size)
    print(f"\n(b) {n} train reviews of {args.data}, {enc.lengths.mean():.0f} tokens on average (cut to {length}), "
          f"vocabulary {vocab}, batches of {batch}, {rt.precision}; tfm {params(tfm)}, HF {params(hf)}")

    def tensors(arrays) -> tuple:
        return tuple(torch.from_numpy(a).to(rt.device) for a in arrays)

    steps = steps_of(tfm, hf, rt, tc, training)
    if training:  # an epoch a round, its batches made before the clock starts, and an untimed one first
        sampler = BucketSampler(enc.lengths, batch, args.seed)
        orders = [np.random.default_rng([args.seed, r]).permutation(n) for r in range(args.rounds + 1)]
        epochs = {"tfm": [[tensors(collate(enc, i)) for i in sampler.batches(r)] for r in range(args.rounds + 1)],
                  "HF": [[tensors(padded(enc, o[i : i + batch])) for i in range(0, n, batch)] for o in orders]}
        passes = {name: lambda r, name=name: [steps[name](b) for b in epochs[name][r]] for name in steps}
        print(f"  tfm: BucketSampler batches, model.token_dropout = {cfg.model.token_dropout}; "
              "HF: random batches padded to their longest")
    else:
        from transformer_cli.evaluate import all_logits

        passes = {"tfm": lambda r: all_logits(tfm, enc, rt, batch, k),
                  "HF": lambda r: [steps["HF"](tensors(padded(enc, np.arange(i, min(n, i + batch)))))
                                   for i in range(0, n, batch)]}
        print("  tfm: `tfm evaluate`'s all_logits (length-sorted batches under a token budget); "
              "HF: batches in order, padded to their longest")
    for run in passes.values():
        run(args.rounds)  # untimed: the first pass of each batch width builds its kernels
    return compare("reviews/s (b)", "reviews", n, passes, args.rounds, rt.device)


def bench_model(args, training: bool) -> int:
    from transformer_cli.config import load_config

    cfg = load_config(args.config)
    need_transformers()
    rt = make_runtime(args.device, args.precision)
    print(f"{'training' if training else 'inference'}, recipe {args.config or 'default (built-in)'}: d_model "
          f"{cfg.model.d_model}, {cfg.model.n_heads} heads, {cfg.model.n_layers} layers, ff {cfg.model.ff_mult}x, "
          f"dropout {cfg.model.dropout}, on {rt.device}")
    equal_work(args, cfg, rt, training)
    if args.samples:
        real_reviews(args, cfg, rt, training)
    return 0


# --------------------------------------------------------------------------- serve


def malformed_requests(count: int, rng: random.Random) -> list[bytes]:
    """`count` bodies that `tfm serve` must refuse with a 4xx, every kind about as often, shuffled."""
    kinds = [
        b'{"texts": ["an unfinished',  # invalid JSON
        b"",  # no body
        b'{"review": ["a good film"]}',  # no texts
        b'{"texts": "a good film"}',  # not a list
        b'{"texts": ["a good film", 42]}',  # not strings
        b'{"texts": []}',  # no review
        b'{"texts": ["   "]}',  # an empty review
        json.dumps({"texts": ["a good film"] * (MAX_TEXTS + 1)}).encode(),  # too many texts
        json.dumps({"texts": ["x" * MAX_BODY]}).encode(),  # a body over the limit
    ]
    bodies = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(bodies)
    return bodies


def post_all(host: str, port: int, bodies: list[bytes], clients: int) -> tuple[float, list[tuple]]:
    """POST each body to /predict from `clients` threads, each on its own keep-alive connection;
    (seconds, [(latency, status, answer)] in order). A request that fails gets status 0."""
    local, connections = threading.local(), []

    def post(body: bytes) -> tuple:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(host, port, timeout=60)
            connections.append(local.conn)
        t0 = time.perf_counter()
        try:
            local.conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
            response = local.conn.getresponse()
            answer = response.read()
            return time.perf_counter() - t0, response.status, answer
        except (OSError, http.client.HTTPException):
            local.conn.close()  # the next request connects again
            return time.perf_counter() - t0, 0, b""

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(post, bodies))
    seconds = time.perf_counter() - t0
    for conn in connections:
        conn.close()
    return seconds, results


def answered(result: tuple, texts: int) -> bool:
    """Whether a request of `texts` reviews (0: a malformed one) got the right answer: one prediction a
    review, or a JSON error with a 4xx status."""
    _, status, answer = result
    try:
        body = json.loads(answer)
        return len(body["predictions"]) == texts if texts else 400 <= status < 500 and "error" in body
    except (ValueError, KeyError, TypeError):
        return False


def start_server(run: Path, device: str) -> tuple[subprocess.Popen, str, int]:
    """`tfm serve -c RUN --port 0` on 127.0.0.1, once it says where it listens; its stderr drained meanwhile."""
    cmd = [sys.executable, "-m", "transformer_cli", "serve", "-c", str(run), "--host", "127.0.0.1", "--port", "0",
           "--max-texts", str(MAX_TEXTS), "--max-body-bytes", str(MAX_BODY), "--device", device]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def drain() -> None:  # all along: a full pipe would stall the server
        for line in proc.stderr:
            lines.put(line)
        lines.put("")

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + 300
    try:
        while line := lines.get(timeout=max(0.1, deadline - time.monotonic())):  # "" once the server ended
            if " on http://" in line:  # "tfm: serving RUN on http://HOST:PORT; stop with ..."
                host, port = line.split(" on http://", 1)[1].split(";")[0].rsplit(":", 1)
                return proc, host, int(port)
            sys.stderr.write(line)
    except queue.Empty:  # no word in 300 s
        pass
    proc.kill()
    proc.wait()
    raise TfmError("tfm serve did not start (its messages are above)")


def bench_serve(args) -> int:
    from transformer_cli.data import Encoded, encode_texts, load_splits
    from transformer_cli.evaluate import all_logits, load_for_inference

    loaded = load_for_inference(args.checkpoint, args.device, None)  # as tfm evaluate and tfm serve load it
    rt, model, cfg = loaded.rt, loaded.model, loaded.cfg
    raw, _ = load_splits(replace(cfg.data, source=args.data), (args.split,))
    rng = random.Random(args.seed)
    texts = rng.sample(raw[args.split].texts, min(args.samples, len(raw[args.split])))
    # a review of 200 words or more, cut to 200 (short reviews only: some joined)
    review = " ".join(next((t for t in texts if len(t.split()) >= 200), " ".join(texts)).split()[:200])

    d = cfg.data
    ids, offsets = encode_texts(loaded.tokenizer, texts, d.max_length, d.truncation)
    enc = Encoded(ids, offsets, np.zeros(len(texts), dtype=np.int64))

    def evaluate(_) -> None:
        all_logits(model, enc, rt, cfg.train.eval_batch_size, len(loaded.labels))

    evaluate(0)  # untimed: the kernels of each batch width
    evaluate_rate = len(texts) / timed(evaluate, 0, rt.device)
    print(f"\n{len(texts)} reviews of {args.data} [{args.split}]; model {args.checkpoint} ({rt.precision} on "
          f"{rt.device})\n  tfm evaluate's path in this process (all_logits, after encoding): "
          f"{evaluate_rate:.0f} reviews/s")

    proc, host, port = start_server(args.checkpoint, args.device)
    try:
        one = json.dumps({"texts": [review]}).encode()
        post_all(host, port, [one] * 5, 1)  # warm-up
        _, results = post_all(host, port, [one] * args.latency_requests, 1)
        latencies = sorted(r[0] for r in results if answered(r, 1))
        if not latencies:
            raise TfmError("tfm serve answered none of the 200-word requests")
        p99 = 1000 * latencies[math.ceil(0.99 * len(latencies)) - 1]  # nearest rank
        print(f"(1) one 200-word review a request, 1 client, {len(results)} requests: p50 "
              f"{1000 * statistics.median(latencies):.1f} ms, p99 {p99:.1f} ms")

        good = [json.dumps({"texts": [texts[i % len(texts)]]}).encode() for i in range(args.requests)]
        seconds, results = post_all(host, port, good, args.clients)
        served = sum(answered(r, 1) for r in results)
        print(f"(2) {args.requests} requests of one review, {args.clients} clients: {served / seconds:.0f} reviews/s; "
              f"ratio to tfm evaluate's reviews/s: {served / seconds / evaluate_rate:.2f}x")

        bodies = [(b, 1) for b in good] + [(b, 0) for b in malformed_requests(args.malformed, rng)]
        rng.shuffle(bodies)
        _, results = post_all(host, port, [b for b, _ in bodies], args.clients)
        bad_failed, good_failed = (sum(not answered(r, n) for r, (_, n) in zip(results, bodies) if n == kind)
                                   for kind in (0, 1))
        statuses = sorted({r[1] for r, (_, n) in zip(results, bodies) if n == 0})
        print(f"(3) {args.requests} good and {args.malformed} malformed requests mixed, {args.clients} clients: "
              f"malformed without a JSON 4xx: {bad_failed} (statuses {statuses}); good ones failed: {good_failed}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    print(f"(4) SIGTERM: tfm serve exited with code {code}")
    ok = bad_failed == 0 and good_failed == 0 and served == args.requests and code == 0
    print(f"correctness: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


# --------------------------------------------------------------------------- command line


def at_least(minimum: int):
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least {minimum}")
        return int(text)
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    one, none = at_least(1), at_least(0)
    for name in ("train", "infer"):
        p = sub.add_parser(name, help=f"{name}ing speed against BertForSequenceClassification")
        p.add_argument("--config", help="a tfm recipe (default: the built-in one)")
        p.add_argument("--data", default="stanfordnlp/imdb", help="(b)'s reviews: a Hub id or a local copy")
        p.add_argument("--samples", type=none, default=2000, help="(b)'s train reviews; 0 skips (b)")
        p.add_argument("--batch-size", type=one, default=32, help="(a)'s batches, and (b)'s in training")
        p.add_argument("--seq-len", type=one, default=256, help="(a)'s tokens per sequence")
        p.add_argument("--steps", type=one, default=10, help="(a)'s timed steps a round")
        p.add_argument("--warmup", type=none, default=2, help="(a)'s untimed steps first")
        p.add_argument("--rounds", type=one, default=3)
        p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
        p.add_argument("--device", default="cpu")
        p.add_argument("--threads", type=one, help="torch threads (default: torch's choice)")
        p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("serve", help="load test of tfm serve")
    p.add_argument("-c", "--checkpoint", type=Path, required=True, help="a `tfm train` output directory")
    p.add_argument("--data", default="stanfordnlp/imdb", help="the reviews: a Hub id or a local copy")
    p.add_argument("--split", default="test")
    p.add_argument("--samples", type=one, default=2000, help="reviews drawn from the split")
    p.add_argument("--latency-requests", type=one, default=200, help="(1)'s requests")
    p.add_argument("--requests", type=one, default=2000, help="(2)'s and (3)'s good requests")
    p.add_argument("--clients", type=one, default=32)
    p.add_argument("--malformed", type=none, default=1000, help="(3)'s bad requests")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    print(f"bench.py {' '.join(sys.argv[1:] if argv is None else argv)}; {datetime.date.today()}\n{hardware()}")
    if args.command == "serve":
        return bench_serve(args)
    return bench_model(args, args.command == "train")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TfmError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
