"""The Batch API through the official openai SDK, as a user runs it against kvgate.

Usage: openai_batch.py BASE_URL KEY_A KEY_B MODEL

Tenant A uploads a file, creates a batch, waits for it and reads its output; tenant B can
neither see nor cancel it; a malformed file is refused naming its line; a cancelled batch
keeps its finished lines. Prints one `... ok` line per check and exits non-zero on failure.
"""

import io
import json
import sys
import time

import openai

base, key_a, key_b, model = sys.argv[1:5]
a = openai.OpenAI(base_url=base, api_key=key_a, max_retries=0)
b = openai.OpenAI(base_url=base, api_key=key_b, max_retries=0)


def jsonl(n, max_tokens, prefix="req"):
    lines = []
    for i in range(n):
        lines.append(
            json.dumps(
                {
                    "custom_id": f"{prefix}-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": model,
                        "messages": [
                            {"role": "system", "content": "You summarise support tickets."},
                            {"role": "user", "content": f"Ticket {i}: the printer is on fire."},
                        ],
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                    },
                }
            )
        )
    return ("\n".join(lines) + "\n").encode()


def wait(client, batch_id, statuses, timeout=240):
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.time() < deadline, f"batch stuck in {batch.status}: {batch}"
        time.sleep(0.2)


def lines_of(client, file_id):
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(l) for l in text.splitlines() if l.strip()]


# 1. The round trip.
f = a.files.create(file=("tickets.jsonl", io.BytesIO(jsonl(6, 8))), purpose="batch")
assert f.purpose == "batch" and f.bytes > 0, f
batch = a.batches.create(
    input_file_id=f.id,
    endpoint="/v1/chat/completions",
    completion_window="24h",
    metadata={"job": "tickets"},
)
assert batch.status in ("validating", "in_progress"), batch
done = wait(a, batch.id, ("completed", "failed", "expired", "cancelled"))
assert done.status == "completed", done
assert done.request_counts.total == 6 and done.request_counts.completed == 6, done
assert done.metadata == {"job": "tickets"}, done
# The batch names its model and sums its answers' tokens, as OpenAI's batch object does.
assert done.model, done
assert done.usage is not None and done.usage.output_tokens > 0, done
assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens, done
out = lines_of(a, done.output_file_id)
ids = sorted(l["custom_id"] for l in out)
assert ids == sorted(f"req-{i}" for i in range(6)), ids
for l in out:
    assert l["response"]["status_code"] == 200, l
    assert l["response"]["body"]["usage"]["completion_tokens"] == 8, l
    assert l["error"] is None
assert done.error_file_id is None, done
assert any(x.id == batch.id for x in a.batches.list().data)
print("roundtrip ok")

# 2. Another tenant sees nothing of it.
for call in (
    lambda: b.batches.retrieve(batch.id),
    lambda: b.batches.cancel(batch.id),
    lambda: b.files.retrieve(f.id),
    lambda: b.files.content(done.output_file_id),
):
    try:
        call()
    except openai.NotFoundError:
        continue
    raise AssertionError("tenant B reached tenant A's object")
assert all(x.id != batch.id for x in b.batches.list().data)
assert all(x.id != f.id for x in b.files.list().data)
print("isolation ok")

# 3. A malformed file is refused with its line number, before anything runs.
bad = jsonl(3, 8).splitlines()
bad[2] = b'{"custom_id": "req-2", "method": "POST", "url": "/v1/chat/completions"}'
try:
    a.files.create(file=("bad.jsonl", io.BytesIO(b"\n".join(bad))), purpose="batch")
    raise AssertionError("a malformed file was accepted")
except openai.BadRequestError as e:
    assert "line 3" in str(e), e
print("malformed ok")

# 4. Cancel: nothing more starts, finished lines are kept, every line is accounted for.
f2 = a.files.create(file=("long.jsonl", io.BytesIO(jsonl(120, 64, "long"))), purpose="batch")
batch2 = a.batches.create(
    input_file_id=f2.id, endpoint="/v1/chat/completions", completion_window="24h"
)
deadline = time.time() + 60
while a.batches.retrieve(batch2.id).request_counts.completed < 1:
    assert time.time() < deadline, "no line finished"
    time.sleep(0.05)
cancelling = a.batches.cancel(batch2.id)
assert cancelling.status in ("cancelling", "cancelled"), cancelling
ended = wait(a, batch2.id, ("cancelled",))
counts = ended.request_counts
assert 1 <= counts.completed < 120, ended
out = lines_of(a, ended.output_file_id)
err = lines_of(a, ended.error_file_id)
assert len(out) == counts.completed, (len(out), counts)
assert all(l["error"]["code"] == "batch_cancelled" for l in err), err[:2]
seen = [l["custom_id"] for l in out + err]
assert sorted(seen) == sorted(f"long-{i}" for i in range(120)), "each line once"
try:
    a.batches.cancel(batch.id)
    raise AssertionError("a completed batch was cancelled")
except openai.ConflictError:
    pass
print(f"cancel ok ({counts.completed} of 120 finished)")
