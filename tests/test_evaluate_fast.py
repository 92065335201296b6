"""The fast inference path (length-sorted, token-budgeted batches run by one-thread workers; logits
gathered once) against the reference: one review at a time, unbatched and unpadded. No timings here;
speed is measured by scripts/bench/bench_infer.py."""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import pytest
import torch
from conftest import one_at_a_time_logits

from transformer_cli import evaluate as ev
from transformer_cli import kernels
from transformer_cli.config import ModelConfig
from transformer_cli.data import Encoded
from transformer_cli.model import CTransformer
from transformer_cli.runtime import Runtime

CPU = Runtime(torch.device("cpu"), None)
VOCAB, MAX_LEN = 300, 48


def random_encoded(n: int, seed: int = 0, max_len: int = MAX_LEN) -> Encoded:
    """n reviews of random length 1..max_len (each starting with [CLS] = 2), labels 0/1."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=n)
    lengths[: n // 5] = max_len  # many at max_length, as with truncated IMDB reviews
    rng.shuffle(lengths)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(5, VOCAB, size=int(offsets[-1])).astype(np.int32)
    ids[offsets[:-1]] = 2
    return Encoded(ids, offsets, rng.integers(0, 2, size=n).astype(np.int64))


def random_model(seed: int = 0, **cfg) -> CTransformer:
    torch.manual_seed(seed)
    mc = ModelConfig(d_model=32, n_heads=4, n_layers=2, ff_mult=2, dropout=0.1, **cfg)
    return CTransformer(mc, VOCAB, MAX_LEN).eval()


def reference_metrics(model, enc: Encoded, temperature: float = 1.0) -> dict:
    logits = one_at_a_time_logits(model, enc) / temperature
    y = torch.from_numpy(enc.labels)
    confusion = np.zeros((2, 2))
    np.add.at(confusion, (enc.labels, logits.argmax(-1).numpy()), 1)
    out = ev.metrics_from_confusion(confusion)
    out["loss"] = torch.nn.functional.cross_entropy(logits, y).item()
    return out


# --------------------------------------------------------------------------- the batch plan


@pytest.mark.parametrize("max_tokens", [None, 1, 40, 100, 333, 10**9])
@pytest.mark.parametrize("batch_size", [1, 3, 16, 256])
def test_batch_plan_covers_every_example_once_within_its_limits(batch_size, max_tokens):
    lengths = random_encoded(97, seed=batch_size).lengths
    plan = ev.batch_plan(lengths, batch_size, max_tokens)
    flat = np.concatenate(plan)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert np.all(np.diff(lengths[flat]) >= 0)  # sorted by length, so batches carry little padding
    for idx in plan:
        assert 1 <= len(idx) <= batch_size
        if max_tokens is not None and len(idx) > 1:
            assert len(idx) * lengths[idx].max() <= max_tokens
    if max_tokens is None:
        assert [len(b) for b in plan[:-1]] == [batch_size] * (len(plan) - 1)  # plain fixed-size batches


@pytest.mark.parametrize("max_tokens", [None, 333])
def test_a_batch_size_beyond_the_rows_plans_as_all_of_them_in_little_memory(max_tokens):
    """`--batch-size` caps a batch's rows: a huge one (10**12, 2**63) plans as len(lengths) does, in
    work and memory of the rows, not of the cap."""
    lengths = random_encoded(97, seed=0).lengths
    expected = [idx.tolist() for idx in ev.batch_plan(lengths, len(lengths), max_tokens)]
    for huge in (10**12, 2**63):
        assert [idx.tolist() for idx in ev.batch_plan(lengths, huge, max_tokens)] == expected


def plan_cost(lengths: np.ndarray, plan: list[np.ndarray]) -> int:
    return sum(len(idx) * int(lengths[idx].max()) + ev.BATCH_CALL_TOKENS for idx in plan)


@pytest.mark.parametrize("seed", range(20))
def test_batch_plan_with_a_token_budget_costs_the_least_of_all_cuts(seed):
    """Against every way of cutting the sorted rows into batches within the limits."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=int(rng.integers(1, 9)))
    batch_size, max_tokens = int(rng.integers(1, 6)), int(rng.integers(100, 900))
    s = np.sort(lengths)

    def best(j: int) -> float:  # the cheapest cost of the j shortest rows, by brute force
        if j == 0:
            return 0
        return min(best(j - k) + k * int(s[j - 1]) + ev.BATCH_CALL_TOKENS
                   for k in range(1, min(batch_size, j) + 1) if k == 1 or k * s[j - 1] <= max_tokens)

    assert plan_cost(lengths, ev.batch_plan(lengths, batch_size, max_tokens)) == best(len(s))


