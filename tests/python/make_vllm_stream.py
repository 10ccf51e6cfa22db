"""Writes tests/python/vllm_events.json: the KV event stream a vLLM engine with prefix caching
publishes for a small workload, with the ground truth for probe prompts.

The engine is simulated the way vLLM's block pool behaves: 16-token blocks, each named by
sha256 over (parent hash, token ids, extra keys) as vLLM's `sha256` prefix-caching hash does
(bytes on the wire), full blocks cached when a request's prefill completes (one `BlockStored`
per request, chained by `parent_block_hash`), least recently used blocks evicted when the pool
is full (`BlockRemoved`), one LoRA request (`lora_id`), one block offloaded to CPU (`medium`
"CPU"), blocks held only in the CPU tier, and a cache reset half-way (`AllBlocksCleared`). A
probe's ground truth is how many of its leading blocks are resident on the GPU for the base
model at the end of the stream, and how many more follow in the CPU tier.

Deterministic: python3 tests/python/make_vllm_stream.py > tests/python/vllm_events.json
"""

import hashlib
import json
import random

BS = 16
CAPACITY = 30  # blocks in the simulated GPU pool

rng = random.Random(11)


def h(parent, tokens, extra):
    m = hashlib.sha256()
    m.update(parent or b"\0" * 32)
    m.update(json.dumps([tokens, extra]).encode())
    return m.digest()


class Engine:
    def __init__(self):
        self.resident = {}  # hash -> (last use, lora, tokens, parent)
        self.clock = 0
        self.batches = []

    def run(self, prompt, lora=None):
        """Prefill `prompt`: cache its full blocks, evicting LRU blocks as needed."""
        self.clock += 1
        parent = None
        new_hashes, new_tokens, first_parent = [], [], None
        events = []
        for i in range(len(prompt) // BS):
            toks = prompt[i * BS:(i + 1) * BS]
            bh = h(parent, toks, lora)
            if bh in self.resident:
                self.resident[bh] = (self.clock,) + self.resident[bh][1:]
            else:
                if not new_hashes:
                    first_parent = parent
                new_hashes.append(bh)
                new_tokens.extend(toks)
            parent = bh
        # Evict least recently used blocks to make room.
        overflow = len(self.resident) + len(new_hashes) - CAPACITY
        if overflow > 0:
            victims = sorted(self.resident, key=lambda k: self.resident[k][0])[:overflow]
            for v in victims:
                del self.resident[v]
            events.append({"type": "BlockRemoved", "block_hashes": [{"hex": v.hex()} for v in victims], "medium": "GPU"})
        if new_hashes:
            for bh, i in zip(new_hashes, range(len(new_hashes))):
                self.resident[bh] = (self.clock, lora)
            events.append({
                "type": "BlockStored",
                "block_hashes": [{"hex": x.hex()} for x in new_hashes],
                "parent_block_hash": None if first_parent is None else {"hex": first_parent.hex()},
                "token_ids": new_tokens,
                "block_size": BS,
                "lora_id": lora,
                "medium": "GPU",
            })
        if events:
            self.batches.append(events)
        return parent

    def clear(self):
        self.resident.clear()
        self.batches.append([{"type": "AllBlocksCleared"}])


def tokens(n):
    return [rng.randrange(1000, 50000) for _ in range(n)]


systems = [tokens(BS * k) for k in (6, 4, 3)]
e = Engine()
# Before the reset: traffic that the reset wipes.
for s in systems:
    e.run(s + tokens(20))
e.clear()
# After it: multi-turn conversations over the shared system prompts, enough to evict.
convs = []
for i in range(9):
    s = systems[i % 3]
    conv = s + tokens(BS * rng.randrange(1, 3) + 5)
    e.run(conv)
    convs.append(conv)
for i in (1, 4):  # second turns of two conversations
    convs[i] = convs[i] + tokens(BS * 2 + 3)
    e.run(convs[i])
# A LoRA request over the first system prompt: its blocks never serve the base model.
e.run(systems[0] + tokens(9), lora=1)
# One block copied to the CPU tier and dropped from it again: its GPU copy stays a hit.
off_prompt = tokens(BS + 1)
off = e.run(off_prompt)
e.batches.append([{"type": "BlockStored", "block_hashes": [{"hex": off.hex()}], "parent_block_hash": None,
                   "token_ids": off_prompt[:BS], "block_size": BS, "lora_id": None, "medium": "CPU"}])
e.batches.append([{"type": "BlockRemoved", "block_hashes": [{"hex": off.hex()}], "medium": "CPU"}])
# A prompt whose blocks live only in the CPU tier (evicted from the GPU after being offloaded):
# not a GPU hit, but an offloaded one.
cpu_prompt = tokens(BS * 3 + 2)
cpu_tier = set()
parent, cpu_hashes = None, []
for i in range(3):
    parent = h(parent, cpu_prompt[i * BS:(i + 1) * BS], None)
    cpu_hashes.append(parent)
    cpu_tier.add(parent)
e.batches.append([{"type": "BlockStored", "block_hashes": [{"hex": x.hex()} for x in cpu_hashes],
                   "parent_block_hash": None, "token_ids": cpu_prompt[:3 * BS], "block_size": BS,
                   "lora_id": None, "medium": "CPU"}])


def resident_prefix(prompt):
    """(leading blocks on the GPU, further blocks in the CPU tier or on the GPU)."""
    parent, gpu, offloaded = None, 0, 0
    for i in range(len(prompt) // BS):
        bh = h(parent, prompt[i * BS:(i + 1) * BS], None)
        on_gpu = bh in e.resident and e.resident[bh][1] is None
        if offloaded == 0 and on_gpu:
            gpu += 1
        elif bh in cpu_tier or on_gpu:
            offloaded += 1
        else:
            break
        parent = bh
    return gpu, offloaded


probes = [s + [7] for s in systems] + [c + [7] for c in convs] + [off_prompt, cpu_prompt, tokens(BS * 3 + 1)]
out = {
    "block_size": BS,
    "batches": e.batches,
    "probes": [
        {"prompt": p, "expected_blocks": g, "expected_offloaded": o}
        for p, (g, o) in ((p, resident_prefix(p)) for p in probes)
    ],
}
print(json.dumps(out))
