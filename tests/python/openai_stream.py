"""Streams one chat completion through kvgate with the official openai SDK.

Usage: python3 openai_stream.py BASE_URL MODEL
Prints `chunks=N text=...` and exits non-zero if the stream is empty or malformed.
"""
import sys

from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="unused")
stream = client.chat.completions.create(
    model=model,
    messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something about prefix caching."},
    ],
    max_tokens=24,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"ignore_eos": True},
)
chunks, text, usage, finish = 0, "", None, None
for chunk in stream:
    chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
assert chunks > 5, chunks
assert text.strip(), "empty text"
assert finish == "length", finish
assert usage is not None and usage.completion_tokens == 24, usage
print(f"chunks={chunks} completion_tokens={usage.completion_tokens} text={text!r}")
