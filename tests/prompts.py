"""The reference prompts: raw and chat, short and long, and lengths around a block boundary."""

from __future__ import annotations

LONG_TEXT = " ".join(
    f"Note {i}: the river town of Ashford kept {i * 7 % 31} boats, {i * 3 % 17} mills and a "
    f"bridge that was rebuilt in {1700 + i * 13 % 250}." for i in range(60)
) + " Summarise the notes above in one sentence:"

RAW = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "Les chats et les chiens",
]
CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact about the moon."}],
]


def reference_prompts(tokenizer, block_size: int = 16) -> dict[str, list[int]]:
    """name -> prompt token ids; at least 8, one over 1,000 tokens, three around block_size."""
    prompts = {f"raw{i}": tokenizer.encode(p) for i, p in enumerate(RAW)}
    prompts.update({f"chat{i}": tokenizer.apply_chat_template(m) for i, m in enumerate(CHAT)})
    long_ids = tokenizer.encode(LONG_TEXT)
    assert len(long_ids) > 1000
    prompts["long"] = long_ids
    for n in (block_size - 1, block_size, block_size + 1):
        prompts[f"len{n}"] = long_ids[:n]
    return prompts
