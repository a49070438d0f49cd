"""glibc's malloc, set for what a process does with its large buffers: one policy a process, chosen once.

`keep_freed_buffers`, for a data cache's reading process: it reuses its freed receive buffers instead of
faulting in fresh pages for every batch. Each batch a client receives lands in a buffer that gRPC allocates
with `malloc` (one per message, the batch's size), in the arena of the thread that reads it, and frees once the
batch's tensors are dropped. By default glibc gives such blocks back to the kernel: it maps blocks above its
adaptive mmap threshold on their own, trims a heap's free top above twice that threshold, and unmaps a reader
thread's heap (64 MiB) once it is empty, which a read-ahead that fills and drains does every window. Then every
batch faults its pages in anew. Measured on one node to one client at 8 MiB batches with two readers: 340,000
page faults per GB and 1.1 GB/s with glibc's defaults; 7,000-10,000 and 2.7-2.8 GB/s with these settings
(fixed mmap and trim thresholds, and a top pad of one heap, which halved the faults the thresholds alone left).

`release_freed_buffers`, for a rank training on long rows (`train.allocator`): every block of 1 MiB or more is
mapped on its own, so that a freed activation goes back to the kernel at once and the process's resident memory
follows the tensors it holds. glibc's adaptive threshold rises to the largest block freed so far (up to 32 MiB),
after which a step's activations come from the heap, whose holes between the blocks still held (a layer's saved
tensors, FSDP2's gathered weights) stay resident: measured at 32k tokens on the debug model, one training step
peaked at 1.56 GiB per rank under cp=4 with glibc's thresholds and 1.28 GiB with this one (3.35 and 3.27 GiB in
one process). Each new block faults its pages in, which is what this costs (docs/parallelism.md).

`restart_with_huge_pages`, for a cache node's process (each entry point that starts one calls it first), which holds
its table in memory and gathers a shuffled step's rows from anywhere in it: the process runs again, at once, with
glibc's `glibc.malloc.hugetlb=1` tunable, so that malloc asks the kernel for transparent huge pages on the memory it
maps (where the kernel gives them only to memory that asks: THP's `madvise` mode, the common default). Reading a
random 2 KiB row then walks the page tables far less often: gathering 4,096 of them out of 800 MB took 1.5-1.7 ms
against 2.4-3.0 on 4 KiB pages; over `bench/datacache.py`'s shuffled passes a node spent 0.48-0.59 CPU seconds a GB
against 0.55-0.63 (four runs, alternated). Its resident memory grew by 1.6% (1.89 against 1.86 GB for an 819 MB
table). A tunable is read when a process starts, hence the restart; it costs no copy of the table (collapsing its
pages after the load, `MADV_COLLAPSE`, took 1.4 s per 780 MiB here).

Where a user set any of glibc's settings (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`,
`MALLOC_MMAP_MAX_`, or in `GLIBC_TUNABLES`), theirs decide and neither policy is set; likewise where an allocator
is preloaded (`LD_PRELOAD` naming a malloc: jemalloc, tcmalloc, mimalloc), whose `mallopt`, if any, is not glibc's.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt's parameters (malloc.h), and the settings of a user's that leave the policies unset (MMAP_MAX: 0 maps
# nothing on its own, whatever the threshold).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
NAMES = ("TRIM_THRESHOLD", "TOP_PAD", "MMAP_THRESHOLD", "MMAP_MAX")

# keep_freed_buffers: the largest mmap threshold glibc takes (HEAP_MAX_SIZE / 2 on 64-bit; larger blocks are
# mapped anyway); a free heap top kept up to 1 GiB, far above a read-ahead's batches; a top pad of one heap.
KEEP = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}
# release_freed_buffers: blocks of 1 MiB and more mapped on their own (fixing the threshold stops its rise).
RELEASE = {M_MMAP_THRESHOLD: 1 << 20}

# train.allocator's values, and the row length from which auto releases on the CPU.
POLICIES = ("auto", "adaptive", "release")
LONG_ROWS = 8192

# The policy set in this process, or "failed" where glibc refused one of its settings (then neither is set again);
# a forked child inherits it, and this.
_chosen: str | None = None

HUGE_PAGES = "glibc.malloc.hugetlb=1"
# Set in the environment of the process run again: it never runs again itself, even where glibc dropped the tunable
# (a setuid or file-capability interpreter's environment loses its GLIBC_TUNABLES).
RESTARTED = "TRAINJOB_HUGE_PAGES_RESTARTED"
THP = "/sys/kernel/mm/transparent_hugepage"


def policy_for(setting: str, seq_len: int, device_type: str) -> str:
    """train.allocator's `setting` for rows of `seq_len` tokens on a `device_type` device, auto resolved: release
    on the CPU from LONG_ROWS tokens (where the activations are the CPU's and long), adaptive otherwise."""
    if setting != "auto":
        return setting
    return "release" if seq_len >= LONG_ROWS and device_type == "cpu" else "adaptive"


def keep_freed_buffers() -> bool:
    """Sets glibc's mmap and trim thresholds and top pad for a reading process, once; True if they are set (now
    or before). Nothing on another C library, where the user chose any of them, or where this process releases
    its freed buffers (`release_freed_buffers`)."""
    return _choose("keep", KEEP)


def release_freed_buffers() -> bool:
    """Fixes glibc's mmap threshold at 1 MiB for this process, once; True if it is set (now or before). Nothing
    on another C library, where the user chose any of glibc's settings, or where this process keeps its freed
    buffers (`keep_freed_buffers`)."""
    return _choose("release", RELEASE)


def chosen() -> str | None:
    """The policy set in this process: "keep", "release", "failed" (glibc refused a setting of one), or None
    (glibc's own)."""
    return _chosen


def _choose(policy: str, settings: dict[int, int]) -> bool:
    global _chosen
    if _chosen is not None:
        return _chosen == policy
    tunables, preloaded = os.environ.get("GLIBC_TUNABLES", ""), os.environ.get("LD_PRELOAD", "")
    if (not sys.platform.startswith("linux") or "malloc" in preloaded
            or any(f"MALLOC_{name}_" in os.environ or f"malloc.{name.lower()}" in tunables for name in NAMES)):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = [mallopt(param, value) == 1 for param, value in settings.items()]
    _chosen = policy if all(applied) else "failed"
    return all(applied)


def thp_mode(setting: str = "enabled") -> str:
    """The kernel's transparent huge page `setting`, chosen of those it lists: "enabled" (which mappings get huge
    pages: "always", "madvise", "never") or "defrag" (when a fault compacts memory to find one); "" where the
    kernel has no THP."""
    try:
        with open(f"{THP}/{setting}") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


def libc() -> str:
    """The C library and its version, e.g. "glibc 2.36"; "" where it does not say (musl, another system)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return ""


def huge_pages_environment(environ: dict[str, str], mode: str, library: str) -> dict[str, str] | None:
    """The environment to run again with, glibc's huge-page tunable added to `GLIBC_TUNABLES`; None where it would
    change nothing: THP (`mode`, as `thp_mode` gives it) given to every mapping already ("always") or to none, a C
    `library` (as `libc` gives it) other than glibc 2.35 or later, a preloaded malloc, or a tunable of
    `glibc.malloc.hugetlb` already set by the user, or a process that runs again already (`RESTARTED`)."""
    name, _, version = library.partition(" ")
    numbers = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (mode != "madvise" or name != "glibc" or numbers < (2, 35) or "malloc" in environ.get("LD_PRELOAD", "")
            or "glibc.malloc.hugetlb" in tunables or RESTARTED in environ):
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES, RESTARTED: "1"}


def restart_with_huge_pages() -> None:
    """Runs this program again (the same interpreter, options and arguments, the same process id) with glibc's
    malloc asking for transparent huge pages, where `huge_pages_environment` says that changes something; returns
    otherwise: also where this program's arguments are not its interpreter's command line's (a module run inside
    another program, as `runpy` runs one), which running it again would not repeat, and where the exec fails (the
    program then goes on as it is). Call it first thing, before any output or thread."""
    args = sys.argv[1:]
    if (not sys.platform.startswith("linux") or not sys.executable
            or sys.orig_argv[len(sys.orig_argv) - len(args):] != args):
        return
    environ = huge_pages_environment(dict(os.environ), thp_mode(), libc())
    if environ is not None:
        try:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
        except (OSError, ValueError):  # an interpreter that cannot be run again (a noexec mount, E2BIG)
            return
