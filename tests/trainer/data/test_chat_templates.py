"""Loss masks on the chat templates real models ship (SmolLM2-135M-Instruct's from its PyPI package, Llama 3,
Llama 3.1 and Qwen3's from the npm registry; `tests.trainer.real_models`), none of which has
`{% generation %}` blocks: each assistant turn is found message by message, and gives, token for token, the
mask that the same template with generation blocks added gives, in our renderer and in `transformers`'
`return_assistant_tokens_mask`. A template that renders a turn differently alone than in the whole
conversation (Qwen3's thinking block) is refused under data.chat.mask=assistant, naming the other masks."""

from __future__ import annotations

import json
import os
import random
import string

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import compose_refused, compose_run, examples
from tests.trainer import real_models
from trainer.data import chat
from trainer.data.hf_tokenizer import HFTokenizer, TemplateMaskError
from trainer.errors import ConfigError

pytestmark = pytest.mark.timeout(600)


def _generation_blocks(name: str, template: str) -> str:
    """The stock template with `{% generation %}` around each assistant turn's content and end-of-turn token, as
    TRL's and transformers' training templates mark it."""
    if name == "smollm2":
        turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        marked = ("{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
                  "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}" + turn +
                  "{% endif %}")
    else:  # llama3, llama3_1
        turn = "{{ content }}"
        marked = ("{% if message['role'] == 'assistant' %}{{ (bos_token if loop.index0 == 0 else '') + "
                  "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}"
                  "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}" + turn +
                  "{% endif %}")
    assert template.count(turn) == 1, f"{name}'s stock template changed: {template!r}"
    return template.replace(turn, marked)


@pytest.fixture(scope="module")
def templates():
    """name -> (directory, stock template, the same with generation blocks)."""
    dirs = {"smollm2": real_models.smollm2(), **{n: real_models.npm_tokenizer(n) for n in ("llama3", "llama3_1")}}
    out = {}
    for name, path in dirs.items():
        stock = HFTokenizer(path).chat_template
        assert not HFTokenizer(path).has_generation_blocks
        out[name] = (path, stock, _generation_blocks(name, stock))
    return out


TEXT = st.text(string.ascii_letters + string.digits + " \n.,?!'é中", min_size=0, max_size=40)


@st.composite
def conversations(draw):
    messages = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages += [{"role": "user", "content": draw(TEXT)}, {"role": "assistant", "content": draw(TEXT)}]
    return messages


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["smollm2", "llama3", "llama3_1"]), messages=conversations(),
       mask=st.sampled_from(["assistant", "last"]))
# Llama 3's base template ends every rendering with an assistant header: a reply "n" is found before it.
@example(name="llama3", mask="assistant", messages=[
    {"role": "user", "content": ""}, {"role": "assistant", "content": "n"},
    {"role": "user", "content": ""}, {"role": "assistant", "content": ""}])
