"""Time to first token of a second conversation sharing a ~400-token system prompt (CPU, 2 threads)."""
import statistics, sys, llmrs
plan = sys.argv[1]
with llmrs.load(plan, threads=2) as model:
    system = " ".join(f"Rule {i}: answer politely and cite the manual section {i}." for i in range(34))
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]
    ids = lambda q: model.tokenize(model.render_chat(msgs(q)), add_special_tokens=False)
    rows = []
    for rep in range(3):
        model.batch.reset() if model.batch else None
        a = model.generate_many([ids(f"What is rule {rep}?")], max_tokens=4)[0]
        b = model.generate_many([ids(f"Summarise rule {rep + 7} in five words.")], max_tokens=4)[0]
        rows.append((a.prompt_tokens, a.cached_tokens, a.ttft_s, b.prompt_tokens, b.cached_tokens, b.ttft_s))
        print(f"first: {a.prompt_tokens} tokens, {a.cached_tokens} cached, ttft {a.ttft_s*1e3:.1f} ms; "
              f"second: {b.prompt_tokens} tokens, {b.cached_tokens} cached, ttft {b.ttft_s*1e3:.1f} ms; "
              f"ratio {b.ttft_s / a.ttft_s:.3f}")
    print("median ratio", round(statistics.median(r[5] / r[2] for r in rows), 3))
