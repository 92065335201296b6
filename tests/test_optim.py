import copy

import pytest
import torch
from torch import nn

from transformer_cli.optim import LazyAdamW, clip_grad_norm_

ROWS = 12


class Net(nn.Module):
    """An embedding table and a dense layer: a sparse and a dense gradient in one optimizer."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.emb = nn.Embedding(ROWS, 3, sparse=sparse)
        self.lin = nn.Linear(3, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids)).pow(2).mean()


def nets() -> tuple[Net, Net]:
    torch.manual_seed(0)
    dense = Net(sparse=False)
    sparse = Net(sparse=True)
    sparse.load_state_dict(dense.state_dict())
    return dense, sparse


def groups(net: Net) -> list[dict]:
    return [{"params": [net.emb.weight], "weight_decay": 0.1}, {"params": list(net.lin.parameters()), "weight_decay": 0.0}]


def steps(net: Net, opt: torch.optim.Optimizer, batches: list[torch.Tensor], lrs: list[float]) -> None:
    for ids, lr in zip(batches, lrs, strict=True):
        for g in opt.param_groups:
            g["lr"] = lr
        net(ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def every_row(n: int) -> list[torch.Tensor]:
    """Batches that hold every row, some of them twice (their gradients add up)."""
    g = torch.Generator().manual_seed(1)
    return [torch.cat([torch.randperm(ROWS, generator=g), torch.randint(0, ROWS, (5,), generator=g)]) for _ in range(n)]


def test_equals_adamw_when_every_row_is_in_every_step():
    dense, sparse = nets()
    kw = {"lr": 0.05, "betas": (0.9, 0.98)}
    ref, lazy = torch.optim.AdamW(groups(dense), **kw), LazyAdamW(groups(sparse), **kw)
    batches, lrs = every_row(6), [0.05, 0.04, 0.03, 0.02, 0.01, 0.005]
    steps(dense, ref, batches, lrs)
    steps(sparse, lazy, batches, lrs)
    assert sparse.emb.weight.grad is None
    for (name, a), b in zip(dense.named_parameters(), sparse.parameters(), strict=True):
        assert not torch.equal(a, nets()[0].get_parameter(name))  # it did learn
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    for p, q in zip(dense.parameters(), sparse.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(lazy.state[q][key], ref.state[p][key], rtol=1e-5, atol=1e-8)


def test_rows_missing_from_a_step_keep_weights_and_moments():
    dense, sparse = nets()
    ref, lazy = torch.optim.AdamW(groups(dense), lr=0.05), LazyAdamW(groups(sparse), lr=0.05)
    steps(dense, ref, every_row(1), [0.05])
    steps(sparse, lazy, every_row(1), [0.05])
    before = sparse.emb.weight.detach().clone(), *(lazy.state[sparse.emb.weight][k].clone() for k in ("exp_avg", "exp_avg_sq"))
    seen = torch.tensor([0, 3, 3, 7])
    steps(dense, ref, [seen], [0.05])
    steps(sparse, lazy, [seen], [0.05])
    after = sparse.emb.weight.detach(), *(lazy.state[sparse.emb.weight][k] for k in ("exp_avg", "exp_avg_sq"))
    unseen = torch.tensor([r for r in range(ROWS) if r not in seen.tolist()])
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a[unseen], b[unseen])
        assert not torch.equal(a[seen], b[seen])
    # Dense AdamW moves every row on momentum and decay: the two differ exactly in the unseen rows.
    assert not torch.equal(dense.emb.weight[unseen], sparse.emb.weight[unseen])
    torch.testing.assert_close(dense.emb.weight[seen], sparse.emb.weight[seen], rtol=1e-5, atol=1e-6)


def test_state_dicts_load_across_adamw_and_lazyadamw():
    dense, sparse = nets()
    ref, lazy = torch.optim.AdamW(groups(dense), lr=0.05), LazyAdamW(groups(sparse), lr=0.05)
    steps(dense, ref, every_row(2), [0.05, 0.05])
    steps(sparse, lazy, every_row(2), [0.05, 0.05])
    # Swap the optimizers' states and go on: both still take the same steps.
    dense2, sparse2 = copy.deepcopy(dense), copy.deepcopy(sparse)
    ref2, lazy2 = torch.optim.AdamW(groups(dense2), lr=0.05), LazyAdamW(groups(sparse2), lr=0.05)
    ref2.load_state_dict(lazy.state_dict())
    lazy2.load_state_dict(ref.state_dict())
    more = every_row(4)[2:]
    steps(dense2, ref2, more, [0.05, 0.05])
    steps(sparse2, lazy2, more, [0.05, 0.05])
    for a, b in zip(dense2.parameters(), sparse2.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.01, 1e6, float("inf")])
def test_clip_grad_norm_of_sparse_gradients_equals_torchs_on_dense_ones(max_norm):
    dense, sparse = nets()
    ids = torch.tensor([1, 1, 4, 9, 4])  # repeated rows: their gradients add up before the norm
    dense(ids).backward()
    sparse(ids).backward()
    assert not sparse.emb.weight.grad.is_coalesced()
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
    got = clip_grad_norm_(sparse.parameters(), max_norm)
    torch.testing.assert_close(got, want)
    for a, b in zip(dense.parameters(), sparse.parameters(), strict=True):
        torch.testing.assert_close(b.grad.to_dense(), a.grad, rtol=1e-5, atol=1e-7)
    if max_norm == 0.01:  # it did clip
        assert clip_grad_norm_(sparse.parameters(), float("inf")).item() == pytest.approx(0.01, rel=1e-3)


def test_sparse_update_refuses_amsgrad():
    _, sparse = nets()
    opt = LazyAdamW(groups(sparse), lr=0.05, amsgrad=True)
    sparse(torch.tensor([1, 2])).backward()
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


def test_make_optimizer_uses_the_fused_kernel_on_cpu_and_equals_foreach_adamw():
    from transformer_cli.config import ModelConfig, TrainConfig
    from transformer_cli.model import CTransformer
    from transformer_cli.optim import make_optimizer

    tc = TrainConfig()
    torch.manual_seed(0)
    # Mean pooling: under max pooling the two optimizers' rounding apart can move a maximum to another token.
    cfg = ModelConfig(d_model=16, n_heads=2, n_layers=1, ngram_buckets=64, dropout=0.0, token_dropout=0.0, pooling="mean")
    fast = CTransformer(cfg, 50, 16)
    slow = copy.deepcopy(fast)
    opt = make_optimizer(fast, tc, torch.device("cpu"))
    assert all(g["fused"] for g in opt.param_groups) and len(opt.param_groups) == 3  # the n-gram table's own group
    assert type(opt) is torch.optim.AdamW  # LazyAdamW only under model.lazy_embeddings
    ref = torch.optim.AdamW(slow.param_groups(tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2), foreach=True)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        ids, y = torch.randint(1, 50, (4, 16), generator=g), torch.randint(0, 2, (4,), generator=g)
        mask = torch.ones(4, 16, dtype=torch.bool)
        for model, o in ((fast, opt), (slow, ref)):
            model(ids, mask, y)[1].backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, a), b in zip(fast.named_parameters(), slow.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(fast.ngrams.table.weight, torch.zeros_like(fast.ngrams.table.weight))  # it learned


def test_lazy_embeddings_give_the_dense_gradients_and_a_fused_lazyadamw_step_equals_adamw():
    """`model.lazy_embeddings`: the model's sparse gradients are its dense twin's, their norm is the
    same, and the first step of make_optimizer's fused LazyAdamW equals AdamW's (without weight decay,
    rows outside the batch have nothing to move them on a first step; later they would keep AdamW's
    momentum, see test_rows_missing_from_a_step_keep_weights_and_moments)."""
    from transformer_cli.config import ModelConfig, TrainConfig
    from transformer_cli.model import CTransformer
    from transformer_cli.optim import make_optimizer

    tc = TrainConfig(weight_decay=0.0)
    sizes = {"d_model": 16, "n_heads": 2, "n_layers": 1, "ngram_buckets": 64, "dropout": 0.0, "token_dropout": 0.0}
    torch.manual_seed(0)
    lazy = CTransformer(ModelConfig(**sizes, lazy_embeddings=True), 50, 16)
    dense = CTransformer(ModelConfig(**sizes), 50, 16)
    dense.load_state_dict(lazy.state_dict())
    with torch.no_grad():  # a table that has learned something, so that its gradients flow everywhere
        for table in (lazy.ngrams.table.weight, dense.ngrams.table.weight):
            table.copy_(torch.linspace(-1, 1, table.numel()).view_as(table))
    g = torch.Generator().manual_seed(3)
    ids, y = torch.randint(1, 50, (4, 16), generator=g), torch.randint(0, 2, (4,), generator=g)
    mask = torch.arange(16) < torch.tensor([16, 11, 5, 16])[:, None]  # (B, T) with padding
    for m in (lazy, dense):
        m(ids, mask, y)[1].backward()
    sparse_names = [n for n, p in lazy.named_parameters() if p.grad.is_sparse]
    assert sparse_names == ["encoder.tok_emb.weight", "ngrams.table.weight"]
    for (name, a), b in zip(lazy.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(a.grad.to_dense(), b.grad, rtol=1e-6, atol=1e-7, msg=name)
    norm = clip_grad_norm_(lazy.parameters(), 0.1)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1))
    opt = make_optimizer(lazy, tc, torch.device("cpu"))
    assert type(opt) is LazyAdamW and all(g["fused"] for g in opt.param_groups)
    ref = torch.optim.AdamW(dense.param_groups(0.0), lr=tc.lr, betas=(tc.beta1, tc.beta2), foreach=True)
    before = copy.deepcopy(dense.state_dict())
    opt.step()
    ref.step()
    for (name, a), b in zip(lazy.named_parameters(), dense.parameters(), strict=True):
        assert not torch.equal(b, before[name]), name  # every parameter moved
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
