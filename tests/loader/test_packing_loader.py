"""Packed collate (varlen_cli.loader.packed): layout, cu_seqlens, labels, and no cross-contamination."""

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import sample
from varlen_cli.errors import PlanError
from varlen_cli.loader.collate import PlanDataset
from varlen_cli.loader.packed import PackedCollate, PackedLayoutError, block_causal_mask, collate_packed
from varlen_cli.loader.plan_file import Microbatch
from varlen_cli.loader.sampler import MicrobatchIndices
from varlen_cli.plan.packing import pack


def _tokens():
    ids = pq.read_table(sample("tokenized.parquet")).column("input_ids").to_pylist()
    return [np.array(x, dtype=np.int64) for x in ids]


def _microbatch(p, rows, first_row=0):
    """A packed plan row holding rows [first_row, first_row + rows) of a Packing (what the planner writes)."""
    off = p.row_offsets()
    sl = slice(off[first_row], off[min(first_row + rows, p.num_rows)])
    ids = p.item_sample[sl]
    distinct = len(np.unique(ids[p.item_length[sl] > 0]))  # samples, not chunks; zero-length ones have no target
    return Microbatch(epoch=0, step=0, rank=0, micro=0, sample_ids=ids, num_samples=len(ids), seqlen=p.seq_len,
                      batch_size=rows, tokens=int(p.item_length[sl].sum()), lr_scale=1.0, shape_id=0,
                      step_samples=distinct, step_tokens=int(p.item_length[sl].sum()),
                      sample_lengths=p.item_length[sl].astype(np.int32),
                      sample_rows=(p.item_row[sl] - first_row).astype(np.int32),
                      sample_starts=p.item_start[sl].astype(np.int32))


def _collate(dataset, info, **kw):
    items = PlanDataset(dataset).__getitems__(MicrobatchIndices(info.sample_ids.tolist(), info))
    return PackedCollate(**kw)(items)


class TinyLM(nn.Module):
    """Two pre-norm transformer blocks with learned absolute positions, attention through SDPA."""

    def __init__(self, vocab, d=32, heads=4, layers=2, max_pos=512):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_pos, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d),
                                                       out=nn.Linear(d, d), ln2=nn.LayerNorm(d), mlp=nn.Sequential(
                                                           nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))))
                                    for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, pos, mask):
        b, t = ids.shape
        x = self.tok(ids) + self.pos(pos)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
            x = x + blk["out"](a.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(x)


def test_packed_forward_equals_unpacked_forward():
    """Real token sequences, split chunks and all: each entry's logits in the packed batch (block
    mask + restarting positions) equal the logits of that entry run alone."""
    torch.manual_seed(0)
    data = _tokens()
    lengths = np.array([len(x) for x in data], dtype=np.int64)
    T, R = 128, 6
    p = pack(lengths, T, split_long=True, max_per_row=8, seed=1)
    info = _microbatch(p, R)
    assert info.num_samples > R  # several entries per row
    batch = _collate(data, info, attention_mask_3d=True)
    assert batch["input_ids"].shape == (R, T) and batch["attention_mask_3d"].shape == (R, T, T)
    model = TinyLM(int(max(x.max() for x in data)) + 1).double().eval()
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["position_ids"], batch["attention_mask_3d"])
        assert torch.isfinite(packed).all()  # padding rows of the mask are never empty
        col = 0
        prev_row = -1
        for sid, ln, row, start in zip(info.sample_ids, info.sample_lengths, info.sample_rows, info.sample_starts):
            col = 0 if row != prev_row else col
            prev_row = row
            if ln == 0:
                continue
            chunk = torch.as_tensor(data[sid][start:start + ln])[None]
            alone = model(chunk, torch.arange(ln)[None], torch.ones(ln, ln, dtype=torch.bool).tril()[None])
            torch.testing.assert_close(packed[row, col:col + ln], alone[0], rtol=1e-9, atol=1e-9)
            col += ln
        # the additive float mask gives the same result
        additive = block_causal_mask(batch["segment_ids"], dtype=torch.float64)
        assert additive.dtype == torch.float64 and torch.isinf(additive).any()
        torch.testing.assert_close(model(batch["input_ids"], batch["position_ids"], additive), packed)