@pytest.mark.e2e
def test_turns_found_message_by_message_are_the_generation_blocks_token_for_token(templates, name, messages, mask):
    from transformers import AutoTokenizer

    path, _, marked = templates[name]
    ours = HFTokenizer(path)
    ids, by_role = ours.apply_chat_template(messages, mask)
    ours.chat_template, ours._template = marked, None
    marked_ids, blocks = ours.apply_chat_template(messages, mask)
    assert (marked_ids, blocks) == (ids, by_role)
    assert ours.apply_chat_template(messages, mask, by_role=True) == (ids, by_role)
    if mask == "assistant":
        theirs = AutoTokenizer.from_pretrained(path).apply_chat_template(
            messages, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert (list(theirs["input_ids"]), list(theirs["assistant_masks"])) == (ids, by_role)
    counted = [t for t, m in zip(ids, by_role, strict=True) if m]
    replies = [m for m in messages if m["role"] == "assistant"][-1:] if mask == "last" else \
        [m for m in messages if m["role"] == "assistant"]
    end = "<|im_end|>" if name == "smollm2" else "<|eot_id|>"
    strip = str if name == "smollm2" else str.strip
    assert ours.tokenizer.decode(counted, skip_special_tokens=False) == "".join(strip(m["content"]) + end
                                                                                for m in replies)


def test_mask_all_counts_every_token(templates):
    path, _, _ = templates["llama3_1"]
    tok = HFTokenizer(path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = tok.apply_chat_template(messages, "all")
    assert len(ids) > 6 and mask == [1] * len(ids)


def test_qwen3s_thinking_block_is_counted_on_the_last_turn_and_refused_inside_a_conversation():
    tok = HFTokenizer(real_models.npm_tokenizer("qwen3"))
    one = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids, mask = tok.apply_chat_template(one)
    assert tok.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False) \
        == "<think>\n\n</think>\n\n4<|im_end|>"
    two = [*one, {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    with pytest.raises(TemplateMaskError, match=r"renders message 2 \(the assistant's\) as '<think>"):
        tok.apply_chat_template(two)
    ids, mask = tok.apply_chat_template(two, "last")
    assert tok.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False) \
        == "<think>\n\n</think>\n\n6<|im_end|>"


def _chat_cfg(tmp_path, model: str, rows: list[dict], **data):
    from omegaconf import OmegaConf

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = OmegaConf.create({"data": {"name": "chat", "path": str(path), "seq_len": 64, "eval_percent": 25.0,
                                     "cache_dir": str(tmp_path / "cache"), "packing": None,
                                     "chat": {"mask": data.pop("mask", "assistant")}, **data},
                            "model": {"path": model}})
    return cfg, str(path)


def test_a_template_that_cannot_be_split_by_message_is_refused_naming_the_masks(tmp_path):
    cfg, path = _chat_cfg(tmp_path, real_models.npm_tokenizer("qwen3"), [{"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}])
    with pytest.raises(ConfigError) as e:
        chat.prepare(cfg)
    message = str(e.value)
    assert message.startswith("invalid config: data.chat.mask='assistant': the chat template of model.path=")
    assert "data.chat.mask=last" in message and "data.chat.mask=all" in message and f"data.path={path}" in message
    assert not (tmp_path / "cache" / "corpus").exists() or not any(
        p.name.startswith("chat-") for p in (tmp_path / "cache" / "corpus").iterdir())


def _model_dir(tmp_path, tokenizer: str, model_type: str) -> str:
    """The real tokenizer beside a small random model of its vocabulary (what the presets load)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.trainer.hf_models import SHAPE

    path = tmp_path / f"model-{model_type}"
    shutil.copytree(tokenizer, path)
    config = AutoConfig.for_model(model_type, **{**SHAPE, "vocab_size": HFTokenizer(str(path)).vocab_size,
                                                 "max_position_embeddings": 4096, "tie_word_embeddings": True})
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


PRESETS = [("llama3_2_1b_sft", "llama3_1", "llama"), ("llama3_2_1b_lora", "llama3_1", "llama"),
           ("llama3_2_1b_dpo", "llama3_1", "llama"), ("qwen2_5_1_5b_lora", "qwen3", "qwen2"),
           ("qwen2_5_1_5b_grpo", "qwen3", "qwen2"), ("llama3_2_1b_kd", "llama3_1", "llama")]


@pytest.mark.parametrize(("preset", "tokenizer", "model_type"), PRESETS)
def test_each_blueprint_prepares_its_data_on_a_real_stock_template(preset, tokenizer, model_type, tmp_path, capsys):
    model = _model_dir(tmp_path, real_models.npm_tokenizer(tokenizer), model_type)
    rng = random.Random(0)
    multi = tokenizer != "qwen3"  # Qwen3's template renders an earlier turn without its thinking block
    rows = []
    for i in range(40):
        turns = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
        if multi and rng.random() < 0.5:
            turns += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "the end"}]
        if "grpo" in preset:  # a conversation to answer, and the column the preset's reward reads
            turns = [{"role": "user", "content": f"question {i}"}]
        rows.append({"prompt": f"question {i}", "chosen": f"yes {i}", "rejected": f"no {i}"} if "dpo" in preset
                    else {"messages": turns, **({"answer": str(i)} if "grpo" in preset else {})})
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"+experiment={preset}", f"model.path={model}", f"data.path={path}", "train.global_batch_size=4",
            "data.eval_percent=25", "data.seq_len=64",
            *(["recipe.num_generations=2"] if "grpo" in preset else []),
            *([f"recipe.teacher.path={model}"] if "kd" in preset else [])]
    from omegaconf import OmegaConf

    compose_run(tmp_path, *args)
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").data.chat.mask == "assistant"
    if tokenizer == "qwen3" and "grpo" not in preset:
        with path.open("a") as f:
            f.write(json.dumps({"messages": [*rows[0]["messages"], *rows[1]["messages"]]}) + "\n")
        err = compose_refused(tmp_path, capsys, *args)
        assert "data.chat.mask='assistant': the chat template of model.path=" in err and "data.chat.mask=last" in err
        compose_run(tmp_path, *args, "data.chat.mask=last")


def test_rows_dropped_are_counted_by_reason_in_the_refusal_not_blamed_on_the_batch_size(tmp_path, capsys):
    model = real_models.smollm2()
    reply = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rows = [{"messages": reply}] * 30 + [{"messages": [{"role": "user", "content": "Hi"}]}] * 4 + [{"messages": []}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["model=hf", f"model.path={model}", "recipe=sft", "data=chat", f"data.path={path}",
            "train.global_batch_size=4", "data.eval_percent=25"]
    # SmolLM2's template starts every conversation with a 20-token system prompt: nothing counted in 16.
    err = compose_refused(tmp_path, capsys, *args, "data.seq_len=15")
    assert err.startswith(f"error: invalid config: data.path='{path}': 35 of 35 rows dropped (30 with no counted "
                          "token within data.seq_len + 1 = 16 tokens, 4 with no assistant turn, 1 empty), which "
                          "leaves the train split 0 rows, fewer than train.global_batch_size=4"), err
    assert "global_batch_size=4: the train split" not in err and len(err.strip().splitlines()) == 1
    compose_run(tmp_path, *args, "data.seq_len=64")  # the same rows train once the replies fit


def test_a_template_that_raises_ends_the_run_in_one_report_naming_it_and_leaves_nothing(tmp_path, capsys):
    from tests.trainer.hf_models import add_tokenizer, make_llama

    model = add_tokenizer(make_llama(str(tmp_path / "model")))
    config_path = os.path.join(model, "tokenizer_config.json")
    with open(config_path) as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception("
                                   "'System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with open(config_path, "w") as f:
        json.dump(tok_config, f)
    path = tmp_path / "chats.jsonl"
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"messages": turns}) + "\n")
    capsys.readouterr()  # the model's making
    with pytest.raises(SystemExit) as e:
        compose_run(tmp_path, "model=hf", f"model.path={model}", "recipe=sft", "data=chat", f"data.path={path}",
                    f"data.cache_dir={tmp_path / 'cache'}")
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (f"error: the chat template of model.path={model} raised TemplateError: System role not "
                      f"supported on conversation chats.jsonl:0 of data.path={path}, before the first step"), err
    assert err[1:] == ["Traceback (your code, most recent call last):",
                       '  File "<template>", line 1, in top-level template code'], err
    assert not (tmp_path / "run").exists()
