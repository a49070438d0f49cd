"""A Hugging Face model directory's tokenizer: `tokenizer.json` through the `tokenizers` library, and the chat
template of `tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2 as `transformers` renders
it: a sandboxed environment with trim_blocks and lstrip_blocks, the special tokens as variables, and the
`{% generation %}` blocks marking what the assistant writes, so that SFT counts only those tokens.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _GenerationSpans(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records the body's character span."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.spans: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("spans", default=None)
        environment.extend(track_generation=self.track)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        text = caller()
        tracked = self.spans.get()
        if tracked is not None:
            blocks, spans = tracked
            start = len("".join(blocks))
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, blocks: list[str], spans: list[tuple[int, int]]):
        token = self.spans.set((blocks, spans))
        try:
            yield
        finally:
            self.spans.reset(token)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
    """The tokenizer of model directory `path`."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config_file = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_file):
            with open(config_file) as f:
                config = json.load(f)
        self.special = {k: _token_text(config[k]) for k in SPECIAL_KEYS if config.get(k) is not None}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        self.chat_template = template
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, key: str) -> int | None:
        """The id of special token `key` (such as eos_token), or None when the directory names none."""
        text = self.special.get(key)
        return None if text is None else self.tokenizer.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _compiled(self):
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationSpans, jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
            self._template = env.from_string(self.chat_template)
        return self._template

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The chat as text, and the character spans of its `{% generation %}` blocks."""
        template = self._compiled()
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with template.environment.track_generation(blocks, spans):
            for block in template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            ):
                blocks.append(block)
        return "".join(blocks), spans

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]:
        """(token ids, assistant mask) of the chat: 1 for every token overlapping a generation block."""
        text, spans = self.render(messages, add_generation_prompt)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        mask = [0] * len(encoding.ids)
        i = 0
        for t, (start, end) in enumerate(encoding.offsets):
            while i < len(spans) and start >= spans[i][1]:
                i += 1
            if i == len(spans):
                break
            if end > spans[i][0]:
                mask[t] = 1
        return encoding.ids, mask
