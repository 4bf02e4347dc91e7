"""Megatron-core on a plan: a corpus written by megatron-core's own ``IndexedDatasetBuilder`` (documents of
several sequences, empty sequences among them), ``varlen analyze PREFIX`` -> ``varlen plan --packing`` ->
``plan_iterator`` with nothing re-exported: items equal the written sequences, THD microbatches hold
exactly each plan row's sequences with its ``cu_seqlens``, megatron-core's ``PackedSeqParams`` and
num-microbatches calculator take them, the iterator resumes exactly from its state or Megatron's
iteration, and another data-parallel degree is refused then accepted after ``varlen replan``.

Megatron's schedules (``forward_backward_func``) allocate on CUDA: no GPU is lent to these tests, so
the data side is tested here on the CPU, in one process with explicit data-parallel ranks.
"""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from typer.testing import CliRunner  # noqa: E402

from tests.formats_helpers import random_docs, write_megatron  # noqa: E402
from varlen_cli.analyze import AnalyzeConfig, analyze  # noqa: E402
from varlen_cli.cli import app  # noqa: E402
from varlen_cli.errors import InputError, PlanError  # noqa: E402
from varlen_cli.integrations.megatron import IndexedDocuments, packed_seq_params, plan_iterator  # noqa: E402
from varlen_cli.loader import Plan  # noqa: E402
from varlen_cli.plan import PlanConfig, plan  # noqa: E402

DOCS = random_docs(220, seed=7, max_len=60)  # [[sequence, ...], ...]; some sequences are empty
SEQUENCES = [np.asarray(s, dtype=np.int64) for doc in DOCS for s in doc]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("megatron")
    prefix = str(folder / "corpus_text_document")
    write_megatron(prefix, DOCS, dtype=np.uint16)  # megatron-core's IndexedDatasetBuilder
    metrics = str(folder / "metrics")
    analyze(AnalyzeConfig(sources=(prefix,), output=metrics, progress=False))
    packed = str(folder / "packed.parquet")
    plan(PlanConfig(input=metrics, output=packed, packing=True, seq_len=64, max_tokens=128, dp=2, grad_accum=2,
                    epochs=2, lr_scaling="none"))
    return folder, prefix, Plan.open(packed)


def _run(it, count=None) -> list:
    out = []
    for batch in it:
        out.append(batch)
        if count is not None and len(out) == count:
            break
    return out


def test_items_are_the_written_sequences_by_analyze_sample_id(corpus):
    import pyarrow.dataset as pads

    folder, prefix, _ = corpus
    ds = IndexedDocuments(prefix)
    assert len(ds) == len(SEQUENCES)
    for i, seq in enumerate(SEQUENCES):
        assert ds[i].dtype == np.int64 and np.array_equal(ds[i], seq)
    table = pads.dataset(str(folder / "metrics"), format="parquet").to_table(columns=["sample_id", "length"])
    order = np.argsort(table.column("sample_id").to_numpy())
    assert np.array_equal(table.column("sample_id").to_numpy()[order], np.arange(len(ds)))
    assert np.array_equal(table.column("length").to_numpy()[order], [len(s) for s in SEQUENCES])
    # two prefixes: numbered as `varlen analyze A B` numbers them (sorted paths, sequences in file order)
    other = str(folder / "a_first")
    write_megatron(other, DOCS[:3], dtype=np.int32)
    both = IndexedDocuments([prefix, other + ".idx"])
    head = sum(len(d) for d in DOCS[:3])
    assert len(both) == head + len(SEQUENCES) and np.array_equal(both[head], SEQUENCES[0])


