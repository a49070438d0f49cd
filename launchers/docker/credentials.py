"""The credentials of object stores and the Hugging Face Hub that the driver's environment holds, given to a Docker
job's containers at run time: each an environment variable named on `docker run`'s command line (`--env NAME`)
and valued from the docker CLI's own environment, as the launcher's other secrets are (`LaunchSpec.secrets`); the
files they point at (Google's application default credentials, AWS's shared config and credentials files, which
are also found at ~/.aws without a variable) mounted read-only at their own paths. No value is written to a file
of the run, nor shows on a command line."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from launchers.base import LaunchSpec

# What boto3/s3fs, huggingface_hub and Google's clients read (AWS_ENDPOINT_URL: an S3-compatible store such as MinIO).
NAMES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    "HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
)
# Variables whose value is a file the container must read (mounted read-only at the same path).
FILES = ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "GOOGLE_APPLICATION_CREDENTIALS")
_AWS_HOME_FILES = {"AWS_CONFIG_FILE": "config", "AWS_SHARED_CREDENTIALS_FILE": "credentials"}


def of_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The credentials `environ` holds, by name; AWS's files in ~/.aws named where no variable names them (the
    containers' HOME is their own)."""
    found = {name: environ[name] for name in NAMES if environ.get(name)}
    aws_home = os.path.join(os.path.expanduser("~"), ".aws")
    for name, file in _AWS_HOME_FILES.items():
        path = os.path.join(aws_home, file)
        if name not in found and os.path.isfile(path):
            found[name] = path
    return found


def with_credentials(spec: LaunchSpec, environ: Mapping[str, str] = os.environ) -> LaunchSpec:
    """`spec` whose secrets also hold the storage credentials of `environ` (its own secrets win)."""
    return dataclasses.replace(spec, secrets={**of_environment(environ), **spec.secrets})


def mounts(secrets: Mapping[str, str]) -> list[str]:
    """`docker run` options that mount the credential files `secrets` name, read-only, at their own paths."""
    options = []
    for name in FILES:
        path = secrets.get(name)
        if path and os.path.isfile(path):
            options += ["--volume", f"{os.path.abspath(path)}:{os.path.abspath(path)}:ro"]
    return options
