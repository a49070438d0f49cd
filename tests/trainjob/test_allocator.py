"""glibc's malloc policies (trainjob.allocator): a reading process keeps its freed batch buffers (after a
StreamingDataset has been iterated there, a thread that fills and frees batch-sized blocks as a read-ahead does
faults their pages in once, not every round); a process that releases them gives a freed block back to the kernel
even where a block still held sits after it (glibc's adaptive threshold keeps it resident); one policy a process;
a user's own malloc settings are left as they are. Each case runs in a fresh interpreter, since malloc's settings
last as long as the process. `python -m datacache serve` runs again with glibc's huge-page tunable where the kernel
gives huge pages only to memory that asks, and its table then lies in huge pages; a user's tunable, another C
library, another THP mode or a process run again already leave the environment as it is, and a module run inside
another program does not run its host again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import process_environment
from trainjob.allocator import HUGE_PAGES, RESTARTED, huge_pages_environment, libc, thp_mode

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Prints [faults of each round]: 16 blocks of 8 MiB malloc'd, written and freed by one thread, 5 times;
# first iterating a StreamingDataset from the node at argv[1] if one is given.
ROUNDS = """
import ctypes, json, resource, sys, threading
if len(sys.argv) > 1:
    from datacache import StreamingDataset
    sum(1 for _ in StreamingDataset([sys.argv[1]], columns=["id"], batch_size=10, loop=False))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size, faults = 8 << 20, []
def rounds():
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(size) for _ in range(16)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(json.dumps(faults))
"""

# Prints the MiB still resident after 16 blocks of 8 MiB, each followed by a 256 KiB block that stays, are written
# and freed, once a 16 MiB block has been freed (which raises glibc's adaptive mmap threshold to 16 MiB: a
# training step's largest activations do that); argv[1] names the policy set first ("release", "keep" or none).
HOLES = """
import ctypes, json, sys
from trainjob import allocator
chose = {"release": allocator.release_freed_buffers, "keep": allocator.keep_freed_buffers,
         "none": lambda: None}[sys.argv[1]]()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
first = libc.malloc(16 << 20)
libc.free(first)
before, held, size = resident(), [], 8 << 20
blocks = []
for _ in range(16):
    blocks.append(libc.malloc(size))
    ctypes.memset(blocks[-1], 1, size)
    held.append(libc.malloc(256 << 10))
for b in blocks:
    libc.free(b)
print(json.dumps([chose, resident() - before]))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")


def run(code: str, *args: str, env: dict | None = None) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.parquet"
    pq.write_table(pa.table({"id": np.arange(100, dtype=np.int64)}), path)
    node = subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", str(path), "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    yield node.stdout.readline().split()[-1]
    node.terminate()
    node.wait(10)


@pytest.mark.timeout(240)
def test_a_reading_process_faults_batch_buffers_in_once(endpoint):
    first, *later = json.loads(run(ROUNDS, endpoint))
    assert first > 0  # 16 blocks of 2,048 pages each (fewer with transparent huge pages), touched the first time
    assert max(later) < first * 0.01, later
    # Without the dataset, glibc hands a thread's emptied heaps back and the pages fault in again.
    first, *later = json.loads(run(ROUNDS))
    assert min(later) > first * 0.25, later


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"MALLOC_TOP_PAD_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, {"MALLOC_MMAP_MAX_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"},
                                 {"LD_PRELOAD": "/nonexistent/libjemalloc.so.2"}])
def test_a_users_own_malloc_settings_decide(env):
    for policy in ("keep_freed_buffers", "release_freed_buffers"):
        code = f"from trainjob.allocator import {policy} as set_; print(set_(), set_())"
        assert run(code, env=env) == "False False"
        assert run(code) == "True True"


def test_a_process_that_releases_freed_buffers_gives_them_back_where_glibc_keeps_them():
    chose, resident = json.loads(run(HOLES, "none"))
    assert chose is None and resident > 100  # glibc's own: the 128 MiB freed between held blocks stay
    chose, resident = json.loads(run(HOLES, "keep"))
    assert chose is True and resident > 100
    chose, resident = json.loads(run(HOLES, "release"))
    assert chose is True and resident < 8


def test_a_process_keeps_the_first_policy_set():
    code = ("from trainjob import allocator as a; print(a.release_freed_buffers(), a.keep_freed_buffers(), "
            "a.chosen())")
    assert run(code) == "True False release"
    code = "from trainjob import allocator as a; print(a.keep_freed_buffers(), a.release_freed_buffers(), a.chosen())"
    assert run(code) == "True False keep"


