"""Start the ranks of a multi-process test the way torchrun starts them, without re-importing the
frameworks in every process.

``python -m torch.distributed.run`` starts each worker as a new interpreter that imports torch,
transformers, accelerate, lightning... again: about 7 CPU-seconds per process before the first
step, most of what a 2-rank framework test costs. Here one helper process per test process (the
zygote, ``python -m tests.launcher``) imports those once, and each launch forks its ranks from it.
Every rank is a real process with torchrun's worker environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR/MASTER_PORT, TORCHELASTIC_*; the rendezvous
TCPStore is hosted by the launcher, as torchrun's agent hosts it), runs the script as ``__main__``
with its argv, and joins torch.distributed (gloo) by itself exactly as under torchrun. As torchrun
does, a launch whose rank fails stops the other ranks (after a short grace) and a launch past its
timeout is killed. The launcher is checked against the real ``python -m torch.distributed.run``
directly: tests/test_launcher.py runs one script under both and compares every variable torchrun gives
its workers, the process group they join and how a refusal ends (VARLEN_TEST_REAL_TORCHRUN=1 runs every
framework launch under the real command instead).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torchrun's worker environment for the framework tests (the zygote imports with it, so values read at
# import time, such as HF_HUB_OFFLINE or OMP_NUM_THREADS, hold in every rank)
STATIC_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
BASE_IMPORTS = ("torch", "torch.distributed", "numpy", "pyarrow.parquet", "varlen_cli.loader")
FAILURE_GRACE = 10.0  # seconds the other ranks get to finish (and print their own error) after one fails
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default (--signals-to-handle)


# -- the test side -----------------------------------------------------------------------------------
class _Zygote:
    def __init__(self):
        self.log_dir = tempfile.mkdtemp(prefix="varlen-zygote-")
        env = dict(os.environ, **STATIC_ENV)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.launcher"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(os.path.join(self.log_dir, "zygote.err"), "w"),
                                     env=env, cwd=ROOT, text=True, start_new_session=True)

    def request(self, req: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:  # the zygote itself is stuck or died: kill it and its ranks
            log = self.log()[-4000:]
            self.stop(kill=True)
            raise RuntimeError(f"launcher: no answer in {timeout:.0f} s; zygote log:\n" + log)
        return json.loads(line)

    def log(self) -> str:
        with open(os.path.join(self.log_dir, "zygote.err")) as fh:
            return fh.read()

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.stdin.close()
        self.proc.wait(timeout=60)  # reaped: its CPU time (and its ranks') counts in this process's
        shutil.rmtree(self.log_dir, ignore_errors=True)


_zygote: _Zygote | None = None


def _get_zygote() -> _Zygote:
    global _zygote
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = _Zygote()
        atexit.register(_zygote.stop)
    return _zygote


def launch(script: str, *args, nproc: int = 2, timeout: float = 420, cwd: str = ROOT, env: dict | None = None,
           imports=(), module: bool = False) -> subprocess.CompletedProcess:
    """Run ``script`` with ``nproc`` ranks as ``torchrun --standalone --nproc-per-node NPROC script ARGS``
    would (``module=True``: ``script`` is a module name, as ``torchrun ... -m script ARGS``); ``imports``:
    modules the script needs, imported once in the zygote (a speed-up only). Returns the ranks' stdout
    and stderr (rank after rank) and 0 or the first failing rank's exit code."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a free port, no race
    run_id = uuid.uuid4().hex[:12]
    # named as varlen's own --nproc launcher names its directories (varlen-launch-<pid>-...): varlen removes
    # those of processes that no longer run (safety.clean_launcher_dirs, in every output lock), and this test
    # process runs. (Named varlen-launch-<random>, a random part of digits only read as a dead pid: a varlen
    # run in a concurrent test removed the directory while the ranks wrote to it, FileNotFoundError rank-0.out)
    log_dir = tempfile.mkdtemp(prefix=f"varlen-launch-{os.getpid()}-")
    base = dict(os.environ if env is None else env, **STATIC_ENV)
    ranks = []
    for rank in range(nproc):
        ranks.append(dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          ROLE_NAME="default", LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc),
                          GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(store.port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                          TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_USE_AGENT_STORE="True",
                          TORCH_NCCL_ASYNC_ERROR_HANDLING="1", TORCHELASTIC_SIGNALS_TO_HANDLE=SIGNALS_TO_HANDLE,
                          TORCHELASTIC_ERROR_FILE=os.path.join(log_dir, f"rank-{rank}.error.json")))
    req = {"script": str(script) if module else os.path.abspath(str(script)), "module": module,
           "argv": [str(a) for a in args], "cwd": str(cwd), "envs": ranks, "imports": list(imports),
           "timeout": timeout, "log_dir": log_dir}
    try:
        result = _get_zygote().request(req, timeout + 2 * FAILURE_GRACE + 30)
    finally:
        del store
    out = "".join(read_log(log_dir, r, "out") for r in range(nproc))
    err = "".join(read_log(log_dir, r, "err") for r in range(nproc))
    shutil.rmtree(log_dir, ignore_errors=True)
    if result["timed_out"]:
        raise subprocess.TimeoutExpired([script, *map(str, args)], timeout, out, err)
    failed = [c for c in result["codes"] if c != 0]
    return subprocess.CompletedProcess([script, *map(str, args)], failed[0] if failed else 0, out, err)


def read_log(log_dir: str, rank: int, name: str) -> str:
    """A rank's stdout or stderr; a rank killed before it opened them (a launch past its timeout, or a
    peer's failure under heavy load) says so instead of failing the test with FileNotFoundError."""
    try:
        with open(os.path.join(log_dir, f"rank-{rank}.{name}"), errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        return f"[tests/launcher.py: rank {rank} wrote no std{name}: it was stopped before it started]\n"


# -- the zygote ----------------------------------------------------------------------------------------
def _zygote_main() -> None:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # nothing but replies on the reply pipe
    sys.stdout = os.fdopen(1, "w")
    for name in BASE_IMPORTS:
        importlib.import_module(name)
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        req = json.loads(line)
        for name in req["imports"]:
            importlib.import_module(name)
        result = _run_ranks(req, reply.fileno())
        reply.write(json.dumps(result) + "\n")
        reply.flush()


def _run_ranks(req: dict, reply_fd: int) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank, env in enumerate(req["envs"]):
        pid = os.fork()
        if pid == 0:
            _rank_main(req, rank, env, reply_fd)  # never returns
        pids[pid] = rank
    codes: dict = {}
    deadline = time.monotonic() + req["timeout"]
    failed_at, killed, timed_out = None, False, False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if not killed and (now > deadline or (failed_at is not None and now > failed_at + FAILURE_GRACE)):
                timed_out = now > deadline
                for other in pids:
                    if pids[other] not in codes:
                        os.kill(other, signal.SIGKILL)
                killed = True
            time.sleep(0.05)
            continue
        if pid in pids:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and failed_at is None:
                failed_at = time.monotonic()
    return {"codes": [codes[r] for r in range(len(pids))], "timed_out": timed_out}


def _rank_main(req: dict, rank: int, env: dict, reply_fd: int) -> None:
    code = 1
    try:
        os.close(reply_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "out"), (2, "err")):
            target = os.open(os.path.join(req["log_dir"], f"rank-{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req["cwd"])
        script = req["script"]
        sys.argv = [script, *req["argv"]]
        sys.path.insert(0, os.getcwd() if req["module"] else os.path.dirname(script))
        import runpy

        try:
            if req["module"]:
                runpy.run_module(script, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())  # as an uncaught exception in a real process (varlen's hook: one line)
            code = 1
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    _zygote_main()
