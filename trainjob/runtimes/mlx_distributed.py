"""`mlx-distributed` (Kubeflow Trainer's MLX runtime: its MPI plugin, `mlPolicy.mpi`, no MLX plugin of its own):
every rank under `mpirun`, joined by `mx.distributed.init(strict=True, backend="mpi")`. MLX loads `libmpi.so`,
which Debian's `libopenmpi-dev` provides; without it every rank would silently see a world of 1, so the job is
refused before it starts. A function-only runtime (`trainjob.runtimes.function`)."""

from __future__ import annotations

import ctypes.util
import glob

from trainjob.runtimes.function import MPIFunction

INSTALL_LIBMPI = "apt-get install -y libopenmpi-dev"


def has_libmpi() -> bool:
    """Whether the unversioned `libmpi.so` MLX opens is on the loader's path (libmpi.so.40 alone is not)."""
    found = ctypes.util.find_library("mpi")
    dirs = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
            "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu")
    return found == "libmpi.so" or any(glob.glob(f"{d}/libmpi.so") for d in dirs)


class MLXDistributed(MPIFunction):
    name = "mlx-distributed"
    kubeflow_image = "ghcr.io/kubeflow/trainer/mlx-runtime"
    libraries = ("libmpi.so",)

    def missing(self) -> str | None:
        lacking = super().missing()
        if lacking or has_libmpi():
            return lacking
        return (f"runtime={self.name} needs OpenMPI's libmpi.so, which MLX loads (without it every rank sees a "
                f"world of 1): install the Debian package libopenmpi-dev ({INSTALL_LIBMPI}, as root)")


RUNTIME = MLXDistributed()
