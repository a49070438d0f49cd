"""TRL's dataset formats, read as TRL documents them (its "Dataset formats and types" page), standard (strings) and
conversational (lists of {role, content} messages), into the conversations the recipes render with the model's
chat template:

    data=chat (sft)            language modeling, conversational: messages
                               prompt-completion: prompt, completion (the completion is the assistant's turn)
    data=preference (dpo,      preference, explicit prompt: prompt, chosen, rejected
      reward, kto)             preference, implicit prompt: chosen, rejected (split as TRL's extract_prompt does)
    data=preference (kto)      unpaired preference: prompt, completion, label (a bool: desirable or not); a pair
                               is two such rows, chosen true and rejected false (TRL's unpair_preference_dataset)
    data=prompts (grpo, rloo)  prompt-only: prompt (or messages)

A row of another form is refused in one line naming the columns it has and the forms accepted."""

from __future__ import annotations

from trainer.errors import ConfigError

# What each kind reads, as the refusal names it.
ACCEPTED = {
    "chat": "messages (conversational language modeling), or prompt and completion (prompt-completion)",
    "preference": "prompt, chosen and rejected (explicit prompt), or chosen and rejected (implicit prompt)",
    "unpaired": "prompt, completion and label (unpaired preference, label a bool), or a pair: prompt, chosen and "
                "rejected (explicit prompt), or chosen and rejected (implicit prompt)",
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


def _pair(row: dict) -> tuple[list[dict], list[dict], list[dict]] | None:
    """(prompt, chosen, rejected) messages of a preference row, explicit or implicit prompt; None otherwise."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if "prompt" in row:
        prompt = _turns(row["prompt"], "user")
        answers = [_turns(a, "assistant") for a in (chosen, rejected)]
        return None if prompt is None or None in answers else (prompt, *answers)
    if (is_chat(chosen) and is_chat(rejected) and chosen and rejected) or (
            isinstance(chosen, str) and isinstance(rejected, str)):
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        return (_turns(prompt, "user") if prompt else [], _turns(chosen, "assistant"), _turns(rejected, "assistant"))
    return None


def _preference(row: dict) -> list[list[dict]] | None:
    pair = _pair(row)
    return None if pair is None else [pair[0] + pair[1], pair[0] + pair[2]]


def _chat(row: dict) -> list[list[dict]] | None:
    if "messages" in row:
        return [row["messages"]] if is_chat(row["messages"]) else None
    prompt, completion = _turns(row.get("prompt"), "user"), _turns(row.get("completion"), "assistant")
    return None if prompt is None or completion is None else [prompt + completion]


def _is_unpaired(row) -> bool:
    return isinstance(row, dict) and "completion" in row and "label" in row and "chosen" not in row


def conversations(kind: str, row, where: str, path: str) -> list[list[dict]]:
    """The conversations of `row` (one for data=chat, chosen and rejected for data=preference) in any of TRL's forms
    `kind` reads; ConfigError naming the columns found and the forms accepted otherwise."""
    if kind == "preference" and _is_unpaired(row):
        raise ConfigError("data.path", path, f"{where} is an unpaired preference (prompt, completion, label), which "
                          "only recipe=kto trains on: give pairs (prompt, chosen, rejected), or use recipe=kto")
    found = (_chat if kind == "chat" else _preference)(row) if isinstance(row, dict) else None
    if found is None:
        raise refused(kind, row, where, path)
    return found


def unpaired(row, where: str, path: str) -> list[tuple[list[dict], list[dict], bool]]:
    """(prompt, completion, label) of each unpaired preference of `row`, as TRL's KTOTrainer reads it: the row's own
    (prompt, completion, label), or a pair's two (chosen: true, rejected: false) with the prompt split off as TRL's
    extract_prompt splits an implicit one; ConfigError naming the columns found and the forms accepted otherwise."""
    if _is_unpaired(row):
        prompt, completion = _turns(row.get("prompt"), "user"), _turns(row["completion"], "assistant")
        if prompt is None or completion is None or not isinstance(row["label"], bool):
            raise refused("unpaired", row, where, path)
        return [(prompt, completion, row["label"])]
    pair = _pair(row) if isinstance(row, dict) else None
    if pair is None:
        raise refused("unpaired", row, where, path)
    prompt, chosen, rejected = pair
    return [(prompt, chosen, True), (prompt, rejected, False)]


def prompt(row, where: str, path: str):
    """The prompt of a data=prompts row (text, or messages); ConfigError naming the columns found otherwise."""
    value = row.get("prompt", row.get("messages")) if isinstance(row, dict) else None
    if isinstance(value, str) or (is_chat(value) and value):
        return value
    raise refused("prompts", row, where, path)


def refused(kind: str, row, where: str, path: str) -> ConfigError:
    columns = ", ".join(row) if isinstance(row, dict) and row else "none"
    name = "preference with recipe=kto" if kind == "unpaired" else kind
    return ConfigError("data.path", path, f"{where} is not a form data={name} reads (its columns: {columns}; "
                       f"strings, or lists of {{'role': ..., 'content': ...}} messages): give {ACCEPTED[kind]}, "
                       "as TRL's dataset formats name them")
