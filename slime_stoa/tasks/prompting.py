"""How a task item becomes prompt tokens — shared by workers and the trainer so they agree."""

from __future__ import annotations

from typing import Any

from slime_stoa.tasks import Task, TaskItem


def prompt_tokens(tokenizer: Any, task: Task, item: TaskItem) -> list[int]:
    """The prompt as the model sees it: the chat template when the tokenizer has one.

    Works with a transformers tokenizer and with mlx-lm's wrapper around one."""
    if getattr(tokenizer, "chat_template", None):
        tokens = tokenizer.apply_chat_template(task.messages(item), add_generation_prompt=True, tokenize=True)
        if isinstance(tokens, dict) or hasattr(tokens, "keys"):
            tokens = tokens["input_ids"]
        return [int(t) for t in tokens]
    return [int(t) for t in tokenizer.encode(item.prompt)]
