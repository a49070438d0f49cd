"""The end tokens of a Hugging Face model directory: its tokenizer's eos_token and every `eos_token_id` of
generation_config.json, else of config.json (an int or a list). `python -m trainer.generate` and recipe=grpo stop
generating at them."""

from __future__ import annotations

import json
import os


def config_eos(hf_dir: str) -> list[int]:
    """The eos_token_id of generation_config.json, else of config.json (an int or a list), as a list."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(hf_dir, name)
        if os.path.isfile(file):
            with open(file) as f:
                value = json.load(f).get("eos_token_id")
            if value is not None:
                return [value] if isinstance(value, int) else list(value)
    return []


def end_tokens(hf_dir: str, tokenizer) -> list[int]:
    """The sorted end tokens of `hf_dir`, whose `trainer.data.hf_tokenizer.HFTokenizer` is `tokenizer`."""
    eos = tokenizer.token_id("eos_token")
    return sorted(set(config_eos(hf_dir)) | ({eos} if eos is not None else set()))


class Text:
    """Prompts to token ids and ids back to text, with the model's end and padding tokens: the Hugging Face
    directory `hf_dir`'s tokenizer, or the byte tokenizer of a built-in preset (`hf_dir` None). A prompt is text,
    or a conversation (`messages`) sent through the directory's chat template with its generation prompt;
    `key` and `source` name, in a refusal, the setting that asked for a conversation and the one giving the model."""

    def __init__(self, hf_dir: str | None, key: str = "--chat", source: str = "SOURCE"):
        self.hf, self.key = None, key
        if hf_dir is None:
            from trainer.data import tokenizer

            self.eos, self.pad = [tokenizer.EOS], tokenizer.PAD
            return
        from trainer.data.hf_tokenizer import HFTokenizer
        from trainer.errors import ConfigError

        if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
            raise ConfigError(source, hf_dir, "holds no tokenizer.json: generating needs the model's tokenizer")
        self.hf = HFTokenizer(hf_dir)
        self.eos = end_tokens(hf_dir, self.hf)
        pad = self.hf.token_id("pad_token")
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else 0)

    def encode(self, prompt: str | list[dict]) -> list[int]:
        from trainer.errors import ConfigError

        if self.hf is None:
            from trainer.data import tokenizer

            if not isinstance(prompt, str):
                raise ConfigError(self.key, True, "a built-in preset's byte tokenizer has no chat template")
            return tokenizer.encode(prompt, bos=False, eos=False).tolist()
        if isinstance(prompt, str):
            return self.hf.encode(prompt)
        if not self.hf.chat_template:
            raise ConfigError(self.key, True, f"{self.hf.path} has no chat template (tokenizer_config.json's "
                              "chat_template or chat_template.jinja)")
        text, _ = self.hf.render(prompt, add_generation_prompt=True)
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self.hf is None:
            from trainer.data import tokenizer

            return tokenizer.decode(ids)
        return self.hf.tokenizer.decode(ids, skip_special_tokens=True)