def test_cu_seqlens_varlen_attention_matches_block_mask():
    """Per-segment causal attention over cu_seqlens (what a varlen kernel computes on the flattened
    batch) equals masked attention with the block mask on every real token."""
    torch.manual_seed(1)
    lengths = np.array([7, 3, 0, 12, 5, 1, 9, 16, 2, 4], dtype=np.int64)
    data = [np.arange(1, n + 1) for n in lengths]
    T, R = 16, 4
    p = pack(lengths, T, order="none")
    info = _microbatch(p, R)
    assert p.num_rows == R
    b = _collate(data, info)
    cu, mx = b["cu_seqlens"], b["max_seqlen"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == R * T
    seg_lens = (cu[1:] - cu[:-1]).tolist()
    assert min(seg_lens) > 0 and mx == max(seg_lens)
    # positions restart exactly at segment starts; segment ids count the non-empty entries of a row
    flat_pos = b["position_ids"].reshape(-1)
    starts = torch.zeros(R * T, dtype=torch.bool)
    starts[cu[:-1].long()] = True
    assert torch.equal(flat_pos == 0, starts)
    assert int(b["segment_ids"].max()) >= 2 and b["attention_mask"].sum() == lengths.sum() == b["num_tokens"]
    h, d = 2, 8
    q, k, v = (torch.randn(R * T, h, d, dtype=torch.float64) for _ in range(3))
    var = torch.empty_like(q)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        var[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                  v[s:e].transpose(0, 1), is_causal=True).transpose(0, 1)
    mask = block_causal_mask(b["segment_ids"])
    dense = F.scaled_dot_product_attention(*(x.view(R, T, h, d).transpose(1, 2) for x in (q, k, v)),
                                           attn_mask=mask[:, None]).transpose(1, 2).reshape(R * T, h, d)
    real = b["segment_ids"].reshape(-1) != 0
    torch.testing.assert_close(var[real], dense[real])


def test_labels_never_cross_entries_and_split_chunks_keep_every_target():
    T = 8
    data = [np.arange(100, 119), np.arange(200, 203), np.arange(300, 305), np.array([], dtype=np.int64)]
    lengths = np.array([len(x) for x in data], dtype=np.int64)
    p = pack(lengths, T, split_long=True, order="none")
    info = _microbatch(p, p.num_rows)
    b = _collate(data, info)
    labels, ids, seg = b["labels"], b["input_ids"], b["segment_ids"]
    # shifted labels: the next token of the same sample, never of another entry
    targets = {}
    for row in range(p.num_rows):
        for c in range(T):
            if labels[row, c] != -100:
                assert seg[row, c] != 0
                if c + 1 < T and seg[row, c + 1] == seg[row, c]:
                    assert labels[row, c] == ids[row, c + 1]
                targets.setdefault(int(ids[row, c]) // 100, []).append(int(labels[row, c]))
    # over all chunks of a split sample, the targets are exactly sample[1:], as without packing
    assert sorted(targets[1]) == list(range(101, 119))
    assert sorted(targets[2]) == [201, 202] and sorted(targets[3]) == [301, 302, 303, 304]
    assert b["loss_tokens"] == int(b["loss_mask"].sum()) == 18 + 2 + 4
    assert b["step_loss_tokens"] == b["loss_tokens"]  # step = this microbatch here
    # unshifted labels (models that shift internally) would lose the target across each split chunk's
    # boundary: PackedCollate refuses them for a microbatch with split chunks
    with pytest.raises(PlanError, match=r"^step 0: labels='unshifted' cannot keep the target across a --split-long"):
        _collate(data, info, labels="unshifted")
    # the low-level layout: the inputs, first token of each entry masked
    u = collate_packed([data[i] for i in info.sample_ids], info.sample_lengths, info.sample_rows, info.sample_starts,
                       seq_len=T, rows=p.num_rows,
                       shift_labels=False)
    first = (u["position_ids"] == 0) & (u["segment_ids"] != 0)
    assert torch.all(u["labels"][first] == -100)
    keep = (u["segment_ids"] != 0) & ~first
    assert torch.equal(u["labels"][keep], u["input_ids"][keep])
    assert torch.all(u["labels"][u["segment_ids"] == 0] == -100)


def test_dict_items_padding_and_errors():
    data = [{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(1, 4)}]
    b = collate_packed(data, [5, 3], [0, 1], [0, 0], seq_len=6, rows=3, sample_ids=[0, 1], pad_id=-1)
    assert b["input_ids"][2].tolist() == [-1] * 6  # a padding row
    assert b["cu_seqlens"].tolist() == [0, 5, 6, 9, 12, 18] and b["max_seqlen"] == 6
    assert b["segment_ids"][2].tolist() == [0] * 6 and torch.all(b["labels"][2] == -100)
    with pytest.raises(PackedLayoutError, match=r"^sample 1 has 3 tokens but the plan packs tokens 0\.\.4 of it"):
        collate_packed(data, [5, 4], [0, 1], [0, 0], seq_len=6, rows=2, sample_ids=[0, 1])
    with pytest.raises(PackedLayoutError,
                       match=r"^packed microbatch: row 0 holds 8 tokens, more than the row length 6"):
        collate_packed(data, [5, 3], [0, 0], [0, 0], seq_len=6, rows=1)
    with pytest.raises(PackedLayoutError, match="entries are not in row order"):
        collate_packed(data, [5, 3], [1, 0], [0, 0], seq_len=6, rows=2)
    info = Microbatch(epoch=0, step=0, rank=0, micro=0, sample_ids=np.array([0, 1]), num_samples=2, seqlen=6,
                      batch_size=2, tokens=8, lr_scale=1.0, shape_id=0, step_samples=2, step_tokens=8)
    with pytest.raises(PackedLayoutError, match="this plan is not packed"):
        _collate(data, info)
    with pytest.raises(PackedLayoutError, match="needs the plan row"):
        PackedCollate()(list(data))


def test_packed_plan_end_to_end(tmp_path):
    """analyze -> plan --packing --split-long -> Plan + dataloader_for_plan + PackedCollate on two
    ranks: every token of the tokenised Parquet data is trained on exactly once, in R x T rows."""
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.loader import Plan, dataloader_for_plan
    from varlen_cli.plan.core import PlanConfig, plan

    analyze(AnalyzeConfig(sources=(sample("tokenized.parquet"),), output=str(tmp_path / "m"), length="list:input_ids",
                          progress=False))
    res = plan(PlanConfig(input=str(tmp_path / "m"), output=str(tmp_path / "p.parquet"), packing=True, seq_len=128,
                          rows_per_microbatch=4, max_per_row=16, split_long=True, dp=2, grad_accum=2))
    assert res.packing["efficiency"] > 0.99
    data = _tokens()
    covered = [np.zeros(len(x), dtype=np.int64) for x in data]
    for rank in (0, 1):
        loader = dataloader_for_plan(data, Plan.open(str(tmp_path / "p.parquet")), rank=rank, world_size=2,
                                     collate_fn=PackedCollate(), lr_scale="ignore")
        for b in loader:
            info = b["info"]
            assert b["input_ids"].shape == (4, 128) and int(b["attention_mask"].sum()) == info.tokens
            col = np.zeros(4, dtype=np.int64)
            for sid, ln, row, start in zip(info.sample_ids, info.sample_lengths, info.sample_rows, info.sample_starts):
                got = b["input_ids"][row, col[row]:col[row] + ln].numpy()
                assert np.array_equal(got, data[sid][start:start + ln])
                covered[sid][start:start + ln] += 1
                col[row] += ln
    assert all(np.all(c == 1) for c in covered)