def test_batch_plan_puts_scattered_lengths_in_short_batches():
    lengths = np.array([500, 12, 10, 11, 9, 10, 13, 480])
    plan = ev.batch_plan(lengths, 64, 10**6)
    assert [sorted(idx.tolist()) for idx in plan] == [[1, 2, 3, 4, 5, 6], [0, 7]]  # not one batch padded to 500


def test_batch_plan_fills_batches_up_to_the_token_budget():
    lengths = np.array([10] * 8 + [30] * 4)
    assert [len(b) for b in ev.batch_plan(lengths, 100, 60)] == [6, 2, 2, 2]  # 6x10 then 2x30 (3x30 > 60)


def test_ranks_split_the_batches_between_them():
    enc = random_encoded(50)
    per_rank = [ev.batches_for(random_model(), enc, 4, Runtime(torch.device("cpu"), None, rank=r, world_size=3))
                for r in range(3)]
    flat = [i for batches in per_rank for b in batches for i in b.tolist()]
    assert sorted(flat) == list(range(50))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("batch_size", "max_tokens", "parts"), [(64, 4096, 2), (5, 100, 1), (16, 300, 3), (64, 1, 2)])
def test_pack_plan_covers_every_example_once_in_even_passes(seed, batch_size, max_tokens, parts):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 1025, size=int(rng.integers(1, 80)))
    plan = ev.pack_plan(lengths, batch_size, max_tokens, parts, attention_length=384)
    assert sorted(i for idx in plan for i in idx.tolist()) == list(range(len(lengths)))
    assert all(1 <= len(idx) <= batch_size for idx in plan)
    flat = np.concatenate(plan)
    assert (np.diff(lengths[flat]) >= 0).all()  # in length order
    work = [float(ev.text_work(lengths[idx], 384).sum()) for idx in plan]
    heaviest = float(ev.text_work(lengths, 384).max())
    if all(len(idx) < batch_size for idx in plan):  # cut by work alone
        assert max(work) <= sum(work) / len(plan) + heaviest  # each within one text of an even share
        total = int(lengths.sum())
        k = max(int(total / max_tokens + 0.5), math.ceil(total / (max_tokens + lengths.max())), 1)
        k = min(len(lengths), math.ceil(k / parts) * parts)
        if heaviest <= sum(work) / k:  # no text is more than a share: k passes, a multiple of parts if it can be
            assert len(plan) == k


@pytest.mark.parametrize(("lengths", "passes"), [
    ([100] * 16, 1),
    ([256] * 16, 1),  # one budget (4,096 tokens)
    ([256] * 15 + [1000], 1),  # over it by less than the longest text: one pass, not two half ones
    ([300] * 16, 2),  # over it by more
    ([256] * 40, 3),  # 2.5 budgets, rounded
    ([256] * 36, 3),  # 2.25 budgets: two passes would each hold more than a budget and a text
])
def test_pack_plan_makes_the_passes_nearest_the_token_budget(lengths, passes):
    assert len(ev.pack_plan(np.array(lengths), 64, 4096)) == passes


def test_a_texts_work_grows_with_its_attention():
    np.testing.assert_allclose(ev.text_work(np.array([1, 384, 768]), 384), [1 + 1 / 384, 768, 768 * 3])
    assert ev.text_work(np.array([500])).tolist() == [500.0]  # without attention: its tokens


def test_pack_plan_gives_each_of_two_workers_half_the_work_of_a_few_scattered_reviews():
    lengths = np.array([900, 60, 80, 70, 850, 65, 75, 90])
    plan = ev.pack_plan(lengths, 64, 10**6, parts=2, attention_length=384)
    assert [sorted(idx.tolist()) for idx in plan] == [[1, 2, 3, 4, 5, 6, 7], [0]]  # the 900 alone is half the work