def test_a_bin_that_does_not_match_its_idx_is_refused(corpus, tmp_path):
    _, prefix, _ = corpus
    copy = str(tmp_path / "c")
    with open(prefix + ".idx", "rb") as src, open(copy + ".idx", "wb") as dst:
        dst.write(src.read())
    with open(prefix + ".bin", "rb") as src, open(copy + ".bin", "wb") as dst:
        data = src.read()
        dst.write(data[:-2])
    with pytest.raises(InputError, match=rf"^Megatron data {copy}.bin has {len(data) - 2:,} bytes, but its index "
                                         rf"{copy}.idx ends its last sequence at byte {len(data):,} \(truncated, "
                                         rf"or not the index's data\)$"):
        IndexedDocuments(copy)


def test_thd_microbatches_are_the_plan_rows(corpus):
    _, prefix, packed = corpus
    ds = IndexedDocuments(prefix)
    for rank in range(2):
        batches = _run(plan_iterator(packed, ds, rank=rank, world_size=2, num_microbatches=2))
        want = [(packed.epoch_of(s), s, rank, m) for s in range(packed.num_steps) for m in range(2)]
        assert [tuple(b["plan_position"].tolist()) for b in batches] == want
        for batch in batches:
            _, step, _, micro = batch["plan_position"].tolist()
            row = packed.microbatch(step, rank, micro)
            docs = [SEQUENCES[i] for i in row.sample_ids if len(SEQUENCES[i])]
            cu = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
            assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == cu.tolist()
            tokens, labels, mask = batch["tokens"][0], batch["labels"][0], batch["loss_mask"][0]
            positions = batch["position_ids"][0]
            for d, a, b in zip(docs, cu[:-1], cu[1:]):
                assert tokens[a:b].tolist() == d.tolist() and positions[a:b].tolist() == list(range(len(d)))
                assert labels[a:b - 1].tolist() == d[1:].tolist() and labels[b - 1] == -100
                assert mask[a:b - 1].eq(1).all() and mask[b - 1] == 0
            assert int(batch["max_seqlen"][0]) == max(len(d) for d in docs)
            assert batch["loss_tokens"] == int(mask.sum()) == sum(len(d) - 1 for d in docs)
            params = packed_seq_params(batch)  # megatron-core's own dataclass
            assert params.qkv_format == "thd" and torch.equal(params.cu_seqlens_q, batch["cu_seqlens"])
            assert params.cu_seqlens_kv is params.cu_seqlens_q
            assert params.max_seqlen_q == params.max_seqlen_kv == int(batch["max_seqlen"][0])


def test_step_loss_tokens_over_ranks_and_micros(corpus):
    _, prefix, packed = corpus
    ds = IndexedDocuments(prefix)
    streams = [_run(plan_iterator(packed, ds, rank=r, world_size=2, num_microbatches=2)) for r in range(2)]
    for s in range(packed.num_steps):
        batches = [b for stream in streams for b in stream[2 * s:2 * s + 2]]
        assert {b["step_loss_tokens"] for b in batches} == {sum(int(b["loss_mask"].sum()) for b in batches)}


def test_padded_plan_is_megatrons_bshd_batch(corpus):
    folder, prefix, _ = corpus
    padded = str(folder / "padded.parquet")
    plan(PlanConfig(input=str(folder / "metrics"), output=padded, max_tokens=256, dp=2, grad_accum=2, epochs=1,
                    lr_scaling="none"))
    batch = next(plan_iterator(padded, IndexedDocuments(prefix), rank=0, world_size=2, num_microbatches=2))
    row = batch["info"]
    assert batch["tokens"].shape == batch["labels"].shape == batch["position_ids"].shape == (row.batch_size, row.seqlen)
    assert batch["attention_mask"] is None and batch["loss_mask"].dtype == torch.float32
    for r, sid in enumerate(row.sample_ids):
        seq = SEQUENCES[sid]
        assert batch["tokens"][r, :len(seq)].tolist() == seq.tolist()
        assert batch["loss_mask"][r].sum() == max(len(seq) - 1, 0)
    with pytest.raises(PlanError, match="^this batch is not THD"):
        packed_seq_params(batch)


