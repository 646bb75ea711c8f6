"""Load generator for an OpenAI-compatible vLLM server: streamed requests, per-token timing.

Two load modes, never mixed in one run:

    concurrency C   closed loop: C requests in flight, the next one starts when one finishes
    rate R          open loop: Poisson arrivals at R requests/s (seeded), optional in-flight cap

Every request streams (`stream=True`, `stream_options.include_usage` and
`continuous_usage_stats`, so every chunk carries the cumulative completion
token count: several tokens per chunk under speculation are counted exactly).
Per request we keep: time to first token, the arrival time and token count of
every chunk, end-to-end latency, prompt/completion tokens (server's usage),
finish reason, text, and the error or timeout if it failed. Failed requests
stay in the records and are counted; they never silently disappear.

Timing definitions (all client side, `time.perf_counter`):

    TTFT      request sent -> first chunk carrying >= 1 completion token
    e2e       request sent -> end of stream
    TPOT      (e2e - TTFT) / (output tokens - 1), per request
    ITL       per token: a chunk that brings k tokens after a gap g contributes k samples g / k
              (the time per token a reader sees); ITL_chunk is vLLM bench's definition, the raw gaps
              between token-bearing chunks (one sample per chunk; under speculation a chunk is a step)
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence

from serve_datasets import Prompt


@dataclass
class RequestRecord:
    id: str
    dataset: str
    kind: str
    ok: bool = False
    error: str | None = None
    timed_out: bool = False
    http_status: int | None = None
    start_s: float = 0.0  # send time relative to the run's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    chunk_t: list[float] = field(default_factory=list)  # arrival of each token-bearing chunk, from send
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that chunk

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def itl_token_s(self) -> list[float]:
        out = []
        for i in range(1, len(self.chunk_t)):
            gap, k = self.chunk_t[i] - self.chunk_t[i - 1], self.chunk_tokens[i]
            out.extend([gap / k] * k)
        return out

    def itl_chunk_s(self) -> list[float]:
        return [self.chunk_t[i] - self.chunk_t[i - 1] for i in range(1, len(self.chunk_t))]


def request_seed(base_seed: int, prompt_id: str) -> int:
    """A per-request sampling seed, stable across configurations and runs (same prompt, same seed)."""
    return zlib.crc32(f"{base_seed}/{prompt_id}".encode()) & 0x7FFFFFFF


def request_body(prompt: Prompt, model: str, max_tokens: int,
                 sampling: Mapping | None = None) -> tuple[str, dict]:
    """(endpoint path, JSON body) for one prompt; identical for every configuration.

    sampling: OpenAI sampling fields (temperature, top_p, top_k, seed); greedy when None. A `seed` is the
    run's base seed: each request gets its own `request_seed(seed, prompt.id)`, so the `off` run of a
    slice is reproducible and every configuration sees the same per-request seeds.
    """
    sampling = dict(sampling or {"temperature": 0.0})
    if sampling.get("seed") is not None:
        sampling["seed"] = request_seed(int(sampling["seed"]), prompt.id)
    common = {"model": model, "max_tokens": max_tokens, **sampling, "stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if prompt.stop:
        common["stop"] = list(prompt.stop)
    if prompt.kind == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt.text}]}
    if prompt.kind == "completion":
        return "/v1/completions", {**common, "prompt": prompt.text}
    raise ValueError(f"prompt kind {prompt.kind!r}")


def _delta_text(choice: dict) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_one(session, base: str, prompt: Prompt, model: str, max_tokens: int, timeout_s: float,
                   run_t0: float, sampling: Mapping | None = None) -> RequestRecord:
    import aiohttp

    rec = RequestRecord(prompt.id, prompt.dataset, prompt.kind)
    path, body = request_body(prompt, model, max_tokens, sampling)
    t0 = time.perf_counter()
    rec.start_s = t0 - run_t0
    parts: list[str] = []
    seen_tokens = 0
    try:
        async with session.post(base + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return rec
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        now = time.perf_counter() - t0
                        msg = json.loads(data)
                        if "error" in msg:
                            rec.error = f"stream error: {json.dumps(msg['error'])[:500]}"
                            continue
                        usage = msg.get("usage") or {}
                        choices = msg.get("choices") or []
                        for ch in choices:
                            parts.append(_delta_text(ch))
                            if ch.get("finish_reason"):
                                rec.finish_reason = ch["finish_reason"]
                        if usage.get("prompt_tokens") is not None:
                            rec.prompt_tokens = usage["prompt_tokens"]
                        if usage.get("completion_tokens") is not None:
                            total = int(usage["completion_tokens"])
                        else:  # no continuous usage: one token per chunk with text
                            total = seen_tokens + sum(1 for ch in choices if _delta_text(ch))
                        if total > seen_tokens and choices:
                            rec.chunk_t.append(now)
                            rec.chunk_tokens.append(total - seen_tokens)
                            if rec.ttft_s is None:
                                rec.ttft_s = now
                            seen_tokens = total
                        elif total > seen_tokens:  # final usage-only chunk with a larger count
                            seen_tokens = total
            rec.e2e_s = time.perf_counter() - t0
            rec.output_tokens = seen_tokens
            rec.text = "".join(parts)
            rec.ok = rec.error is None
    except asyncio.TimeoutError:
        rec.timed_out = True
        rec.error = f"timeout after {timeout_s:.0f} s"
        rec.text = "".join(parts)
        rec.output_tokens = seen_tokens
    except Exception as e:  # connection reset, bad JSON, ...: kept as an error record
        rec.error = f"{type(e).__name__}: {str(e)[:300]}"
        rec.text = "".join(parts)
        rec.output_tokens = seen_tokens
    return rec


async def _run(base: str, prompts: Sequence[Prompt], model: str, max_tokens: int, *, concurrency: int | None,
               rate: float | None, max_in_flight: int | None, timeout_s: float, seed: int,
               on_done: Callable[[RequestRecord], None] | None,
               sampling: Mapping | None) -> tuple[list[RequestRecord], float]:
    import aiohttp

    cap = concurrency if concurrency is not None else max_in_flight
    sem = asyncio.Semaphore(cap) if cap else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    records: list[RequestRecord | None] = [None] * len(prompts)
    async with aiohttp.ClientSession(connector=connector) as session:
        run_t0 = time.perf_counter()

        async def one(i: int, p: Prompt):
            if sem is not None:
                async with sem:
                    rec = await send_one(session, base, p, model, max_tokens, timeout_s, run_t0, sampling)
            else:
                rec = await send_one(session, base, p, model, max_tokens, timeout_s, run_t0, sampling)
            records[i] = rec
            if on_done:
                on_done(rec)

        tasks = []
        if rate is None:
            tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        else:
            rng = random.Random(seed)
            t_next = 0.0
            for i, p in enumerate(prompts):
                delay = t_next - (time.perf_counter() - run_t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, p)))
                t_next += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - run_t0
    return [r for r in records if r is not None], duration


def run_load(base: str, prompts: Sequence[Prompt], model: str, max_tokens: int, *, concurrency: int | None = None,
             rate: float | None = None, max_in_flight: int | None = None, timeout_s: float = 600.0, seed: int = 0,
             on_done: Callable[[RequestRecord], None] | None = None,
             sampling: Mapping | None = None) -> tuple[list[RequestRecord], float]:
    """Send every prompt once; return (records in prompt order, wall seconds from first send to last end).

    sampling: the OpenAI sampling fields of every request (request_body); greedy when None."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency (closed loop) or rate (Poisson arrivals)")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency = {concurrency}: must be >= 1")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate = {rate}: must be > 0 requests/s")
    return asyncio.run(_run(base, prompts, model, max_tokens, concurrency=concurrency, rate=rate,
                            max_in_flight=max_in_flight, timeout_s=timeout_s, seed=seed, on_done=on_done,
                            sampling=sampling))