def test_collate_packed_lays_the_reviews_end_to_end_up_to_a_round_width():
    from transformer_cli.data import PAD_ID, PAD_MULTIPLE, collate_packed

    enc = random_encoded(9)
    idx = np.array([4, 0, 7])
    ids, offsets = collate_packed(enc, idx)
    n = int(enc.lengths[idx].sum())
    assert len(ids) % PAD_MULTIPLE == 0 and len(ids) - n < PAD_MULTIPLE and offsets[-1] == len(ids)
    for k, i in enumerate(idx):
        assert ids[offsets[k] : offsets[k + 1]].tolist() == enc.ids[enc.offsets[i] : enc.offsets[i + 1]].tolist()
    assert (ids[n:] == PAD_ID).all() and np.diff(offsets)[len(idx):].tolist() == [1] * (len(ids) - n)  # one [PAD] a text


@pytest.fixture
def two_torch_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)  # so that the CPU path has two workers on any machine
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- fast path == reference


@pytest.mark.parametrize("cfg", [{}, {"pooling": "max", "norm": "post"}, {"pooling": "first"},
                                 {"attention": "explicit"}, {"pos_emb": "sinusoidal"},
                                 {"pos_emb": "rope"}])
@pytest.mark.parametrize("max_tokens", [64, 200, 10**9])
@pytest.mark.parametrize("workers", [4, 1])
@pytest.mark.parametrize("packed", [False, True])
def test_batched_logits_equal_one_review_at_a_time(cfg, max_tokens, workers, packed, monkeypatch, two_torch_threads):
    monkeypatch.setattr(ev, "cpu_batch_tokens", lambda: max_tokens)
    monkeypatch.setattr(ev, "CPU_WORKERS", workers)
    monkeypatch.setattr(ev, "packs", lambda model, rt: packed)  # packed: attention pads each pass (no kernel in fp32)
    model, enc = random_model(**cfg), random_encoded(60)
    fast = ev.batched_logits(model, enc, ev.batches_for(model, enc, 16, CPU), CPU, 2).double()
    torch.testing.assert_close(fast, one_at_a_time_logits(model, enc), atol=1e-5, rtol=0)  # and in input order


@pytest.mark.parametrize("pos_emb", ["learned", "sinusoidal", "rope"])
def test_packed_passes_fit_a_max_length_shorter_than_their_filler(pos_emb, monkeypatch):
    monkeypatch.setattr(ev, "packs", lambda model, rt: True)
    torch.manual_seed(0)
    model = CTransformer(ModelConfig(d_model=32, n_heads=4, n_layers=1, pos_emb=pos_emb), VOCAB, 4).eval()
    enc = random_encoded(5, max_len=4)  # 20 tokens or fewer: 12 or more filler texts
    fast = ev.batched_logits(model, enc, ev.batches_for(model, enc, 16, CPU), CPU, 2).double()
    torch.testing.assert_close(fast, one_at_a_time_logits(model, enc), atol=1e-5, rtol=0)


@pytest.mark.skipif(not kernels.available(), reason="the packed path needs the AVX-512 BF16 attention kernel")
def test_bf16_inference_packs_the_reviews_where_the_kernel_runs_and_keeps_their_logits(monkeypatch, two_torch_threads):
    rt = Runtime(torch.device("cpu"), torch.bfloat16)
    torch.manual_seed(3)
    model = CTransformer(ModelConfig(d_model=64, n_heads=2, n_layers=2, pooling="max"), VOCAB, MAX_LEN).eval()
    enc = random_encoded(70, seed=3)
    assert ev.packs(model, rt) and not ev.packs(model, CPU)  # bf16 with the kernel; not fp32
    heads_of_8 = CTransformer(ModelConfig(d_model=64, n_heads=8, n_layers=1), VOCAB, MAX_LEN)
    assert not ev.packs(heads_of_8, rt)  # a head size the kernel does not have
    calls = []
    monkeypatch.setattr(model, "packed_logits", lambda *a, f=model.packed_logits: calls.append(1) or f(*a))
    packed = ev.batched_logits(model, enc, ev.batches_for(model, enc, 16, rt), rt, 2)
    monkeypatch.setattr(ev, "packs", lambda model, rt: False)
    padded = ev.batched_logits(model, enc, ev.batches_for(model, enc, 16, rt), rt, 2)
    assert calls
    torch.testing.assert_close(packed, padded, atol=0.02 * float(padded.abs().max()), rtol=0)
    assert (packed.argmax(1) == padded.argmax(1)).float().mean() >= 0.95


