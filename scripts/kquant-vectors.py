#!/usr/bin/env python3
"""Writes test vectors for kvgate's K-quant decoders (Q4_K, Q6_K): random blocks with sane
scales, decoded by the `gguf` package (llama.cpp's own Python reference, `gguf.quants`).
kernels/tests/kquant.rs decodes the same bytes and must get the same values.

    python3 -m pip install gguf numpy && python3 scripts/kquant-vectors.py
"""
import json, os
import numpy as np
import gguf
from gguf import quants, GGMLQuantizationType as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "kernels/tests/data/kquant_vectors.json")
rng = np.random.RandomState(7)
cases = []
for name, t, size, d_offsets in [("Q4_K", T.Q4_K, 144, [0, 2]), ("Q6_K", T.Q6_K, 210, [208])]:
    blocks = rng.randint(0, 256, size=(3, size)).astype(np.uint8)
    for b in blocks:
        for off in d_offsets:
            v = np.float16(rng.uniform(-0.05, 0.05))
            b[off:off + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    raw = blocks.reshape(-1)
    values = quants.dequantize(raw.reshape(1, -1), t).reshape(-1)
    cases.append({"format": name, "bytes": raw.tobytes().hex(),
                  "values": [float(x) for x in values]})
with open(OUT, "w") as f:
    json.dump({"generator": "scripts/kquant-vectors.py", "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "unknown", "cases": cases}, f)
print("wrote", OUT)