@pytest.mark.parametrize(("environ", "mode", "libc", "tunables"), [
    ({}, "madvise", "glibc 2.36", HUGE_PAGES),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", "glibc 2.39", f"glibc.malloc.arena_max=2:{HUGE_PAGES}"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", "glibc 2.36", None),  # the user's choice
    ({}, "always", "glibc 2.36", None),  # every mapping gets huge pages already
    ({}, "never", "glibc 2.36", None),
    ({}, "madvise", "glibc 2.31", None),  # before the tunable
    ({}, "madvise", "", None),  # musl
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "madvise", "glibc 2.36", None),
    ({RESTARTED: "1"}, "madvise", "glibc 2.36", None),  # run again once: glibc may have dropped the tunable
])
def test_a_cache_node_runs_again_with_huge_pages_only_where_that_changes_something(environ, mode, libc, tunables):
    got = huge_pages_environment(environ, mode, libc)
    assert (got if got is None else got["GLIBC_TUNABLES"]) == tunables
    if got is not None:
        assert got[RESTARTED] == "1"
        assert {k: v for k, v in got.items() if k not in ("GLIBC_TUNABLES", RESTARTED)} == {
            k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}


# Prints how many bytes of the mapping that holds a cache node's table lie in huge pages, and the table's size;
# argv[1]: the Parquet file; argv[2]: "restart" runs restart_with_huge_pages first, as `datacache serve` does.
TABLE_PAGES = """
import sys
from trainjob.allocator import restart_with_huge_pages
if sys.argv[2] == "restart":
    restart_with_huge_pages()
from datacache.server import keep_gathered_buffers, load_shard
keep_gathered_buffers()
rows = load_shard(sys.argv[1], 0, 1)[0]
address = rows.column(0).values.buffers()[1].address
with open("/proc/self/smaps") as f:
    lines = f.read().splitlines()
for i, line in enumerate(lines):
    start, _, end = line.split()[0].partition("-")
    if "-" in line.split()[0] and int(start, 16) <= address < int(end, 16):
        huge = next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("AnonHugePages:")) << 10
        print(huge, rows.nbytes)
"""


# Where this process's children (`run`'s environment) would run again, and the kernel finds a huge page for memory
# that asks at once (compacting if it must).
RESTARTS = (huge_pages_environment({k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}, thp_mode(), libc())
            is not None and thp_mode("defrag") in ("always", "madvise", "defer+madvise"))


@pytest.mark.skipif(not RESTARTS, reason="huge pages on request: THP's madvise mode, glibc's tunable (2.35 or later)")
@pytest.mark.timeout(180)
def test_a_cache_nodes_table_lies_in_huge_pages(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(
        pa.array(np.arange(32 << 20, dtype=np.int32)), 512)}), path)  # 128 MiB
    huge, size = map(int, run(TABLE_PAGES, str(path), "restart").split())
    assert huge >= size * 0.5  # mostly 2 MiB pages (4 KiB ones where the kernel has no 2 MiB page free)
    huge, size = map(int, run(TABLE_PAGES, str(path), "none").split())
    assert huge < size * 0.1  # 4 KiB pages without the restart
    # `python -m datacache serve` restarts itself so.
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    node = subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", str(path), "--port", "0"],
                            cwd=REPO, env=clean, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert node.stdout.readline().startswith("serving on")
        environ = process_environment(node.pid)
    finally:
        node.terminate()
        node.wait(10)
    assert environ["GLIBC_TUNABLES"] == HUGE_PAGES


@pytest.mark.skipif(not RESTARTS, reason="huge pages on request: THP's madvise mode, glibc's tunable (2.35 or later)")
def test_a_program_run_inside_another_does_not_run_the_host_again():
    code = ("import os, sys\n{}from trainjob.allocator import restart_with_huge_pages\nrestart_with_huge_pages()\n"
            "print(os.environ.get('GLIBC_TUNABLES'), os.environ.get('TRAINJOB_HUGE_PAGES_RESTARTED'))")
    assert run(code.format(""), "serve") == f"{HUGE_PAGES} 1"
    # As runpy runs a module inside a host program (tests/cli_batch.py): argv is no longer the command line's.
    assert run(code.format("sys.argv = ['datacache', 'serve']\n"), "x") == "None None"
