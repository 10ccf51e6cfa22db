#!/usr/bin/env bash
# The gateway's own cost next to nginx's, in one run on this machine (issue 14). One sim replica
# with `--time-scale 0` (tokens as fast as its engine loop makes them), called directly, through
# nginx (one worker, upstream keep-alive, `proxy_buffering off`) and through kvgate
# (`prefix_aware`, its defaults), interleaved, ROUNDS rounds:
#   stream   `hey -n $N_STREAM -c 16`, streaming chat, $TOKENS tokens each: req/s, p99, and the
#            proxy's CPU seconds (utime+stime of all its processes, from /proc) per streamed token;
#   small    `hey -n $N_SMALL -c 16`, non-streaming chat, 1 token: req/s, p99, CPU per request;
#   c1       `hey -n $N_C1 -c 1`, the same small request: p99 added over calling the replica.
# Prints one line per (round, case, target) and a markdown table of medians to stdout.
#   loadtest/proxy_cost.sh [--bin PATH] [--baseline-bin PATH] [--rounds N] [--perf DIR]
# --baseline-bin adds a second gateway, `kvgate_base`, from another build (an earlier commit),
# measured in the same rounds: before and after in one run.
# --perf DIR also records `perf record -g` of the gateway during one extra streaming and one
# extra small run, and writes the top frames to DIR/{stream,small}-top.txt.
# Needs nginx and hey (Debian packages). Loopback only; every process is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/kvgate
base_bin=
rounds=3
perf_dir=
while [ $# -gt 0 ]; do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --baseline-bin) base_bin=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --perf) perf_dir=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
N_STREAM=${N_STREAM:-400}
N_SMALL=${N_SMALL:-4000}
N_C1=${N_C1:-2000}
TOKENS=${TOKENS:-200}
for tool in nginx hey; do
  command -v "$tool" >/dev/null || { echo "proxy_cost.sh needs $tool (apt-get install $tool)" >&2; exit 1; }
done
# The default binary is built first (a no-op when it is current), so a stale one is never
# measured by mistake; --bin measures exactly the file given.
if [ "$bin" = target/release/kvgate ]; then
  cargo build --release --bin kvgate
fi
./scripts/fetch-models.sh >/dev/null

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

rport=$(free_port)
"$bin" replica --port "$rport" --replica-id r0 --time-scale 0 >"$work/replica.log" 2>&1 &
pids+=($!)
until curl -sf "127.0.0.1:$rport/health" >/dev/null; do sleep 0.2; done

gport=$(free_port)
cat >"$work/gateway.toml" <<TOML
listen = "127.0.0.1:$gport"
admin_listen = "127.0.0.1:$(free_port)"
replicas = ["127.0.0.1:$rport"]
[model]
tokenizer_dir = "models/qwen3"
[policy]
kind = "prefix_aware"
TOML
"$bin" gateway --config "$work/gateway.toml" >"$work/gateway.log" 2>&1 &
gw_pid=$!
pids+=("$gw_pid")
until curl -sf "127.0.0.1:$gport/health" >/dev/null; do sleep 0.2; done

targets=(direct nginx kvgate)
if [ -n "$base_bin" ]; then
  bport=$(free_port)
  sed -e "s/127.0.0.1:$gport/127.0.0.1:$bport/" -e "s/^admin_listen = .*/admin_listen = \"127.0.0.1:$(free_port)\"/" \
    "$work/gateway.toml" >"$work/gateway-base.toml"
  "$base_bin" gateway --config "$work/gateway-base.toml" >"$work/gateway-base.log" 2>&1 &
  base_pid=$!
  pids+=("$base_pid")
  until curl -sf "127.0.0.1:$bport/health" >/dev/null; do sleep 0.2; done
  targets+=(kvgate_base)
fi

nport=$(free_port)
cat >"$work/nginx.conf" <<NGINX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $work;
  proxy_temp_path $work;
  upstream replica {
    server 127.0.0.1:$rport;
    keepalive 64;
  }
  server {
    listen 127.0.0.1:$nport;
    location / {
      proxy_pass http://replica;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
NGINX
nginx -c "$work/nginx.conf"
until curl -sf "127.0.0.1:$nport/health" >/dev/null; do sleep 0.2; done
nginx_master=$(cat "$work/nginx.pid")

# CPU seconds (user + system) of a set of processes, all their threads included.
cpu_of() {
  local total=0 p
  for p in "$@"; do
    # Fields 14 and 15 of /proc/PID/stat, after the command name in parentheses.
    total=$((total + $(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}')))
  done
  echo "$total"
}
pids_of() { # target -> the processes whose CPU is the proxy's
  case $1 in
    direct) echo ;;
    nginx) echo "$nginx_master $(pgrep -P "$nginx_master" | tr '\n' ' ')" ;;
    kvgate) echo "$gw_pid" ;;
    kvgate_base) echo "$base_pid" ;;
  esac
}
url_of() {
  case $1 in
    direct) echo "http://127.0.0.1:$rport" ;;
    nginx) echo "http://127.0.0.1:$nport" ;;
    kvgate) echo "http://127.0.0.1:$gport" ;;
    kvgate_base) echo "http://127.0.0.1:$bport" ;;
  esac
}
hz=$(getconf CLK_TCK)
msgs='"messages":[{"role":"system","content":"You are a support assistant for a company that sells paged KV caches. Be brief."},{"role":"user","content":"How do I pick a block size?"}]'
stream_body="{\"model\":\"Qwen3-8B\",$msgs,\"max_tokens\":$TOKENS,\"ignore_eos\":true,\"stream\":true}"
small_body="{\"model\":\"Qwen3-8B\",$msgs,\"max_tokens\":1,\"ignore_eos\":true}"

