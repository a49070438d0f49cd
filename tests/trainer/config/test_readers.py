"""Every key the user sets is read or refused (`trainer.config.readers`): the table of which option reads which key,
made from conf/ and the schemas, and the command line's one-line refusals of a key the chosen options never read,
of a key that does not exist (the closest ones named) and of an option that does not exist."""

from __future__ import annotations

import dataclasses
import os

import pytest
from omegaconf import open_dict

from trainer.config import ConfigError, readers
from trainer.config.compose import CONF_DIR, compose
from trainer.config.validate import validate
from trainjob import runtimes


def test_the_table_names_only_options_that_exist_and_every_key_of_every_section():
    """Each option a schema's read_by names is a file of its group, and every option of the groups with a schema
    reads every key not marked (a new conf/<group>/<option>.yaml joins the table without a line of code)."""
    table = readers.table()
    for key, (group, options) in table.items():
        if group != "launcher":
            assert set(options) <= set(readers.options(group)), (key, options)
    names = tuple(f[:-5] for f in sorted(os.listdir(os.path.join(CONF_DIR, "runtime"))))
    with_nproc = [n for n in names if "nproc_per_node" in {f.name for f in dataclasses.fields(runtimes.get(n).schema)}]
    assert table["runtime.nproc_per_node"][0] == "runtime"
    assert sorted(table["runtime.nproc_per_node"][1]) == sorted(with_nproc) and "mpi" in with_nproc
    assert table["train.max_steps"] == ("train", readers.options("train"))
    assert table["data.path"][1] == ("parquet", "chat", "preference", "prompts")
    assert table["launcher.image"] == ("launcher", ("docker", "kubernetes"))
    assert table["launcher.namespace"] == ("launcher", ("kubernetes",))
    assert table["recipe.kd.alpha"] == ("recipe", ("kd",))  # a nested section's read_by holds under it
    assert table["peft.rank"] == ("peft", ("lora",))


# (command line, the line it is refused with): the cases, each one line naming the fix.
REFUSED = [
    (["data.path=/nonexistent", "train.max_steps=1"],
     "data.path='/nonexistent': data=stdlib reads no path; data=parquet, chat, preference or prompts do"),
    (["data.text_column=body"], "data.text_column='body': data=stdlib reads no text_column; data=parquet does"),
    (["runtime.nproc_per_node=2"], "runtime.nproc_per_node=2: no runtime is chosen (runtime: null in "
     "conf/config.yaml), and only one reads it: add runtime=torch-distributed"),
    (["launcher.namespace=ml"], "launcher.namespace='ml': launcher=local reads no namespace; launcher=kubernetes does"),
    (["launcher=docker", "+launcher.namespace=ml"],
     "launcher.namespace='ml': launcher=docker reads no namespace; launcher=kubernetes does"),
    (["recipe.beta=0.3"], "recipe.beta=0.3: recipe=pretrain reads no beta; recipe=dpo, kto, grpo or rloo do"),
    (["recipe=sft", "recipe.kd.alpha=0.3"], "recipe.kd.alpha=0.3: recipe=sft reads no kd.alpha; recipe=kd does"),
    (["peft.rank=4"], "peft.rank=4: peft=none reads no rank; peft=lora does"),
    (["optim=sgd", "optim.betas=[0.9,0.99]"], "optim.betas=[0.9, 0.99]: optim=sgd reads no betas; optim=adamw does"),
    (["train.max_step=1"], "train.max_step=1: train has no key max_step; did you mean train.max_steps?"),
    (["+train.max_step=1"], "train.max_step=1: train has no key max_step; did you mean train.max_steps?"),
    (["data.cache.endpoint=[]"], "data.cache has no key endpoint; did you mean data.cache.endpoints or "
     "data.cache.eval_endpoints?"),
    (["trian.max_steps=1"], "trian.max_steps=1: there is no section trian; did you mean train?"),
    (["data=parket"], "data='parket': no such option; did you mean data=parquet? data has chat, parquet, preference, "
     "prompts, stdlib"),
    (["data.path=/nonexistent", "--cfg", "job"],  # printing the config refuses what a run would
     "data.path='/nonexistent': data=stdlib reads no path; data=parquet, chat, preference or prompts do"),
    (["train.max_step=1", "--cfg=job"], "train.max_step=1: train has no key max_step; did you mean train.max_steps?"),
    (["-m", "recipe.beta=0.2,0.3"], "sweep job 0 (recipe.beta=0.2), before any job ran: invalid config: "
     "recipe.beta=0.2: recipe=pretrain reads no beta"),
]


@pytest.fixture(scope="module")
def refused(run_cli_batch, tmp_path_factory) -> list:
    dirs = [tmp_path_factory.mktemp("unread") for _ in REFUSED]
    procs = run_cli_batch([(args, d) for (args, _), d in zip(REFUSED, dirs, strict=True)])
    return list(zip(procs, dirs, strict=True))


@pytest.mark.parametrize("row", range(len(REFUSED)), ids=[" ".join(a) for a, _ in REFUSED])
def test_a_key_the_chosen_options_never_read_or_that_does_not_exist_is_refused_in_one_line(refused, row):
    (proc, cwd), (_, line) = refused[row], REFUSED[row]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and line in proc.stderr, proc.stderr
    assert not (cwd / "outputs").exists()


def test_a_key_an_experiment_file_sets_is_refused_where_the_chosen_option_never_reads_it():
    """conf/experiment/llama3_2_1b_dpo.yaml sets recipe.beta; with recipe=sft chosen after it, nothing reads it."""
    args = ["+experiment=llama3_2_1b_dpo", "recipe=sft", "data=chat", "model.path=/nowhere", "data.path=x.jsonl"]
    cfg = compose(args)
    with open_dict(cfg):
        cfg.run_dir = "/tmp/unused"
    with pytest.raises(ConfigError,
                       match=r"recipe.beta=0.1: recipe=sft reads no beta; recipe=dpo, kto, grpo or rloo do"):
        validate(cfg, readers.given_keys(args))
    assert readers.given_keys(["+experiment=llama3_2_1b_dpo", "--cfg", "job"])["train.max_steps"] == 500


def test_a_key_the_chosen_option_reads_passes():
    args = ["data=parquet", "data.path=/data/*.parquet", "data.text_column=body", "peft=lora", "peft.rank=4",
            "model=hf", "model.path=/m"]
    assert all(readers.unread(key, readers.chosen_by(args)) is None for key in readers.given_keys(args))
    assert readers.explain(["runtime=torch-distributed", "runtime.nproc_per_node=2"]) is None


@pytest.mark.parametrize("experiment", readers.options("experiment"))
def test_every_experiment_file_sets_only_keys_its_options_read(experiment):
    args = [f"+experiment={experiment}"]
    given, chosen = readers.given_keys(args), readers.chosen_by(args)
    assert given and [(k, readers.unread(k, chosen) or readers.unknown(k)) for k in given
                      if readers.unread(k, chosen) or readers.unknown(k)] == []
