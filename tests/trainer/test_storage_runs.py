"""Models and data from URLs, the whole way: `python -m trainer` with `model.path` and `data.path` in a bucket of
moto's real S3 server on loopback (tests/s3_server.py), and with `model.path=hf://...` through the Hub's double
(tests/hub_server.py, since no Hub can be reached here). The driver fetches once, before launch, into the storage
cache; the runs' losses equal the local paths' run; a second run copies nothing; `HF_HUB_OFFLINE=1` uses the
cached copy and says so; each refusal is one line, exit 2, no run directory; no credential reaches a run's files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, read_metrics, read_summary
from tests.hub_server import TOKEN
from tests.s3_server import CREDENTIALS
from tests.trainer.drivers import finish, keys, start, wait_for
from tests.trainer.hf_models import SAMPLE, add_tokenizer, make_llama

pytestmark = pytest.mark.timeout(300)
ARGS = ["model=hf", "recipe=sft", "data=chat", "peft=lora", "peft.rank=4", "data.seq_len=48", "data.eval_percent=25",
        "train.global_batch_size=4", "train.max_steps=3", "train.eval_every=3", "train.progress=false",
        "train.log_every=1", "optim.lr=1e-2", "lr_schedule.warmup_steps=1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama directory with a tokenizer and chat template, and a folder of chats in two .jsonl files."""
    root = tmp_path_factory.mktemp("storage")
    model = add_tokenizer(make_llama(str(root)))
    chats = root / "chats"
    chats.mkdir()
    for part in range(2):
        rows = [[{"role": "user", "content": SAMPLE[(i + part) % len(SAMPLE)][:30]},
                 {"role": "assistant", "content": SAMPLE[(2 * i + part) % len(SAMPLE)][:20]}] for i in range(24)]
        (chats / f"part-{part}.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return model, str(chats)


def _run(run_cli, run_dir, *args, env=None):
    return run_cli(*ARGS, *args, f"hydra.run.dir={run_dir}", env=env)


def _files_hold(run_dir, values) -> list[str]:
    """The files of `run_dir` holding any of `values`."""
    found = []
    for top, _, names in os.walk(run_dir):
        for name in names:
            with open(os.path.join(top, name), "rb") as f:
                text = f.read()
            found += [os.path.join(top, name) for v in values if v.encode() in text]
    return found


@pytest.mark.e2e
def test_lora_sft_from_a_bucket_checkpoints_there_resumes_after_sigterm_and_equals_the_local_run(
        tiny, s3, run_cli, tmp_path, cache_dir):
    """The issue's whole command: model, chats and checkpoints in the bucket, LoRA SFT, SIGTERM after the first
    checkpoint, a run in a new run directory going on from the bucket's newest whole checkpoint, the export from the
    bucket; the losses equal the local paths' run."""
    model, chats = tiny
    s3.upload_dir(model, "models/tiny")
    s3.upload_dir(chats, "chats")
    steps = ["train.max_steps=12", "train.eval_every=12"]
    local = _run(run_cli, tmp_path / "local", f"model.path={model}", f"data.path={chats}/*.jsonl", *steps)
    assert local.returncode == 0, local.stderr[-3000:]
    ckpt = s3.url("ckpt/run1")
    remote = [*ARGS, *steps, f"model.path={s3.url('models/tiny')}", f"data.path={s3.url('chats/*.jsonl')}",
              f"train.checkpoint_dir={ckpt}", "train.checkpoint_every=1"]
    first = start(cache_dir, tmp_path, s3.env, *remote, f"hydra.run.dir={tmp_path / 's3'}")
    wait_for(lambda: "step-1/.manifest.json" in keys(s3, "ckpt/run1/"), first, "checkpoint step 1")
    first.send_signal(signal.SIGTERM)
    err = finish(first, 120)
    assert first.returncode == 143, err[-3000:]
    assert f"model.path={s3.url('models/tiny')}: fetched into {cache_dir}/storage/s3/" in err
    done = read_metrics(str(tmp_path / "s3"))
    assert 1 <= len(done) < 12, err[-3000:]
    second = _run(run_cli, tmp_path / "s3b", *remote[len(ARGS):], env=s3.env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"model.path={s3.url('models/tiny')}: the copy in {cache_dir}/storage/s3/" in second.stderr  # none fetched
    rest = read_metrics(str(tmp_path / "s3b"))
    assert rest[0]["step"] == len(done) + 1
    losses = [m["loss"] for m in read_metrics(str(tmp_path / "local"))]
    assert len(losses) == 12
    assert [m["loss"] for m in done + rest] == pytest.approx(losses, rel=1e-6)
    assert read_summary(str(tmp_path / "s3b"))["final_eval_loss"] == pytest.approx(
        read_summary(str(tmp_path / "local"))["final_eval_loss"], rel=1e-6)
    # The ranks read the local copy, which config.yaml names; the corpus records the objects and their ETags.
    import yaml

    with open(tmp_path / "s3b" / "config.yaml") as f:
        saved = yaml.safe_load(f)
    assert saved["model"]["path"].startswith(f"{cache_dir}/storage/s3/")
    assert saved["data"]["path"] == s3.url("chats/*.jsonl")
    corpus = os.path.join(cache_dir, "corpus", f"chat-{saved['data']['fingerprint']}", "corpus.json")
    with open(corpus) as f:
        sources = json.load(f)["source"]["files"]
    etag = s3.client().head_object(Bucket=s3.bucket, Key="chats/part-0.jsonl")["ETag"].strip('"')
    assert sources[0][0] == f"{s3.url('chats/*.jsonl')}#part-0.jsonl" and sources[0][2] == etag
    # trainer.export takes the checkpoint's URL, and the base model's URL where the run's config names one (its
    # copy, found again): the bucket's config names the URL, as a run on another machine would have it.
    config = s3.client().get_object(Bucket=s3.bucket, Key="ckpt/run1/config.yaml")["Body"].read().decode()
    s3.client().put_object(Bucket=s3.bucket, Key="ckpt/run1/config.yaml",
                           Body=config.replace(saved["model"]["path"], s3.url("models/tiny")).encode())
    out = tmp_path / "adapters"
    exported = run_cli(f"{ckpt}/step-12", str(out), module="trainer.export", env=s3.env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"model.path (of the run)={s3.url('models/tiny')}: the copy in {saved['model']['path']}" in exported.stderr
    assert (out / "adapter_model.safetensors").is_file()
    secrets = [CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"]]
    assert _files_hold(tmp_path / "s3", secrets) == _files_hold(tmp_path / "s3b", secrets) == []


@pytest.mark.e2e
def test_a_hub_model_is_fetched_once_gives_the_local_logits_and_runs_offline(tiny, hub, run_cli, tmp_path, cache_dir,
                                                                           monkeypatch):
    model, chats = tiny
    repo = hub.add_dir("models", "org/tiny", model, gated=True)
    env = {"HF_TOKEN": TOKEN}
    first = _run(run_cli, tmp_path / "first", "model.path=hf://org/tiny", f"data.path={chats}/*.jsonl", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    fetched = len(hub.downloads())
    assert fetched == len([n for n in os.listdir(model) if n.endswith((".json", ".safetensors"))]) > 0
    second = _run(run_cli, tmp_path / "second", "model.path=hf://org/tiny", f"data.path={chats}/*.jsonl", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(hub.downloads()) == fetched  # the commit asked for, no file
    assert [m["loss"] for m in read_metrics(str(tmp_path / "second"))] == [
        m["loss"] for m in read_metrics(str(tmp_path / "first"))]
    offline = _run(run_cli, tmp_path / "offline", "model.path=hf://org/tiny", f"data.path={chats}/*.jsonl",
                   env={"HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr[-3000:]
    assert f"model.path=hf://org/tiny: HF_HUB_OFFLINE=1, using the cached copy of commit {repo.sha}" in offline.stderr
    assert _files_hold(tmp_path, [TOKEN]) == []
    # The fetched copy gives the local directory's logits.
    from trainer.config.hf import local_model
    from trainer.models.hf import from_hf

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    copy = local_model("hf://org/tiny", cache_dir=cache_dir)
    assert len(hub.downloads()) == fetched and copy.startswith(f"{cache_dir}/storage/hf/")
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(copy)(tokens), from_hf(model)(tokens), rtol=0, atol=0)


def test_generate_takes_a_model_url(tiny, hub, run_cli):
    model, _ = tiny
    hub.add_dir("models", "org/tiny", model)
    args = ["--prompt", "the cat", "--max-new-tokens", "6"]
    local = run_cli(model, *args, module="trainer.generate")
    remote = run_cli("hf://org/tiny", *args, module="trainer.generate")
    assert local.returncode == remote.returncode == 0, remote.stderr[-2000:]
    assert remote.stdout == local.stdout and remote.stdout.strip()
    # Fetched here, or found where an earlier test of the session fetched the same commit.
    assert re.search(r"^SOURCE=hf://org/tiny: (fetched into|the copy in) \S+/storage/hf/", remote.stderr, re.M)


def _refused(proc, run_dir, reason: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and reason in lines[0], proc.stderr[-2000:]
    assert not os.path.exists(run_dir)


def _batch(cases: list[tuple[list[str], dict]], cwd, cache_dir) -> list[subprocess.CompletedProcess]:
    """Each case's `python -m trainer` in one interpreter forked per run (tests/cli_batch.py), with its env."""
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    request = [{"args": args, "cwd": str(cwd), "env": extra} for args, extra in cases]
    batch = subprocess.run([sys.executable, "-m", "tests.cli_batch", "trainer"], cwd=REPO, env=env,
                           input=json.dumps(request), capture_output=True, text=True, timeout=300)
    assert batch.returncode == 0, batch.stderr[-3000:]
    return [subprocess.CompletedProcess(a, r["returncode"], r["stdout"], r["stderr"])
            for (a, _), r in zip(cases, json.loads(batch.stdout), strict=True)]


@pytest.mark.e2e
def test_the_stores_refusals_before_launch(tiny, s3, tmp_path, cache_dir, monkeypatch):
    model, chats = tiny
    s3.upload_dir(chats, "chats")
    run_dir = tmp_path / "run"
    at = [f"hydra.run.dir={run_dir}"]
    shadow = tmp_path / "shadow" / "gcsfs"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('gcsfs is not installed here')\n")
    cases = [
        ([*ARGS, f"model.path={s3.url('models/none')}", *at], {}, "no such object: nothing there"),
        ([*ARGS, "model.path=s3://no-such-bucket-trainjob/m", *at], {}, "no such bucket or object"),
        ([*ARGS, f"model.path={model}", f"data.path={s3.url('none/*.jsonl')}", *at], {},
         f"invalid config: data.path='{s3.url('none/*.jsonl')}': no such object"),
        ([*ARGS, f"model.path={s3.url('models/tiny')}", *at], {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
         "the endpoint does not answer (http://127.0.0.1:9: EndpointConnectionError"),
        ([*ARGS, "model.path=gs://bucket/models/tiny", *at],
         {"PYTHONPATH": f"{tmp_path / 'shadow'}:{REPO}"},
         "gs:// needs gcsfs, which is not installed: pip install 'trainjob[storage]'"),
    ]
    for proc, (_, _, reason) in zip(_batch([(a, e) for a, e, _ in cases], tmp_path, cache_dir), cases, strict=True):
        _refused(proc, run_dir, reason)
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks credentials now
    (proc,) = _batch([([*ARGS, f"model.path={model}", f"data.path={s3.url('chats/*.jsonl')}", *at], {})], tmp_path,
                     cache_dir)
    _refused(proc, run_dir, "credentials refused")
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in proc.stderr


@pytest.mark.e2e
def test_the_hubs_refusals_before_launch(tiny, hub, run_cli, tmp_path):
    model, chats = tiny
    hub.add_dir("models", "org/gated", model, gated=True)
    run_dir = tmp_path / "run"
    cases = [
        ("hf://org/none", {}, "no such model repository org/none on http://127.0.0.1"),
        ("hf://org/gated", {}, "org/gated is a gated repository and no token is set"),
        ("hf://org/gated", {"HF_ENDPOINT": "http://127.0.0.1:9"}, "the Hub at http://127.0.0.1:9 does not answer"),
        ("hf://org/gated", {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1 and no copy of it in"),
    ]
    for url, env, reason in cases:
        proc = _run(run_cli, run_dir, f"model.path={url}", f"data.path={chats}/*.jsonl", env=env)
        _refused(proc, run_dir, reason)
