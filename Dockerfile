# The image that every node of a `launcher=docker` or `launcher=kubernetes` run starts: PyTorch with CUDA
# (the image Kubeflow Trainer's torch-distributed runtime uses) plus trainjob, with the experiment trackers'
# packages (`tracker.report_to`), which rank 0 imports where it runs.
#   docker build -t <registry>/trainjob:<tag> .
# BASE picks another base with python, pip and torch on PATH: CI builds the image its real-engine tests run on
# a base it makes itself (.ci/docker-image: `--build-arg BASE=trainjob-base:bookworm-<hash>`).
ARG BASE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE}
# runtime=mpi (Kubeflow's MPI runtimes) starts the ranks with mpirun from the launcher over SSH to sshd on every
# node: `--build-arg MPI=1` adds OpenMPI, its libmpi.so (which MLX loads: mlx-distributed) and sshd (installed where
# the base lacks them; the job's key pair is made at launch and mounted, never in the image); the torch-distributed
# image holds none of them.
ARG MPI=0
RUN if [ "$MPI" = 1 ]; then \
        if ! command -v mpirun >/dev/null || [ ! -x /usr/sbin/sshd ] || ! ldconfig -p | grep -q 'libmpi\.so '; then \
            apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
                openssh-server openmpi-bin libopenmpi-dev && rm -rf /var/lib/apt/lists/*; fi && mkdir -p /run/sshd; fi
# A login shell finds the image's python too (Debian's /etc/profile resets PATH): Kubeflow SDK's
# get_runtime_packages runs `bash -lc "python ..."` in the image.
RUN echo "export PATH=$(dirname "$(command -v python)"):\$PATH" >/etc/profile.d/python-path.sh
WORKDIR /opt/trainjob
COPY pyproject.toml README.md ./
COPY conf conf
COPY trainer trainer
COPY launchers launchers
COPY ops ops
COPY datacache datacache
COPY trainjob trainjob
# The extras of pyproject.toml installed: the function runtimes' frameworks are `runtimes` (JAX, XGBoost, MLX) and
# `deepspeed` (`--build-arg EXTRAS=tracking,runtimes,deepspeed`, as CI's image holds them).
ARG EXTRAS=tracking
RUN pip install --no-cache-dir -e ".[$EXTRAS]"
# What every container's processes would otherwise redo at each start, done once here: trainjob's bytecode (the
# containers run as the launching user, who cannot write it beside the sources, so each process compiled them
# again) and matplotlib's font list (each container's HOME is new: the rank that imports it scanned the fonts).
ENV MPLCONFIGDIR=/opt/matplotlib
RUN python -m compileall -q /opt/trainjob && mkdir -m 1777 "$MPLCONFIGDIR" \
    && python -c "import matplotlib.font_manager" && chmod -R a+rwX "$MPLCONFIGDIR"
ENV PYTHONUNBUFFERED=1
