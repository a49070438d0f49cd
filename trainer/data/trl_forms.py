"""TRL's dataset formats, read as TRL documents them (its "Dataset formats and types" page), standard (strings) and
conversational (lists of {role, content} messages), into the conversations the recipes render with the model's
chat template:

    data=chat (sft)            language modeling, conversational: messages
                               prompt-completion: prompt, completion (the completion is the assistant's turn)
    data=preference (dpo,      preference, explicit prompt: prompt, chosen, rejected
      reward)                  preference, implicit prompt: chosen, rejected (split as TRL's extract_prompt does)
    data=prompts (grpo, rloo)  prompt-only: prompt (or messages)

A row of another form is refused in one line naming the columns it has and the forms accepted."""

from __future__ import annotations

from trainer.errors import ConfigError

# What each kind reads, as the refusal names it.
ACCEPTED = {
    "chat": "messages (conversational language modeling), or prompt and completion (prompt-completion)",
    "preference": "prompt, chosen and rejected (explicit prompt), or chosen and rejected (implicit prompt)",
    "prompts": "prompt (prompt-only), or messages",
}


def is_chat(messages) -> bool:
    """Whether `messages` is a conversation: a list of {'role': str, 'content': str}."""
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)


def _turns(value, role: str) -> list[dict] | None:
    """A column's value as messages: a conversation as it is, a string as one turn of `role`; None otherwise."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return value if is_chat(value) and value else None


def extract_prompt(chosen, rejected) -> tuple:
    """(prompt, chosen, rejected) of an implicit-prompt pair (two strings, or two conversations), split where TRL's
    `extract_prompt` splits it: at the first character (or turn) that differs, a space before it kept with the
    answers."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):  # as TRL: none differs, the last index
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _preference(row: dict) -> list[list[dict]] | None:
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if "prompt" in row:
        prompt = _turns(row["prompt"], "user")
        answers = [_turns(a, "assistant") for a in (chosen, rejected)]
        return None if prompt is None or None in answers else [prompt + a for a in answers]
    if (is_chat(chosen) and is_chat(rejected) and chosen and rejected) or (
            isinstance(chosen, str) and isinstance(rejected, str)):
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        prompt = _turns(prompt, "user") if prompt else []
        return [prompt + _turns(a, "assistant") for a in (chosen, rejected)]
    return None


def _chat(row: dict) -> list[list[dict]] | None:
    if "messages" in row:
        return [row["messages"]] if is_chat(row["messages"]) else None
    prompt, completion = _turns(row.get("prompt"), "user"), _turns(row.get("completion"), "assistant")
    return None if prompt is None or completion is None else [prompt + completion]


def conversations(kind: str, row, where: str, path: str) -> list[list[dict]]:
    """The conversations of `row` (one for data=chat, chosen and rejected for data=preference) in any of TRL's forms
    `kind` reads; ConfigError naming the columns found and the forms accepted otherwise."""
    found = (_chat if kind == "chat" else _preference)(row) if isinstance(row, dict) else None
    if found is None:
        raise refused(kind, row, where, path)
    return found


def prompt(row, where: str, path: str):
    """The prompt of a data=prompts row (text, or messages); ConfigError naming the columns found otherwise."""
    value = row.get("prompt", row.get("messages")) if isinstance(row, dict) else None
    if isinstance(value, str) or (is_chat(value) and value):
        return value
    raise refused("prompts", row, where, path)


def refused(kind: str, row, where: str, path: str) -> ConfigError:
    columns = ", ".join(row) if isinstance(row, dict) and row else "none"
    return ConfigError("data.path", path, f"{where} is not a form data={kind} reads (its columns: {columns}; "
                       f"strings, or lists of {{'role': ..., 'content': ...}} messages): give {ACCEPTED[kind]}, "
                       "as TRL's dataset formats name them")
