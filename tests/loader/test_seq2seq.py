"""Encoder-decoder batches of a two-budget plan (``varlen plan --max-target-tokens``, issue 36): the default
collate pads each source to ``seqlen`` and each target to ``target_seqlen`` (decoder inputs shifted right from
the start token, labels -100 after the target), counts the targets as the loss tokens, and refuses items and
plans it cannot collate in one line."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.plan_helpers import write_metrics
from varlen_cli.loader import PadCollate, Plan, PlanError, dataloader_for_plan
from varlen_cli.loader.collate import Samples
from varlen_cli.loader.model_inputs import to_model_inputs
from varlen_cli.plan import PlanConfig, plan

RNG = np.random.default_rng(11)
SRC, TGT = RNG.integers(1, 60, 90), RNG.integers(0, 45, 90)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, src=SRC, tgt=TGT):
        self.items = [{"input_ids": np.arange(1, s + 1) % 50 + 2, "labels": np.arange(t) % 40 + 3}
                      for s, t in zip(src, tgt)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    root = tmp_path_factory.mktemp("s2s")
    metrics = write_metrics(root / "m", SRC, targets=TGT)
    out = {}
    for name, extra in (("two", dict(max_target_tokens=200, pad_multiple=4)), ("one", {})):
        out[name] = str(root / f"{name}.parquet")
        plan(PlanConfig(input=metrics, output=out[name], max_tokens=300, dp=2, grad_accum=2, progress=False, **extra))
    return out


def test_the_default_collate_pads_targets_to_target_seqlen(plans):
    plan_ = Plan.open(plans["two"])
    seen = []
    for rank in range(2):
        for batch in dataloader_for_plan(Pairs(), plan_, rank=rank, world_size=2):
            info = batch["info"]
            b, t, u = info.batch_size, info.seqlen, info.target_seqlen
            assert batch["input_ids"].shape == batch["attention_mask"].shape == (b, t)
            assert batch["decoder_input_ids"].shape == batch["decoder_attention_mask"].shape == (b, u)
            assert batch["labels"].shape == (b, u) and b * u <= 200 and b * t <= 300
            for row, sid in enumerate(info.sample_ids):
                src, tgt = Pairs().items[sid]["input_ids"], Pairs().items[sid]["labels"]
                assert batch["input_ids"][row, :len(src)].tolist() == src.tolist()
                assert not batch["attention_mask"][row, len(src):].any()
                assert batch["labels"][row, :len(tgt)].tolist() == tgt.tolist()
                assert (batch["labels"][row, len(tgt):] == -100).all()
                want = [0] + tgt[:-1].tolist() if len(tgt) else []  # the start token (pad_id 0), then shifted right
                assert batch["decoder_input_ids"][row, :len(tgt)].tolist() == want
                assert batch["decoder_attention_mask"][row].sum() == len(tgt)
            assert batch["loss_tokens"] == int(TGT[info.sample_ids].sum()) == int(batch["loss_mask"].sum()) \
                == info.target_tokens
            assert batch["num_items_in_batch"] == batch["step_loss_tokens"] == info.step_loss_tokens
            assert batch["label_convention"] == "seq2seq"
            inputs = to_model_inputs(batch)
            assert sorted(inputs) == ["attention_mask", "decoder_attention_mask", "decoder_input_ids", "input_ids",
                                      "labels"] and inputs["labels"] is batch["labels"]
            seen += info.sample_ids.tolist()
    assert sorted(seen) == list(range(90))


def test_what_the_collate_cannot_collate_is_refused_in_one_line(plans):
    two, one = Plan.open(plans["two"]), Plan.open(plans["one"])
    info = two.microbatch(0, 0, 0)
    items = [Pairs().items[i] for i in info.sample_ids]
    with pytest.raises(PlanError, match="^" + re.escape(
            "an encoder-decoder batch (a plan with target_seqlen, or seq2seq=True) needs dataset items that are dicts "
            f"holding the source under 'input_ids' and the target under 'labels'; sample {info.sample_ids[0]} has no "
            "'labels'") + "$"):
        PadCollate()(Samples([{"input_ids": items[0]["input_ids"]}] + items[1:], info))
    longer = [dict(items[0], labels=np.arange(info.target_seqlen + 1))] + items[1:]
    with pytest.raises(PlanError, match="^" + re.escape(
            f"sample {info.sample_ids[0]} has a target of {info.target_seqlen + 1} tokens but its microbatch (step 0) "
            f"is planned at target_seqlen {info.target_seqlen}: the plan was made for different target lengths "
            "(another dataset, target column or tokenizer)") + "$"):
        PadCollate()(Samples(longer, info))
    plain = one.microbatch(0, 0, 0)
    with pytest.raises(PlanError, match="^" + re.escape(
            "step 0: PadCollate(seq2seq=True) pads targets to the plan's target_seqlen, but the plan has none: make "
            "it with `varlen plan --max-target-tokens M` (docs/plan.md, \"Two budgets\")") + "$"):
        PadCollate(seq2seq=True)(Samples([Pairs().items[i] for i in plain.sample_ids], plain))


def test_targets_other_than_the_plan_counted_are_refused_in_one_line(plans):
    """Every target one token short (no EOS, say): the source side and target_seqlen fit, but the loss tokens
    would not be the step_loss_tokens the plan counted; the exact targets pass."""
    two = Plan.open(plans["two"])
    info = next(two.microbatch(s, 0, m) for s in range(two.num_steps) for m in range(2)
                if (TGT[two.microbatch(s, 0, m).sample_ids] > 0).sum() > 1)
    items = [Pairs().items[i] for i in info.sample_ids]
    assert info.target_tokens == int(TGT[info.sample_ids].sum()) == PadCollate()(Samples(items, info))["loss_tokens"]
    short = [dict(item, labels=item["labels"][:-1]) for item in items]
    found = info.target_tokens - int((TGT[info.sample_ids] > 0).sum())
    with pytest.raises(PlanError, match="^" + re.escape(
            f"step {info.step} micro {info.micro}: the targets of the microbatch's samples hold {found} tokens but "
            f"the plan counted {info.target_tokens} (target_tokens): the dataset's targets differ from what `varlen "
            "analyze --target-length` counted; tokenize them with the same tokenizer and special tokens (EOS), or "
            "re-run `varlen analyze --target-length` and `varlen plan` on this dataset") + "$"):
        PadCollate()(Samples(short, info))
    with pytest.raises(PlanError, match=r"^step \d+ micro \d+: the targets of the microbatch's samples hold \d+ "
                       r"tokens but the plan counted \d+ \(target_tokens\)"):  # through the plan's dataloader
        for _ in dataloader_for_plan(Pairs(tgt=np.maximum(TGT - 1, 0)), two, rank=0, world_size=2):
            pass


def test_without_a_plan_seq2seq_pads_to_the_longest_target():
    batch = PadCollate(seq2seq=True, pad_multiple=8, decoder_start_token_id=1)(
        [{"input_ids": [5, 6, 7], "labels": [8, 9]}, {"input_ids": [5], "labels": [4, 4, 4, 4, 4, 4, 4, 4, 4]}])
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].shape == (2, 16)
    assert batch["decoder_input_ids"][0, :3].tolist() == [1, 8, 0] and batch["loss_tokens"] == 11
