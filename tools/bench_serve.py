#!/usr/bin/env python3
"""llmrs-serve under load, through the openai client: N streamed greedy requests one after another,
then the same N at once (the same texts, and the wall time of each way), then --flood requests
in waves of N while the server's resident memory is sampled (it should stay flat).

    python tools/bench_serve.py PLAN --threads 2 --streams 8 --tokens 48 --flood 500

Needs `pip install 'llmrs[serve]' openai`; tool only (the test suite checks the same texts in
tests/runtime/test_server.py, without timing them).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Write a haiku about rain.", "Say hello in French.",
           "What color is the sky?", "Name a planet.", "Give me a word that rhymes with cat.",
           "What is the capital of Italy?", "Count to five.", "Name an ocean.", "What is ice made of?",
           "Name a musical instrument.", "What do bees make?", "Name a bird.", "What is the opposite of hot?",
           "Name a month."]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--flood", type=int, default=500, help="requests sent in waves of --streams (default 500)")
    ap.add_argument("--port", type=int, default=8091)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from openai import OpenAI

    server = subprocess.Popen([sys.executable, "-c", "import sys; from llmrs.runtime.serve import main; sys.exit(main())",
                               str(a.plan), "--port", str(a.port), "--threads", str(a.threads),
                               "--max-num-seqs", str(a.streams)], stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        print(line.strip(), file=sys.stderr)
        client = OpenAI(base_url=f"http://127.0.0.1:{a.port}/v1", api_key="unused", max_retries=0, timeout=600)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(a.streams)]

        def ask(p: str) -> str:
            stream = client.chat.completions.create(model="plan", messages=[{"role": "user", "content": p}],
                                                    max_tokens=a.tokens, temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        ask(prompts[0])                                        # warm: page in the weights
        t0 = time.perf_counter()
        one_by_one = [ask(p) for p in prompts]
        t_seq = time.perf_counter() - t0
        with ThreadPoolExecutor(a.streams) as pool:
            t0 = time.perf_counter()
            together = list(pool.map(ask, prompts))
            t_par = time.perf_counter() - t0
            rss = [rss_mib(server.pid)]
            done = 0
            while done < a.flood:
                wave = min(a.streams, a.flood - done)
                list(pool.map(ask, [PROMPTS[(done + i) % len(PROMPTS)] for i in range(wave)]))
                done += wave
                rss.append(rss_mib(server.pid))
        result = {"plan": str(a.plan), "threads": a.threads, "streams": a.streams, "tokens": a.tokens,
                  "same_texts": together == one_by_one, "sequential_s": round(t_seq, 3),
                  "concurrent_s": round(t_par, 3), "concurrent_over_sequential": round(t_par / t_seq, 3),
                  "flood_requests": a.flood, "rss_mib_first": round(rss[0], 1), "rss_mib_last": round(rss[-1], 1),
                  "rss_mib_max": round(max(rss), 1)}
        print(json.dumps(result, indent=1))
        if a.json:
            a.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0 if result["same_texts"] else 1
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
