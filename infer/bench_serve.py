"""`python -m infer.bench_serve`: load an OpenAI-compatible server and time it.

    python -m infer.bench_serve --url http://127.0.0.1:8000 --concurrency 1,4,16 \\
        --num-requests 64 --prompts prompts.txt
    python -m infer.bench_serve --url http://127.0.0.1:8001 --url http://127.0.0.1:8000 ...

Streams /v1/completions with `concurrency` requests in flight (an async httpx client) and
reports, per server and concurrency: time to first token (TTFT), time per output token after
the first (TPOT), inter-token latency (ITL: the gap between streamed chunks, divided by the
tokens in the later chunk), output throughput, medians and p90, and the server's accepted
length (tokens per decoding step, from its /metrics). Several --url: they take turns, round
by round (`--rounds`), so a drifting machine affects them alike; figures are medians over
the rounds. `--cancel-fraction F`: that share of requests is dropped after a random number
of chunks (a load test), and `--check-greedy` compares every finished greedy answer with
offline plain greedy decoding (`Medusa.generate`) of the same prompt: a differing or lost
request is counted (exit status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

from medusa_jax import cli


def _pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _metrics(client, url) -> dict:
    out = {}
    r = await client.get(url + "/metrics")
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def one_request(client, url, model, prompt, max_tokens, temperature, cancel_after=None,
                      prompt_cache=True):
    """Stream one completion. Returns a dict of timings, the text and the token count.
    prompt_cache False: ask the server not to reuse a cached prompt prefix (llama.cpp's
    `cache_prompt`)."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    if not prompt_cache:
        body["cache_prompt"] = False
    t0 = time.perf_counter()
    times, counts, text, tokens, finish, error = [], [], [], 0, None, None
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return dict(error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                error = ev["error"]["message"]
                continue
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for c in ev.get("choices", []):
                n = len(c.get("token_ids", [])) or 1
                if c["text"] or c.get("token_ids"):
                    times.append(time.perf_counter() - t0)
                    counts.append(n)
                    text.append(c["text"])
                finish = c.get("finish_reason") or finish
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return dict(cancelled=True)
    end = time.perf_counter() - t0
    return dict(times=times, counts=counts, end=end, text="".join(text), tokens=tokens,
                finish=finish, error=error)


async def run_level(url, model, prompts, concurrency, n, max_tokens, temperature,
                    cancel_fraction=0.0, seed=0, prompt_cache=True):
    import httpx

    rng = random.Random(seed)
    jobs = [(i, prompts[i % len(prompts)]) for i in range(n)]
    cancel = {i: rng.randint(1, 6) for i, _ in jobs if rng.random() < cancel_fraction}
    results = {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        before = await _metrics(client, url)
        queue = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)

        async def worker():
            while not queue.empty():
                i, p = queue.get_nowait()
                results[i] = await one_request(client, url, model, p, max_tokens, temperature,
                                               cancel.get(i), prompt_cache)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = await _metrics(client, url)
    steps = after.get("medusa_slot_steps_total", 0) - before.get("medusa_slot_steps_total", 0)
    toks = after.get("medusa_step_tokens_total", 0) - before.get("medusa_step_tokens_total", 0)
    return results, wall, (toks / steps if steps else float("nan")), prompts


def summarize(results: dict, wall: float, accepted: float) -> dict:
    done = [r for r in results.values() if "times" in r and r["times"]]
    ttft = [r["times"][0] for r in done]
    tpot = [(r["end"] - r["times"][0]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    itl = []
    for r in done:
        for a, b, n in zip(r["times"], r["times"][1:], r["counts"][1:]):
            itl.extend([(b - a) / n] * n)
    tokens = sum(r["tokens"] for r in done)
    return dict(requests=len(done), errors=sum(1 for r in results.values() if r.get("error")),
                cancelled=sum(1 for r in results.values() if r.get("cancelled")),
                tokens=tokens, wall_s=wall, throughput=tokens / wall,
                ttft_med=statistics.median(ttft) if ttft else float("nan"),
                ttft_p90=_pct(ttft, 0.9),
                tpot_med=statistics.median(tpot) if tpot else float("nan"),
                tpot_p90=_pct(tpot, 0.9),
                itl_med=statistics.median(itl) if itl else float("nan"), itl_p90=_pct(itl, 0.9),
                accepted=accepted)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m infer.bench_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", required=True, help="server (repeatable)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--num-requests", type=int, default=32, help="per concurrency and round")
    p.add_argument("--prompts", help="text lines or JSONL (default: the held-out openings)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cancel-fraction", type=float, default=0.0)
    p.add_argument("--check-greedy", action="store_true",
                   help="compare greedy answers with offline plain decoding of --model")
    p.add_argument("--model", help="with --check-greedy: the served model's folder "
                                   "(default: the embedded model)")
    p.add_argument("--heads", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-prompt-cache", action="store_true",
                   help="send cache_prompt: false (llama-server then prefills every prompt "
                        "in full, as this project's server does; by default it reuses the "
                        "cached prefix of a prompt it has seen)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    return p


async def _model(url):
    import httpx

    async with httpx.AsyncClient(timeout=30) as c:
        return (await c.get(url + "/v1/models")).json()["data"][0]["id"]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    prompts = [p for p, _ in cli.read_prompts(args.prompts)]
    urls = [u.rstrip("/") for u in args.url]
    models = {u: asyncio.run(_model(u)) for u in urls}
    offline = {}
    if args.check_greedy:  # offline decoding of every prompt, in this process
        from medusa_jax.api import Medusa

        m = Medusa.load(args.model, args.heads)
        gens = m.generate(prompts, max_new_tokens=args.max_tokens, medusa=False)
        offline = {u: {p: g.text for p, g in zip(prompts, gens)} for u in urls}
    rows = {}
    lost = mismatched = checked = 0
    for c in levels:
        for rnd in range(args.rounds):
            for u in urls:
                res, wall, acc, _ = asyncio.run(run_level(
                    u, models[u], prompts, c, args.num_requests, args.max_tokens,
                    args.temperature, args.cancel_fraction, seed=rnd,
                    prompt_cache=not args.no_prompt_cache))
                rows.setdefault((u, c), []).append(summarize(res, wall, acc))
                if args.check_greedy:
                    for i, r in res.items():
                        if r.get("cancelled"):
                            continue
                        if "times" not in r or r.get("error") or r["finish"] is None:
                            lost += 1
                            continue
                        checked += 1
                        mismatched += r["text"] != offline[u][prompts[i % len(prompts)]]
    keys = ["throughput", "ttft_med", "ttft_p90", "tpot_med", "tpot_p90", "itl_med",
            "itl_p90", "accepted"]
    if not args.json:
        print("| server | concurrency | requests | output tok/s | TTFT med / p90 (ms) | "
              "TPOT med / p90 (ms) | ITL med / p90 (ms) | tokens/step |")
        print("|---|---|---|---|---|---|---|---|")
    for (u, c), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        n = sum(r["requests"] for r in rs)
        if args.json:
            print(json.dumps(dict(url=u, concurrency=c, requests=n, rounds=len(rs),
                                  errors=sum(r["errors"] for r in rs),
                                  cancelled=sum(r["cancelled"] for r in rs), **med)))
        else:
            ms = lambda k: f"{1000 * med[k]:.1f}"  # noqa: E731
            print(f"| {u} | {c} | {n} | {med['throughput']:.0f} | {ms('ttft_med')} / "
                  f"{ms('ttft_p90')} | {ms('tpot_med')} / {ms('tpot_p90')} | "
                  f"{ms('itl_med')} / {ms('itl_p90')} | {med['accepted']:.2f} |")
    if args.check_greedy:
        print(f"greedy check: {checked} finished requests compared, {mismatched} differ, "
              f"{lost} lost", file=sys.stderr)
        return 1 if mismatched or lost else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
