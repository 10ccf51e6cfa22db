#!/usr/bin/env python3
"""Writes llama.cpp's reference outputs for the cpu backend's parity detector (c).

For ten fixed chat prompts, runs llama.cpp (through llama-cpp-python, built from PyPI) on the
default model file and records its prompt token ids, its first 32 greedy tokens, and at each
step the five largest logits. The Rust test `replica/tests/llamacpp_parity.rs` replays the same
prompts on kvgate's engine and compares.

    scripts/llamacpp-reference.py            # builds llama-cpp-python into .venv-llamacpp once
    scripts/llamacpp-reference.py --bench    # also times decode and prefill (for BENCHMARKS)
    scripts/llamacpp-reference.py --bench-only   # only the timing, reference left as it is

Building llama-cpp-python from source takes about ten minutes on two cores; the result is
committed (replica/tests/data/llamacpp_smollm2.json), so the test suite never builds it.
"""
import hashlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv-llamacpp")
MODEL = os.path.join(ROOT, "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(ROOT, "replica/tests/data/llamacpp_smollm2.json")
VERSION = "0.3.16"
STEPS = 32
TOP = 5
THREADS = int(os.environ.get("KVGATE_THREADS", "2"))

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Name the largest planet in the solar system.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "List three fruits.",
    "Who wrote Romeo and Juliet?",
    "Translate 'thank you' into French.",
    "Why do cats purr?",
    "Give me a tip for learning to code.",
    "What colour is a ripe banana?",
]


def prompt(q):
    return f"{SYSTEM}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def ensure_venv():
    py = os.path.join(VENV, "bin", "python")
    if not os.path.exists(py):
        subprocess.check_call([sys.executable, "-m", "venv", VENV])
    try:
        subprocess.check_call([py, "-c", "import llama_cpp"], stderr=subprocess.DEVNULL)
    except subprocess.CalledProcessError:
        print(f"building llama-cpp-python=={VERSION} (about ten minutes on two cores)", flush=True)
        subprocess.check_call([py, "-m", "pip", "install", "--quiet", f"llama-cpp-python=={VERSION}"])
    return py


def main():
    if os.environ.get("KVGATE_IN_VENV") != "1":
        py = ensure_venv()
        env = dict(os.environ, KVGATE_IN_VENV="1")
        os.execve(py, [py, __file__] + sys.argv[1:], env)

    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=MODEL, n_ctx=2048, n_threads=THREADS, n_batch=512,
                          logits_all=False, verbose=False)
    if "--bench-only" in sys.argv:
        bench(llm, llama_cpp)
        return
    sha = hashlib.sha256(open(MODEL, "rb").read()).hexdigest()
    n_vocab = llm.n_vocab()

    def last_logits():
        # The logits llama.cpp computed for the last token of the last llama_decode.
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32).copy()

    cases = []
    for q in QUESTIONS:
        text = prompt(q)
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        greedy, tops = [], []
        for _ in range(STEPS):
            logits = last_logits()
            order = np.argsort(-logits, kind="stable")[:TOP]
            tops.append([[int(i), float(logits[i])] for i in order])
            tok = int(order[0])
            greedy.append(tok)
            llm.eval([tok])
        cases.append({"question": q, "prompt": text, "prompt_ids": ids, "greedy_ids": greedy,
                      "top_logits": tops,
                      "text": llm.detokenize(greedy).decode("utf-8", "replace")})
        print(f"{q!r} -> {cases[-1]['text'][:60]!r}", flush=True)
    doc = {
        "generator": "scripts/llamacpp-reference.py",
        "llama_cpp_python": llama_cpp.__version__,
        "model_sha256": sha,
        "threads": THREADS,
        "steps": STEPS,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {OUT}")

    if "--bench" in sys.argv:
        bench(llm, llama_cpp)


def bench(llm, llama_cpp):
    """Prefill tokens/s, decode tokens/s at batch 1, and aggregate decode tokens/s with 16
    sequences in one llama_decode per step: llama.cpp on the same file with the same threads."""
    import numpy as np

    words = "The quick brown fox jumps over the lazy dog while the river runs to the sea. " * 200
    ids = llm.tokenize(words.encode(), add_bos=False)[:1024]
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill = len(ids) / (time.perf_counter() - t)

    llm.reset()
    llm.eval(ids[:32])
    n = 128
    t = time.perf_counter()
    for i in range(n):
        llm.eval([ids[i % len(ids)]])
    decode1 = n / (time.perf_counter() - t)

    n_seq, plen, steps = 16, 32, 64
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 4096
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_seq_max = n_seq
    cp.n_threads = THREADS
    cp.n_threads_batch = THREADS
    model = llm._model.model
    ctx = llama_cpp.llama_new_context_with_model(model, cp)
    batch = llama_cpp.llama_batch_init(512, 0, n_seq)

    def add(tok, pos, seq, want):
        i = batch.n_tokens
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if want else 0
        batch.n_tokens += 1

    for s in range(n_seq):
        batch.n_tokens = 0
        for p in range(plen):
            add(ids[(s * 7 + p) % len(ids)], p, s, p == plen - 1)
        assert llama_cpp.llama_decode(ctx, batch) == 0
    t = time.perf_counter()
    for step in range(steps):
        batch.n_tokens = 0
        for s in range(n_seq):
            add(ids[(s + step) % len(ids)], plen + step, s, True)
        assert llama_cpp.llama_decode(ctx, batch) == 0
    decode16 = n_seq * steps / (time.perf_counter() - t)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    print(json.dumps({"llama_cpp_prefill_tokens_per_s": round(prefill, 1),
                      "llama_cpp_decode_batch1_tokens_per_s": round(decode1, 1),
                      "llama_cpp_decode_batch16_tokens_per_s": round(decode16, 1),
                      "prefill_tokens": len(ids), "threads": THREADS,
                      "llama_cpp_python": llama_cpp.__version__}))


if __name__ == "__main__":
    main()