def test_num_microbatches_is_checked_against_megatron(corpus):
    from megatron.core import num_microbatches_calculator as calc

    _, prefix, packed = corpus
    ds = IndexedDocuments(prefix)
    with pytest.raises(PlanError, match=r"^Megatron runs 4 microbatches a step but the plan was made with --grad-accum "
                                        r"2: set --global-batch-size to --micro-batch-size x dp x 2 \(no "
                                        r"--rampup-batch-size\), or re-plan with --grad-accum 4$"):
        plan_iterator(packed, ds, rank=0, world_size=2, num_microbatches=4)
    assert plan_iterator(packed, ds, rank=0, world_size=2).num_microbatches == 2  # nothing configured: the plan's
    try:  # Megatron's own calculator: --global-batch-size 4 --micro-batch-size 1 on 2 data-parallel ranks
        calc.init_num_microbatches_calculator(0, None, 4, 1, 2)
        it = plan_iterator(packed, ds, rank=0, world_size=2)
        _run(it, 2)
        calc.unset_num_microbatches_calculator()
        calc.init_num_microbatches_calculator(0, None, 8, 1, 2)  # 4 a step from now on
        with pytest.raises(PlanError, match="^Megatron runs 4 microbatches a step"):
            next(it)
    finally:
        calc.unset_num_microbatches_calculator()


def test_resume_from_state_and_from_iteration(corpus, tmp_path):
    _, prefix, packed = corpus
    ds = IndexedDocuments(prefix)
    full = _run(plan_iterator(packed, ds, rank=1, world_size=2, num_microbatches=2))
    k = packed.steps_per_epoch[0] + 1  # mid epoch 1
    it = plan_iterator(packed, ds, rank=1, world_size=2, num_microbatches=2)
    _run(it, 2 * k)
    torch.save({"dataloader_state_dict": it.save_state()}, tmp_path / "train_dataloader_dprank001.pt")
    state = torch.load(tmp_path / "train_dataloader_dprank001.pt")["dataloader_state_dict"]
    resumed = plan_iterator(packed, ds, rank=1, world_size=2, num_microbatches=2, state=state)
    from_iteration = plan_iterator(packed, ds, rank=1, world_size=2, num_microbatches=2, iteration=k)
    for rest in (_run(resumed), _run(from_iteration)):
        assert [b["plan_position"].tolist() for b in rest] == [b["plan_position"].tolist() for b in full[2 * k:]]
        assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(rest, full[2 * k:]))
    assert state["ledger"] is not None  # the position travels with the ledger of what was trained


def test_another_data_parallel_degree_refused_then_accepted_after_replan(corpus):
    folder, prefix, packed = corpus
    ds = IndexedDocuments(prefix)
    n = 3
    it = plan_iterator(packed, ds, rank=0, world_size=2, num_microbatches=2)
    _run(it, 2 * n)
    state = it.state_dict()
    command = f"varlen replan {packed.path} --from-step {n} --dp 3 -o packed-dp3.parquet"
    message = (f"the checkpoint was saved at step {n} on 2 data-parallel rank(s) but this job has 3: make the rest of "
               f"the plan for 3 with `{command}` and resume from this checkpoint with that plan")
    for kwargs in ({"state": state}, {"iteration": n}):
        with pytest.raises(PlanError) as err:
            plan_iterator(packed, ds, rank=2, world_size=3, num_microbatches=2, **kwargs)
        assert str(err.value) == message
    out = os.path.join(folder, "packed-dp3.parquet")
    res = CliRunner().invoke(app, ["replan", packed.path, "--from-step", str(n), "--dp", "3", "-o", out])
    assert res.exit_code == 0, res.output
    new = Plan.open(out)
    for rank in range(3):
        for kwargs in ({"state": state}, {"iteration": n}):
            rest = _run(plan_iterator(new, ds, rank=rank, world_size=3, num_microbatches=2, **kwargs))
            assert [b["sample_ids"].tolist() for b in rest] == \
                [new.microbatch(s, rank, m).sample_ids.tolist() for s in range(new.num_steps) for m in range(2)]
