"""Exact closed forms of the greedy schedule where one exists (vectorised over steps).

``costs`` is ``(rows, n)``: one unit's microbatch costs per step, ``r`` the backward ratio. Both
functions return start times ``(rows, J)`` in the job numbering of :mod:`.engine`; the tests check
them against the greedy scheduler on random costs.

Chain (DDP, FSDP: a worker runs its microbatches one after the other, each forward through all S
stages then backward): with ``T_i = (1 + r) S (c_0 + ... + c_{i-1})``,
``F(s, i)`` starts at ``T_i + s c_i`` and ``B(s, i)`` at ``T_i + S c_i + (S - 1 - s) r c_i``.

GPipe (a proportionate flow shop each way): with ``C_i = c_0 + ... + c_i`` and
``M_i = max(c_0 .. c_i)``, ``F(s, i)`` ends at ``C_i + s M_i``; the backward starts when the last
forward ends, ``T_F = C_{n-1} + (S - 1) M_{n-1}``, and ``B(s, i)`` ends at
``T_F + r (C_i + (S - 1 - s) M_i)``. Makespan ``(1 + r)(C_{n-1} + (S - 1) M_{n-1})``, which is
``(1 + r)(n + S - 1)`` for unit costs.
"""

from __future__ import annotations

import numpy as np


def chain_starts(costs: np.ndarray, stages: int, r: float) -> np.ndarray:
    rows, n = costs.shape
    s = np.arange(stages)[None, :, None]
    before = np.cumsum(costs, axis=1) - costs
    t0 = ((1.0 + r) * stages * before)[:, None, :]
    c = costs[:, None, :]
    forward = t0 + s * c
    backward = t0 + stages * c + (stages - 1 - s) * r * c
    return np.stack([forward, backward], axis=1).reshape(rows, 2 * stages * n)


def gpipe_starts(costs: np.ndarray, stages: int, r: float) -> np.ndarray:
    rows, n = costs.shape
    s = np.arange(stages)[None, :, None]
    total = np.cumsum(costs, axis=1)[:, None, :]
    peak = np.maximum.accumulate(costs, axis=1)[:, None, :]
    c = costs[:, None, :]
    forward = total + s * peak - c
    t_f = total[:, :, -1:] + (stages - 1) * peak[:, :, -1:]
    backward = t_f + r * (total + (stages - 1 - s) * peak) - r * c
    return np.stack([forward, np.broadcast_to(backward, forward.shape)], axis=1).reshape(rows, 2 * stages * n)
