# The image that every node of a `launcher=docker` or `launcher=kubernetes` run starts: PyTorch with CUDA
# (the image Kubeflow Trainer's torch-distributed runtime uses) plus trainjob, with the experiment trackers'
# packages (`tracker.report_to`), which rank 0 imports where it runs.
#   docker build -t <registry>/trainjob:<tag> .
# BASE picks another base with python, pip and torch on PATH: CI builds the image its real-engine tests run on
# a base it makes itself (.ci/docker-image: `--build-arg BASE=trainjob-base:bookworm`).
ARG BASE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE}
# runtime=mpi (Kubeflow's MPI runtimes) starts the ranks with mpirun from the launcher over SSH to sshd on every
# node: `--build-arg MPI=1` adds OpenMPI and sshd (installed where the base lacks them; the job's key pair is made
# at launch and mounted, never in the image); the torch-distributed image holds neither.
ARG MPI=0
RUN if [ "$MPI" = 1 ]; then \
        if ! command -v mpirun >/dev/null || [ ! -x /usr/sbin/sshd ]; then apt-get update \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssh-server openmpi-bin \
            && rm -rf /var/lib/apt/lists/*; fi && mkdir -p /run/sshd; fi
WORKDIR /opt/trainjob
COPY pyproject.toml README.md ./
COPY conf conf
COPY trainer trainer
COPY launchers launchers
COPY ops ops
COPY datacache datacache
COPY trainjob trainjob
RUN pip install --no-cache-dir -e '.[tracking]'
ENV PYTHONUNBUFFERED=1
