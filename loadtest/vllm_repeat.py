#!/usr/bin/env python3
"""How much one engine's TTFT varies for the same work: the floor under any TTFT prediction.

Sends the same pair of requests to one OpenAI-compatible engine N times — a prefix request
(answered with one token, so its prompt is cached) and then a streamed follower that shares the
prefix and adds new tokens — resetting the engine's prefix cache before each pair (vLLM dev
mode's POST /reset_prefix_cache). Every follower is the same work on an idle engine: the same
cached tokens, the same new tokens, nothing else running. Prints each follower's TTFT and the
spread: |TTFT − median| ÷ TTFT at p50 and p90, the error a perfect predictor (one that always
says the median) would have on this engine.
  loadtest/vllm_repeat.py --url http://127.0.0.1:PORT --model NAME [--n 30]
                          [--prefix-words 500] [--new-words 350] [--out FILE.json]
"""
import argparse, json, statistics, time, urllib.request


def post(url, body, stream=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        if not stream:
            r.read()
            return time.perf_counter() - t0, None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            ch = chunk.get("choices") or [{}]
            if ch[0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
                r.read()
                return time.perf_counter() - t0, ttft
    return time.perf_counter() - t0, None


def words(n, seed):
    vocab = ("river stone market light paper window garden signal orange winter number "
             "system engine cloud letter ticket answer morning station silver").split()
    return " ".join(vocab[(i * 7 + seed * 13 + i // 5) % len(vocab)] for i in range(n))


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--url", required=True)
    a.add_argument("--model", required=True)
    a.add_argument("--n", type=int, default=30)
    a.add_argument("--prefix-words", type=int, default=500)
    a.add_argument("--new-words", type=int, default=350)
    a.add_argument("--out")
    x = a.parse_args()
    system = words(x.prefix_words, 1)
    follow = words(x.new_words, 2)
    first = {"model": x.model, "max_tokens": 1, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hello"}]}
    second = {"model": x.model, "max_tokens": 8, "stream": True, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": follow}]}
    ttfts = []
    for i in range(x.n):
        urllib.request.urlopen(urllib.request.Request(
            x.url + "/reset_prefix_cache", data=b"", method="POST"), timeout=30).read()
        post(x.url + "/v1/chat/completions", first)
        _, ttft = post(x.url + "/v1/chat/completions", second, stream=True)
        ttfts.append(ttft)
        time.sleep(0.3)
    med = statistics.median(ttfts)
    dev = sorted(abs(t - med) / t for t in ttfts)
    p = lambda q: dev[max(0, round(q * len(dev)) - 1)]  # noqa: E731
    res = {"n": len(ttfts), "median_s": med, "min_s": min(ttfts), "max_s": max(ttfts),
           "dev_p50": p(0.5), "dev_p90": p(0.9), "ttfts_s": ttfts}
    print(json.dumps({k: v for k, v in res.items() if k != "ttfts_s"}))
    if x.out:
        open(x.out, "w").write(json.dumps(res))


main()