@pytest.mark.parametrize("packed", [True, False])
def test_warm_up_runs_a_pass_of_each_packed_width_up_to_the_budget_plus_a_longest_review(trained_dir, packed,
                                                                                         monkeypatch):
    monkeypatch.setattr(ev, "packs", lambda model, rt: packed)  # fp32: attention pads each pass (no kernel)
    monkeypatch.setattr(ev, "cpu_batch_tokens", lambda: 200)
    loaded = ev.load_for_inference(trained_dir, "cpu", "fp32")
    passes = []
    monkeypatch.setattr(loaded.model, "packed_logits",
                        lambda ids, texts, f=loaded.model.packed_logits: passes.append((len(ids), texts)) or f(ids, texts))
    monkeypatch.setattr(loaded.model, "forward", lambda *a, f=loaded.model.forward: passes.append(None) or f(*a))
    ev.warm_up(loaded)
    max_length = loaded.cfg.data.max_length
    if not packed:  # one prediction, and no sweep
        assert passes == [None]
        return
    warm = passes[1:]  # after the prediction's pass
    assert sorted(width for width, _ in warm) == list(range(32, 200 + max_length + 1, 32))
    assert all(int(texts.lengths.min()) >= 1 and texts.longest <= max_length for _, texts in warm)


class RecordingModel(torch.nn.Module):
    """The model, noting for each forward its thread, torch's thread count there and inference mode."""

    def __init__(self, model, fail_at: int | None = None):
        super().__init__()
        self.model, self.fail_at, self.calls = model, fail_at, []
        self.lock = threading.Lock()

    def forward(self, ids, mask):
        with self.lock:
            self.calls.append((threading.get_ident(), torch.get_num_threads(), torch.is_inference_mode_enabled()))
            if len(self.calls) == self.fail_at:
                raise RuntimeError("boom")
        return self.model(ids, mask)


@pytest.mark.parametrize("threads, cap, split", [(2, 4, (2, 1)), (1, 4, (1, 1)), (8, 4, (4, 2)), (6, 4, (3, 2)),
                                                 (64, 4, (4, 16)), (5, 4, (2, 2)), (3, 1, (1, 3))])
def test_cpu_workers_share_the_threads_evenly_up_to_the_cap(threads, cap, split, monkeypatch, two_torch_threads):
    monkeypatch.setattr(ev, "CPU_WORKERS", cap)
    torch.set_num_threads(threads)
    assert ev.cpu_workers() == split
    assert ev.cpu_batch_tokens() == ev.CPU_TOKENS_PER_THREAD * split[1]  # per batch: its worker's threads


def test_cpu_workers_run_whole_batches_on_one_thread_each(monkeypatch, two_torch_threads):
    monkeypatch.setattr(ev, "cpu_batch_tokens", lambda: 200)
    model, enc = random_model(seed=2), random_encoded(120, seed=2)
    batches = ev.batches_for(model, enc, 16, CPU)
    recorder = RecordingModel(model)
    fast = ev.batched_logits(recorder, enc, batches, CPU, 2)
    assert len(recorder.calls) == len(batches) > 2
    assert {calls[1:] for calls in recorder.calls} == {(1, True)}  # one torch thread each, inference mode
    assert threading.get_ident() not in {c[0] for c in recorder.calls}
    assert len({c[0] for c in recorder.calls}) <= 2
    assert torch.get_num_threads() == 2  # restored
    monkeypatch.setattr(ev, "CPU_WORKERS", 1)  # the reference: each operation on both threads
    one = RecordingModel(model)
    torch.testing.assert_close(fast, ev.batched_logits(one, enc, batches, CPU, 2), atol=1e-5, rtol=0)
    assert set(one.calls) == {(threading.get_ident(), 2, True)}


@pytest.mark.parametrize("packed", [True, False])
def test_a_lone_packed_pass_runs_here_on_one_workers_threads_and_a_lone_padded_batch_on_every_thread(
        packed, monkeypatch, two_torch_threads):
    monkeypatch.setattr(ev, "packs", lambda model, rt: packed)
    model, enc = random_model(seed=6), random_encoded(1, seed=6)
    seen = []

    def note(f):
        return lambda *a: seen.append((threading.get_ident(), torch.get_num_threads())) or f(*a)

    monkeypatch.setattr(model, "packed_logits", note(model.packed_logits))
    monkeypatch.setattr(model, "forward", note(model.forward))
    logits = ev.batched_logits(model, enc, ev.batches_for(model, enc, 16, CPU), CPU, 2)
    assert len(seen) == 1
    # in this thread (no hand-off to a worker); packed: with a worker's one thread, padded: on both
    assert seen[0] == (threading.get_ident(), 1 if packed else 2)
    torch.testing.assert_close(logits.double(), one_at_a_time_logits(model, enc), atol=1e-5, rtol=0)
    assert torch.get_num_threads() == 2


