"""The planner: every plan, beyond one machine's memory, the same bytes for any worker count (issues
25, 30): a metrics or sorted directory, a mixture (``--mix``), a replan's epochs and the epochs an
extension appends.

Design
======

The planner's unit of work is a **chunk**: a fixed set of input samples that does not depend on
the number of workers. A plan is a function of its chunks, so 1, 2 or 4 workers (``--nproc`` or
torchrun ranks) that share the chunks out write the same file; world size 1 is the same algorithm
run by one worker. What the chunks are cut from is a **chunk source** (:mod:`.sources`): the rows
of a metrics or sorted directory, or a mixture's *virtual rows* (one per copy of a sample), each a
sequence read by ranges.

Chunks
------
``K = ceil(N / C)`` chunks of balanced size (``C = --chunk-samples``, default 2^23), each between
``C / 2`` and ``C`` samples (:mod:`.chunks`):

* ``random`` and ``bucket-shuffle`` (and the epochs after ``--curriculum-epochs``): sample-id
  ranges: chunk ``k`` holds the ids ``[N k / K, N (k+1) / K)`` (the canonical order, so the plan
  does not depend on whether the input is a metrics or a sorted directory);
* ``curriculum`` / ``reverse``: ranges of the sorted input's rows (sorted runs of ``varlen sort``),
  read in (reversed) order;
* a mixture: ranges of its virtual rows, for every order: source after source, each its rows
  ``floor(w)`` times then its seeded extra subset; or, for a curriculum, sorted by (difficulty,
  source, id) over the union, merged from sorted runs of each source's rows written once in a phase 0
  (:class:`.sources.MixtureInput`).

Chunk ``k`` of epoch ``e`` draws from its own seeded stream ``(seed, e, k)`` (``(seed, e)`` for
``k = 0``, so a one-chunk plan draws what an epoch formed whole draws); the steps formed across
chunks draw from ``(seed, e, 0, 1)``.

Phase 1: forming (parallel, memory bounded by the chunk)
--------------------------------------------------------
Each worker forms its chunks (job ``j`` = (epoch, chunk) goes to worker ``j mod W``) with the
planner's own formers (``orders.Formers``: greedy sequence, bucket-shuffle, random, packing), on
the chunk's samples alone, and writes per chunk into the output's temporary directory
(:mod:`.spill`):

* the chunk's **unit table**: one row per microbatch (padded) or packed row (packed) with what
  the layout and the statistics need (samples, seqlen, batch size, tokens, loss targets, ...);
* its **items** (sample ids, and the packed per-sample columns) in unit order, as raw arrays
  (sample ids as uint32 offsets from the chunk's first id where they fit);
* its **tail candidates**: the ``dp x grad_accum`` fullest units with the statistics of their
  two halves (see "Tail").

Bucket-shuffle shuffles a chunk's microbatches inside the chunk before they are written (so the
cross-chunk order below can take them in sequence). Nothing of a chunk stays in memory after it
is written: a worker's peak is one chunk's formation, whatever N.

Phase 2: steps and ranks (the unit table only; shared out by the ranks)
-----------------------------------------------------------------------
The unit tables (about N / mean samples per microbatch rows) are concatenated in chunk order, one
chunk's column at a time into columns allocated once in the smallest dtype their values need (the
chunks' headers give each column's largest value; a packed row of ``--seq-len`` < 65536 takes 2
bytes a column, ~12 bytes a row with its first item; a unit's chunk follows from the chunk starts),
and the epoch is laid out exactly as one process would lay out one big chunk (rank 0's memory:
benchmarks/scale.md, "Rank 0 memory"):

* **Tail**: the epoch's microbatch count must be a multiple of ``dp x grad_accum``: the fullest
  units are split in two, chosen globally by (most samples, chunk, position) among the chunks'
  candidates, which is what the rule picks on the whole sequence (:mod:`varlen_cli.plan.tail`); the
  halves take the unit's place. (If fewer units than needed have two samples, the chunks report all
  such units with their lengths and the rule's rounds run on them.) Packed plans spread each chunk's rows over its
  microbatches; the extra microbatches go to the last chunks that have rows to spare, else rows
  are split the same way.
* **Order**: curriculum/reverse keep the chunks' sequences one after the other; every other order
  takes a uniformly random interleaving of the chunks' sequences (a random permutation of the
  multiset of chunk labels), which, each chunk's sequence being shuffled, is a uniformly random
  order of all microbatches. It is drawn a block of positions at a time (``epoch.interleave``): how
  many units each block takes from each chunk (a multivariate hypergeometric draw per block, from
  what the chunks have left), then each block's labels shuffled by a stream of its own.
* **Bucket-shuffle balance**: as before, microbatches are sorted by cost inside windows of 64
  steps and cut into steps; the steps are then shuffled *inside their window* (the windows are
  already random), so the step order stays random while every window reads a contiguous run of
  each chunk's sequence.
* **Ranks**: ``layout.layout_epoch`` (LPT per step, compile warm-up, ``--schedule``) on the table,
  unchanged; LR scales, statistics and metadata from the table (:mod:`.finish`).
* **Shared by W > 1 workers** (``epoch.lay_out``'s ``share``): once the units, their tail and the
  blocks' label counts are drawn, the epoch's positions fall into independent blocks (the rank
  layout's blocks of whole steps, bucket-shuffle's blocks of whole windows: ``epoch.split_block``).
  Every rank reads the unit tables and computes the same units and the same random draws (the
  label counts and seeds of every block, the labels of its own blocks only; bucket-shuffle's one
  draw a step, drawn for the whole epoch at once, the same stream as drawn block by block), then
  orders and lays out only its own contiguous run of blocks
  (``epoch.shares``: rank 0 the fewest, as it goes on to the columns; an epoch of one block, as with a
  compile warm-up or a schedule, which look across the epoch, or ``--same-shape-per-step`` on a random
  order, which rewrites units across it, is rank 0's). The other ranks write their part of the order
  into the spill directory (``e{E}-r{R}.order.npy``), rank 0 reads them into its epoch: the same
  order as one worker's, the units' table held by every rank for the time of the layout. (So the
  layout is shared only while every node's ranks can each hold one in the memory free then,
  ``run.layout_is_shared``; else rank 0 lays the epochs out alone: the same plan.) Each rank
  also tallies what ``finish`` needs from its rows (``finish.Tally``: per-step sums and straggler,
  shapes, the budget check, sums; the straggler's float sums kept per block and added up in block
  order, so the metadata has the same bits as one worker's), and rank 0's columns phase merges the
  tallies.

Phase 3: writing (every worker, bounded buffers)
------------------------------------------------
The plan is written row group by row group (``writer``'s Parquet settings, ~4096 microbatches a
group), each checked on the way by the planner's own check (:mod:`varlen_cli.checks`, what ``varlen
validate`` runs). For each group the writer knows, per chunk, which units it needs; they lie in a
short run of the chunk's items file (the interleaving takes each chunk's units in order; warm-up and
schedule reorders are within a step or a handful of units), read with ``pread`` of that run only
(:mod:`.emit`). Memory: one row group's samples plus the read runs.

One worker streams the plan into the output's temporary file. ``W > 1`` workers share it out
(:mod:`.segments`): the row groups are cut into segments of a fixed number of groups; rank 0 writes
each segment's row specs (the rows' unit columns and item addresses, ~30 bytes a row) into the spill
directory, publishing each as soon as it is written (renamed into place), while the other workers
already claim segments (waiting for a claimed segment's spec) and write them as Parquet files,
checking them with their own check; rank 0 joins the claiming after its last spec. Rank 0 merges the
checks (the results of one check fed every group) and joins the segments' row groups into one file
by copying their bytes (``runtime.parquet_concat``): the bytes one writer writes, whoever wrote which
segment.

Quality
-------
Chunks change the plan only at their edges: per chunk, at most one partly filled microbatch (the
greedy sequence's last) or a few packed rows above the chunk's lower bound; the tail splits and
the step layout are global. With chunks of >= 4M samples (~130k microbatches at 30 samples each)
that is < 0.001 points of budget fill per chunk edge, far inside the 0.05-point target between a
1B plan and a 10M one-chunk plan; straggler is the same computation on the same table.
Packed curriculum plans pack each sorted run separately: when difficulty is the length, a run
of similar lengths packs worse than the whole data set would (documented in docs/plan.md).

Exactly once
------------
Every sample of a chunk is in exactly one unit of that chunk (the formers' own guarantee, checked
per chunk); chunks partition the input; phase 2 only reorders units or splits one into two
contiguous halves; the writer emits each unit's item range once. ``varlen validate`` checks it
again on the written file with a bitmap of one bit per sample (``varlen_cli.validate``).

Continuations: ``--extend`` and ``replan``
-----------------------------------------
A plan may continue another (``run.Continuation``): its epochs are numbered from the parent's
(``first_epoch``: the seed streams ``(seed, first_epoch + e, k)``, the curriculum switch, no compile
warm-up after epoch 0), use the parent's recorded budget, and for ``varlen replan`` the first epoch's
chunks hold only what the parent's epoch in progress had left (``sources.Left``, read from the parent
window by window: a bitmap of one bit per sample id left whole; for a mixture, the copies of each
sample left; and, when a ``--split-long`` sample has chunks on both sides of the step, the chunks left
of the split samples as *pieces*, which keep their cuts and are placed right after their sample's
place in its chunk). The chunks are the parent's (its ``--chunk-samples``), so a continued epoch is
the epoch a fresh plan of the same options plans. ``plan --extend`` then joins the parent's row groups
and the new ones (``plan/extend_stream.py``).

Failure
-------
Everything is written inside the output's temporary directory; any worker's failure fails the
job (``runtime.dist``; an error in phase 2 or 3 is every worker's: a rank's error in its share of the
layout is raised on every rank, and rank 0 failing while it publishes the specs leaves a marker that
stops the workers waiting for one), the temporary is removed and an existing plan stays as it was.
"""