results=$work/results.jsonl
measure() { # round case target n conc body
  local round=$1 case=$2 target=$3 n=$4 conc=$5 body=$6 procs before after
  procs=$(pids_of "$target")
  # shellcheck disable=SC2086
  before=$(cpu_of $procs)
  hey -n "$n" -c "$conc" -m POST -T application/json -d "$body" "$(url_of "$target")/v1/chat/completions" >"$work/hey.txt"
  # shellcheck disable=SC2086
  after=$(cpu_of $procs)
  python3 - "$work/hey.txt" "$round" "$case" "$target" "$n" "$((after - before))" "$hz" "$TOKENS" >>"$results" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
round_, case, target, n, ticks, hz, tokens = sys.argv[2:9]
n, ticks, hz, tokens = int(n), int(ticks), int(hz), int(tokens)
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
p99 = float(re.search(r"99% in ([\d.]+) secs", text).group(1)) * 1e3
ok = int((re.search(r"\[200\]\s+(\d+) responses", text) or [0, 0])[1])
cpu = ticks / hz
row = {"round": int(round_), "case": case, "target": target, "n": n, "ok": ok,
       "rps": round(rps, 1), "p99_ms": round(p99, 2), "cpu_s": round(cpu, 3)}
if case == "stream" and target != "direct":
    row["cpu_us_per_token"] = round(cpu / (ok * tokens) * 1e6, 3) if ok else None
if case == "small" and target != "direct":
    row["cpu_us_per_request"] = round(cpu / ok * 1e6, 2) if ok else None
print(json.dumps(row))
PY
  tail -1 "$results"
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); nginx $(nginx -v 2>&1 | cut -d/ -f2); kvgate binary $bin (built $(date -u -r "$bin" +%FT%TZ)), checkout at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "warm-up"
for t in "${targets[@]}"; do
  hey -n 200 -c 4 -m POST -T application/json -d "$small_body" "$(url_of $t)/v1/chat/completions" >/dev/null
  hey -n 32 -c 8 -m POST -T application/json -d "$stream_body" "$(url_of $t)/v1/chat/completions" >/dev/null