def test_cpu_logits_are_the_same_on_one_thread_and_on_two_workers(two_torch_threads):
    model, enc = random_model(seed=4), random_encoded(150, seed=4)
    two = ev.batched_logits(model, enc, ev.batches_for(model, enc, 16, CPU), CPU, 2)  # 2 workers of one thread
    torch.set_num_threads(1)
    one = ev.batched_logits(model, enc, ev.batches_for(model, enc, 16, CPU), CPU, 2)  # the same batches, in this thread
    assert torch.equal(one, two)  # bit for bit: a validation figure does not depend on the thread count


def test_cpu_workers_of_two_threads_each(monkeypatch, two_torch_threads):
    monkeypatch.setattr(ev, "cpu_batch_tokens", lambda: 200)
    monkeypatch.setattr(ev, "CPU_WORKERS", 2)
    torch.set_num_threads(4)  # 2 workers of 2 threads (oversubscribed on a 2-core machine: correctness only)
    model, enc = random_model(seed=3), random_encoded(120, seed=3)
    recorder = RecordingModel(model)
    fast = ev.batched_logits(recorder, enc, ev.batches_for(recorder, enc, 16, CPU), CPU, 2)
    assert {c[1:] for c in recorder.calls} == {(2, True)}  # two torch threads each, inference mode
    assert threading.get_ident() not in {c[0] for c in recorder.calls}
    assert torch.get_num_threads() == 4
    torch.testing.assert_close(fast, one_at_a_time_logits(model, enc).float(), atol=1e-5, rtol=0)


def test_cpu_workers_restore_the_threads_when_a_batch_fails(monkeypatch, two_torch_threads):
    monkeypatch.setattr(ev, "cpu_batch_tokens", lambda: 200)
    enc = random_encoded(120, seed=2)
    with pytest.raises(RuntimeError, match="boom"):
        failing = RecordingModel(random_model(), fail_at=3)
        ev.batched_logits(failing, enc, ev.batches_for(failing, enc, 16, CPU), CPU, 2)
    assert torch.get_num_threads() == 2
    model = random_model()  # the workers serve on after a failure
    torch.testing.assert_close(ev.batched_logits(model, enc, ev.batches_for(model, enc, 16, CPU), CPU, 2).double(),
                               one_at_a_time_logits(model, enc), atol=1e-5, rtol=0)


def test_cpu_workers_are_kept_between_calls(monkeypatch, two_torch_threads):
    monkeypatch.setattr(ev, "cpu_batch_tokens", lambda: 200)
    model, enc = random_model(seed=5), random_encoded(120, seed=5)
    threads = set()  # Thread objects, not idents: a new thread may reuse an ended one's ident

    def forward(ids, mask):
        threads.add(threading.current_thread())
        return model(ids, mask)

    for _ in range(3):
        ev.batched_logits(forward, enc, ev.batches_for(forward, enc, 16, CPU), CPU, 2)
    assert len(threads) == 2  # the same two workers in every call


