"""The corpus a run's driver checked is the corpus its ranks read (`data.fingerprint`): the driver pins the
key of its build in config.yaml; a rank reads that build from the data cache without reading the source
again, builds the same key where the cache lacks it, and refuses otherwise. Real Parquet files and real
corpus builds; the ranks in other interpreters are tests/launchers/test_docker_engine.py's."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import TINY, compose_run
from trainer.data import corpus as data
from trainer.errors import ConfigError


@pytest.fixture
def parquet_run(tmp_path):
    """A run of `data=parquet` composed, checked and saved by the driver, with its data cache."""
    source = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [f"doc {i}: " + "words and more words " * 8 for i in range(200)]}), source)
    cache = tmp_path / "cache"
    run = compose_run(tmp_path, *TINY, "data=parquet", f"data.path={source}", "data.eval_percent=20",
                      f"data.cache_dir={cache}")
    return run, source, cache


def built(cache) -> list[str]:
    return sorted(d for d in os.listdir(cache / "corpus") if not d.startswith("."))


def test_the_driver_pins_the_build_it_checked_in_config_yaml(parquet_run):
    run, _, cache = parquet_run
    with open(run.spec.config_path) as f:
        pinned = yaml.safe_load(f)["data"]["fingerprint"]
    assert built(cache) == [f"parquet-{pinned}"] and len(pinned) == 16


def test_a_rank_reads_the_pinned_build_without_its_source(parquet_run):
    run, source, cache = parquet_run
    cfg = OmegaConf.create(run.spec.config).data
    os.remove(source)  # where the ranks run, the source may not be there at all
    assert data.prepare(cfg) == str(cache / "corpus" / f"parquet-{cfg.fingerprint}")


def test_a_rank_builds_the_pinned_key_again_where_its_cache_lacks_it(parquet_run, tmp_path):
    run, _, _ = parquet_run
    cfg = OmegaConf.create(run.spec.config).data
    cfg.cache_dir = str(tmp_path / "other-cache")
    assert data.prepare(cfg) == str(tmp_path / "other-cache" / "corpus" / f"parquet-{cfg.fingerprint}")


def test_a_rank_whose_source_makes_another_corpus_refuses_and_builds_nothing(parquet_run, tmp_path):
    run, source, _ = parquet_run
    cfg = OmegaConf.create(run.spec.config).data
    cfg.cache_dir = str(tmp_path / "other-cache")
    os.utime(source, (source.stat().st_atime, source.stat().st_mtime + 60))  # changed since the driver checked
    with pytest.raises(ConfigError) as e:
        data.prepare(cfg)
    assert str(e.value).startswith(f"invalid config: data.fingerprint='{cfg.fingerprint}': the driver checked that "
                                   f"parquet corpus, and it is not in {tmp_path / 'other-cache' / 'corpus'} here, "
                                   "where the source makes corpus ")
    assert "\n" not in str(e.value) and str(source) in str(e.value)
    assert not (tmp_path / "other-cache").exists()


def test_a_config_without_a_pin_builds_as_before(parquet_run, tmp_path):
    run, _, _ = parquet_run
    cfg = OmegaConf.create(run.spec.config).data
    del cfg["fingerprint"]  # a config.yaml saved before the key existed
    cfg.cache_dir = str(tmp_path / "other-cache")
    assert os.path.isdir(data.prepare(cfg))


def test_the_key_names_the_build():
    assert data.corpus_key("/c/corpus/parquet-0123456789abcdef") == "0123456789abcdef"
