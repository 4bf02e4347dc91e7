"""Where a chunked plan goes, and where its chunk files stay meanwhile.

A local plan is locked, built beside the output (``.NAME.varlen-tmp-*``) and swapped in
(``runtime.artifacts.AtomicFile``); its chunk files go beside it too (``.NAME.varlen-tmp-spill-*``,
removed at the end, or by the next run after a kill). A plan in object storage (``-o s3://...``)
is built in a local temporary file and uploaded in one PUT (``runtime.remote_output``); its chunk
files go to a local temporary directory, which the workers of one machine share (``--nproc``, or a
torchrun job on one node).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

from ... import storage
from ...errors import UsageError
from ...runtime import artifacts, safety

SPILL_TAG = safety.TMP_TAG + "-spill"  # .NAME.varlen-tmp-spill-<random>: a leftover the next run cleans


class PlanOutput:
    def __init__(self, path: str, overwrite: bool):
        self.given, self.overwrite = path, overwrite
        self.remote = storage.is_remote(path)
        self.local = None if self.remote else artifacts.AtomicFile(path, overwrite)

    @property
    def final(self) -> str:
        """The output as the result reports it."""
        return self.given if self.remote else os.path.abspath(self.given)

    def check(self, inputs=()) -> None:
        """Refuse an output that exists without ``--overwrite`` (or is not a plan), lies in an input, ..."""
        safety.check_no_overlap(self.given, inputs)
        if self.remote:
            from ...runtime.remote_output import check_file

            check_file(self.given, self.overwrite)
            return
        self.local.check()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the output's lock (local outputs; re-entrant under a ``--nproc`` launcher)."""
        if self.remote:
            yield
            return
        with safety.output_lock(self.local.path, self.given):
            self.local.check()
            yield

    def make_spill_dir(self, world_size: int) -> str:
        """Rank 0: the directory every worker writes its chunk files into."""
        if not self.remote:
            path = safety.sibling(self.local.path, SPILL_TAG, unique=True)
            os.makedirs(path)
            return path
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if world_size > 1 and local_world != world_size:
            raise UsageError(f"a plan written to object storage ({self.given}) by a torchrun job on several nodes has "
                             "no shared place for the workers' chunk files; write it to a shared filesystem (or run "
                             "on one node with --nproc) and upload it")
        return tempfile.mkdtemp(prefix="varlen-plan-spill-")

    @staticmethod
    def remove_spill_dir(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def write(self, fill: Callable[[str], None], before_commit: Callable[[], None] = lambda: None) -> None:
        """``fill(tmp)`` writes the plan into a temporary file, which then becomes the output (or nothing
        does, on any failure)."""
        if self.remote:
            from ...runtime.remote_output import remote_atomic_file

            with remote_atomic_file(self.given, self.overwrite) as rf:
                fill(rf.tmp)
                before_commit()
            return
        try:
            fill(self.local.tmp)
            before_commit()
            self.local.commit()
        except BaseException:
            self.local.abort()
            raise