def test_a_forked_child_makes_its_own_workers(two_torch_threads):
    ev.worker_pool(2, 1)
    assert ev._pools
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads are not here, so neither is their pool
        os._exit(0 if not ev._pools else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert ev._pools  # the parent keeps its own


@pytest.mark.parametrize("max_tokens", [64, 10**9])
@pytest.mark.parametrize("batch_size", [1, 7, 256])
def test_evaluate_model_equals_the_reference_metrics(batch_size, max_tokens, monkeypatch):
    monkeypatch.setattr(ev, "cpu_batch_tokens", lambda: max_tokens)
    model, enc = random_model(seed=1, pooling="max"), random_encoded(80, seed=1)
    model.train()
    got = ev.evaluate_model(model, enc, CPU, batch_size, 2)
    assert model.training  # the mode is restored
    want = reference_metrics(model.eval(), enc)
    for key in ("confusion_matrix", "num_examples", "accuracy", "macro_f1", "per_class", "labels"):
        assert got[key] == want[key], key
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_evaluate_model_on_an_empty_share_of_the_batches(monkeypatch):
    enc = random_encoded(1)  # one batch: rank 1 of 2 gets none, and its sums are zero
    rt = Runtime(torch.device("cpu"), None, rank=1, world_size=2)
    monkeypatch.setattr(rt, "all_sum", lambda values: values)  # no process group: only this rank's sums
    m = ev.evaluate_model(random_model(), enc, rt, 8, 2)
    assert m["num_examples"] == 0 and m["loss"] == 0.0


def test_predict_proba_equals_one_review_at_a_time_in_input_order(trained_dir, test_rows, monkeypatch):
    from transformer_cli.data import encode_texts
    from transformer_cli.evaluate import load_model_dir

    monkeypatch.setattr(ev, "cpu_batch_tokens", lambda: 300)  # many batches of different sizes
    model, cfg, tokenizer, _, _ = load_model_dir(trained_dir)
    d = cfg.data
    texts = [r["text"] for r in test_rows[:70]]
    probs = ev.predict_proba(model, tokenizer, texts, d.max_length, d.truncation, d.head_fraction, CPU, batch_size=9)
    ids, offsets = encode_texts(tokenizer, texts, d.max_length, d.truncation, d.head_fraction)
    want = one_at_a_time_logits(model, Encoded(ids, offsets, np.zeros(len(texts), dtype=np.int64))).softmax(-1)
    assert probs.shape == (70, 2)
    np.testing.assert_allclose(probs, want.numpy(), atol=1e-5, rtol=0)


def test_evaluate_checkpoint_equals_the_reference(trained_dir, test_rows):
    from transformer_cli.calibration import saved_temperature
    from transformer_cli.data import encode_texts
    from transformer_cli.evaluate import load_model_dir

    model, cfg, tokenizer, _, _ = load_model_dir(trained_dir)
    d = cfg.data
    ids, offsets = encode_texts(tokenizer, [r["text"] for r in test_rows], d.max_length, d.truncation, d.head_fraction)
    temperature = saved_temperature(trained_dir)  # evaluate reports the calibrated probabilities
    want = reference_metrics(model, Encoded(ids, offsets, np.array([r["label"] for r in test_rows])), temperature)
    got = ev.evaluate_checkpoint(trained_dir, device="cpu")
    assert got["confusion_matrix"] == want["confusion_matrix"]
    assert got["accuracy"] == want["accuracy"] and got["macro_f1"] == want["macro_f1"]
    assert list(got["per_class"].values()) == list(want["per_class"].values())  # named neg, pos: ids 0, 1
    assert math.isclose(got["loss"], want["loss"], rel_tol=1e-6)


def test_inference_precision_follows_the_run_unless_given(trained_dir, tmp_path, monkeypatch):
    """A run trained in fp32 is read in fp32; any other run in this machine's mixed precision ("auto");
    --precision overrides both."""
    import json
    import shutil

    from transformer_cli import checkpoint as ckpt
    from transformer_cli import runtime

    auto_dir = tmp_path / "auto"
    shutil.copytree(trained_dir, auto_dir)
    config = json.loads((auto_dir / ckpt.CONFIG_FILE).read_text())
    assert config["train"]["precision"] == "fp32"  # conftest's runs
    config["train"]["precision"] = "auto"
    (auto_dir / ckpt.CONFIG_FILE).write_text(json.dumps(config))

    def dtype(model_dir, precision=None):
        return ev.load_for_inference(model_dir, "cpu", precision)[0].amp_dtype

    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: True)
    assert dtype(trained_dir) is None and dtype(auto_dir) is torch.bfloat16
    assert dtype(trained_dir, "bf16") is torch.bfloat16 and dtype(auto_dir, "fp32") is None
    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: False)
    assert dtype(auto_dir) is None  # auto on a CPU without native bf16: fp32


def test_bf16_evaluation_is_close_to_fp32(trained_dir, monkeypatch):
    from transformer_cli import runtime

    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: True)  # emulated here if need be: slow, same numbers
    fp32 = ev.evaluate_checkpoint(trained_dir, device="cpu")
    bf16 = ev.evaluate_checkpoint(trained_dir, device="cpu", precision="bf16")
    assert (fp32["compute_dtype"], bf16["compute_dtype"]) == ("fp32", "bf16")
    assert bf16["loss"] != fp32["loss"]  # the matmuls ran in bf16 ...
    # ... within its precision: relative on a loss of typical size, absolute on a very sure model's near-zero one
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2, abs=1e-4)
    assert abs(bf16["accuracy"] - fp32["accuracy"]) <= 0.02