done
for round in $(seq 1 "$rounds"); do
  # Rotate the order each round so no target always runs first.
  order=("${targets[@]}")
  shift_by=$(((round - 1) % ${#targets[@]}))
  order=("${order[@]:$shift_by}" "${order[@]:0:$shift_by}")
  for t in "${order[@]}"; do measure "$round" stream "$t" "$N_STREAM" 16 "$stream_body"; done
  for t in "${order[@]}"; do measure "$round" small "$t" "$N_SMALL" 16 "$small_body"; done
  for t in "${order[@]}"; do measure "$round" c1 "$t" "$N_C1" 1 "$small_body"; done
done

# Sums a flat profile into where the time goes (first matching pattern wins).
categorise='
import re, sys
groups = [
    ("kernel: network and system calls", r"\[k\] .*(tcp|ip_|skb|sock|net_|dev_|sys_|syscall|sendmsg|recvmsg|writev|napi|softirq|epoll|ep_)"),
    ("kernel: scheduling and wake-ups", r"\[k\] .*(sched|task_switch|futex|wake|spin|irq|schedule|rcu|timer|hrtimer|clock)"),
    ("kernel: other", r"\[k\] "),
    ("allocator and copies", r"(malloc|free|_mi_|mi_|realloc|alloc::|__rdl_|__rust_alloc|__rust_dealloc|memmove|memcpy|memset)"),
    ("chat template (minijinja)", r"minijinja"),
    ("tokeniser (tokenizers, regex)", r"(tokenizers|fancy_regex|regex|aho_corasick|onig|unicode)"),
    ("JSON (serde_json)", r"serde"),
    ("SSE event scanning (memchr)", r"memchr"),
    ("HTTP: pingora", r"pingora"),
    ("HTTP: hyper client and its buffers", r"(hyper|h2::|httparse|http::|bytes::)"),
    ("async runtime (tokio, mio, wakers)", r"(tokio|mio::|futures|atomic_waker|crossbeam|epoll_wait)"),
    ("clock reads", r"(clock_gettime|Timespec|Instant)"),
    ("metrics", r"metrics"),
    ("gateway, policies, protocol", r"(gateway::|policies::|protocol::|config::|xxh)"),
    ("other", r"."),
]
totals = {g: 0.0 for g, _ in groups}
for line in sys.stdin:
    m = re.match(r"\s+([0-9.]+)%\s+(.*)", line)
    if not m:
        continue
    pct, rest = float(m.group(1)), m.group(2)
    for g, pat in groups:
        if re.search(pat, rest):
            totals[g] += pct
            break
for g, _ in groups:
    print(f"{totals[g]:6.1f}%  {g}")
'
if [ -n "$perf_dir" ]; then
  mkdir -p "$perf_dir"
  for target in "${targets[@]}"; do
    case $target in kvgate | kvgate_base) ;; *) continue ;; esac
    pid=$(pids_of "$target")
    for case in stream small; do
      if [ "$case" = stream ]; then body=$stream_body n=$N_STREAM; else body=$small_body n=$N_SMALL; fi
      name=$case-$target
      perf record -F 999 -g -p "$pid" -o "$work/$name.perf" >"$work/$name.perf.log" 2>&1 &
      perf_pid=$!
      sleep 0.5
      hey -n "$n" -c 16 -m POST -T application/json -d "$body" "$(url_of "$target")/v1/chat/completions" >/dev/null
      kill -INT "$perf_pid"
      wait "$perf_pid" 2>/dev/null || true
      { perf report -i "$work/$name.perf" --no-children --sort symbol --stdio -g none 2>&1 |
        grep -E '^ +[0-9.]+%' | sed 's/  *- *- *$//' | head -40 || cat "$work/$name.perf.log"; } >"$perf_dir/$name-top.txt"
      perf report -i "$work/$name.perf" --no-children --sort symbol --stdio -g none 2>/dev/null |
        python3 -c "$categorise" >"$perf_dir/$name-categories.txt" || true
      echo "profile: $perf_dir/$name-top.txt, $perf_dir/$name-categories.txt"
    done
  done
fi

python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def cell(case, target, key):
    xs = [r[key] for r in rows if r["case"] == case and r["target"] == target and r.get(key) is not None]
    if not xs:
        return None, None, None
    return statistics.median(xs), min(xs), max(xs)
def fmt(v, digits=1):
    med, lo, hi = v
    if med is None:
        return "—"
    return f"{med:,.{digits}f} [{lo:,.{digits}f}–{hi:,.{digits}f}]"
print()
print("| case | target | req/s | p99 ms | proxy CPU µs per streamed token | proxy CPU µs per request | req/s ÷ nginx | CPU ÷ nginx |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for case in ["stream", "small", "c1"]:
    for target in [t for t in ["direct", "nginx", "kvgate_base", "kvgate"] if any(r["target"] == t for r in rows)]:
        rps = cell(case, target, "rps")
        p99 = cell(case, target, "p99_ms")
        tok = cell(case, target, "cpu_us_per_token") if case == "stream" else (None, None, None)
        req = cell(case, target, "cpu_us_per_request") if case == "small" else (None, None, None)
        # Ratios per round, then the median.
        def ratio(key):
            out = []
            for r in {x["round"] for x in rows}:
                a = [x[key] for x in rows if x["round"] == r and x["case"] == case and x["target"] == target]
                b = [x[key] for x in rows if x["round"] == r and x["case"] == case and x["target"] == "nginx"]
                if a and b and a[0] and b[0]:
                    out.append(a[0] / b[0])
            return (statistics.median(out), min(out), max(out)) if out else (None, None, None)
        cpu_key = "cpu_us_per_token" if case == "stream" else "cpu_us_per_request" if case == "small" else None
        cpu_ratio = ratio(cpu_key) if cpu_key and target != "direct" else (None, None, None)
        print(f"| {case} | {target} | {fmt(rps, 0)} | {fmt(p99)} | {fmt(tok, 2)} | {fmt(req, 1)} | {fmt(ratio('rps'), 2)} | {fmt(cpu_ratio, 2)} |")
targets = [t for t in ["direct", "nginx", "kvgate_base", "kvgate"] if any(r["target"] == t for r in rows)]
c1 = {t: cell("c1", t, "p99_ms")[0] for t in targets}
if all(c1.values()):
    print()
    added = ", ".join(f"{t} {c1[t] - c1['direct']:+.2f} ms" for t in targets if t != "direct")
    print(f"c=1 p99 added over direct (medians): {added} (hey reports latency in 0.1 ms steps)")
PY
