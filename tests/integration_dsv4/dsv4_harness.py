"""Engine harness for the DeepSeek-V4 tree tests: runs, an oracle tree drafter, cache snapshots.

* `run_dsv4` starts an in-process engine on the tiny checkpoint (bf16, eager),
  generates, and returns outputs, vLLM's spec metrics, the tree runner's and
  the adapter's counters, plus whatever the `observe` callbacks collected.
* `OracleTreeDrafter` knows the target's greedy continuation (from a run
  without speculation) and builds random trees that contain it at a random
  sibling rank, next to wrong siblings and wrong subtrees; accepted paths are
  therefore long, often leave the first branch, and siblings complete the
  same CSA / HCA block in different branches. It is injected by replacing
  `proposer.make_drafter` (in-process engines only).
* `dsv4_oracle` is the greedy-identity oracle (tests/fixtures/greedy_oracle.py)
  wired to this engine: the near-tie reference is the engine's own prompt
  log-probabilities (a prefill over the shared prefix, no speculation), the
  continuation a run without speculation, the numerics control vLLM's own
  linear n-gram speculation.
* `snapshot_request_caches` reads, through vLLM's block tables, every
  position-addressed store of one request: SWA rows of the window, compressor
  state rows, compressed entries C4 / C128 and indexer keys.
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_tree_spec.drafters.base import DraftRequest, TreeDrafter, TreeProposal, deterministic_mode
from vllm_tree_spec.tree import Tree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from greedy_oracle import NEAR_TIE_BF16, GreedyOracle, first_difference  # noqa: E402,F401

LOW_TOKEN = 7  # keep clear of the tokenizer's specials
REFERENCE_TOP_K = 20  # a token below the reference's top 20 is no near-tie
# the numerics control: vLLM's own linear speculation (multi-row verify steps, no tree code)
LINEAR_CONTROL = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@dataclass
class Dsv4Run:
    outputs: list[list[int]]
    metrics: dict = field(default_factory=dict)
    tree_stats: dict | None = None
    adapter_stats: dict | None = None
    raw: list | None = None  # vLLM's RequestOutputs (raw_outputs=True)


@contextlib.contextmanager
def stock_tile_scheduler_fix():
    """Test-only: engines *without* tree speculation need the D3 fix too (vLLM 0.32 CPU bug); tree engines
    apply it themselves on their builder instances. Class-level, only while a baseline engine runs."""
    from vllm.models.deepseek_v4.cpu import cpu_mla

    from vllm_tree_spec.integration.dsv4.patches import fixed_build_tile_scheduler

    cls = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    orig = cls.__dict__["build_tile_scheduler"]
    cls.build_tile_scheduler = fixed_build_tile_scheduler
    try:
        yield
    finally:
        cls.build_tile_scheduler = orig


def worker_runner(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def run_dsv4(model: str, prompts, params, spec: dict | None = None, *, max_model_len: int = 640,
             max_num_seqs: int = 4, drafter_factory=None, on_llm=None, raw_outputs: bool = False,
             **engine_kwargs) -> Dsv4Run:
    """Start an engine, generate, collect, shut down. `drafter_factory(cfg)` replaces the tree drafter."""
    from vllm import LLM

    from vllm_tree_spec.integration import proposer as proposer_mod

    kwargs = dict(model=model, max_model_len=max_model_len, enforce_eager=True, max_num_seqs=max_num_seqs,
                  seed=0, disable_log_stats=False, speculative_config=spec)
    kwargs.update(engine_kwargs)
    orig_make = proposer_mod.make_drafter
    if drafter_factory is not None:
        proposer_mod.make_drafter = lambda cfg, vllm_config=None, **_: drafter_factory(cfg)
    is_tree = spec is not None and spec.get("method") == "tree"
    ctx = contextlib.nullcontext() if is_tree else stock_tile_scheduler_fix()
    try:
        with ctx:
            llm = LLM(**kwargs)
            try:
                if on_llm is not None:
                    on_llm(llm)
                outs = llm.generate(prompts, params, use_tqdm=False)
                metrics = {}
                for m in llm.get_metrics():
                    if "spec_decode" in m.name:
                        metrics[m.name.split(":")[-1].removeprefix("spec_decode_")] = \
                            getattr(m, "values", None) or getattr(m, "value", None)
                runner = worker_runner(llm)
                stats = runner.tree_stats.as_dict() if hasattr(runner, "tree_stats") else None
                adapter = getattr(runner, "tree_adapter", None)
                astats = dict(adapter.stats) if hasattr(adapter, "stats") else None
                return Dsv4Run([list(o.outputs[0].token_ids) for o in outs], metrics, stats, astats,
                               outs if raw_outputs else None)
            finally:
                restore = getattr(llm, "_tree_spec_restore", None)
                if restore is not None:
                    restore()
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
    finally:
        proposer_mod.make_drafter = orig_make


def random_prompts(lengths, seed: int = 0, vocab: int = 512, repeat: float = 0.0) -> list[list[int]]:
    """Random-token prompts (optionally with repeated motifs so n-gram / suffix drafters find matches)."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        motif = [rng.randrange(LOW_TOKEN, vocab) for _ in range(rng.randint(3, 7))]
        body: list[int] = []
        while len(body) < n:
            body += motif if rng.random() < repeat else [rng.randrange(LOW_TOKEN, vocab)]
        out.append(body[:n])
    return out


def dsv4_oracle(model: str, prompts: list[list[int]], params, *, control: bool = True,
                **engine_kwargs) -> GreedyOracle:
    """The greedy-identity oracle for runs of `prompts` with `params` (greedy) on `model`.

    engine_kwargs (max_model_len, max_num_seqs) are those of the runs being compared.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def reference(contexts, pairs):
        # prompt log-probs of context + [spec token]: the row at len(context) is the distribution at j
        lp_params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=REFERENCE_TOP_K, ignore_eos=True,
                                   detokenize=False)
        jobs = [TokensPrompt(prompt_token_ids=c + [b]) for c, (_, b) in zip(contexts, pairs)]
        run = run_dsv4(model, jobs, lp_params, raw_outputs=True, max_logprobs=REFERENCE_TOP_K, **engine_kwargs)
        out = []
        for c, o in zip(contexts, run.raw):
            row = {t: v.logprob for t, v in o.prompt_logprobs[len(c)].items()}
            out.append({**row, None: max(row.values())})
        return out

    def continue_greedy(contexts, n_tokens):
        todo = [i for i, n in enumerate(n_tokens) if n > 0]
        out = [[] for _ in contexts]
        if todo:
            run = run_dsv4(model, [TokensPrompt(prompt_token_ids=contexts[i]) for i in todo],
                           [SamplingParams(temperature=0, max_tokens=n_tokens[i], ignore_eos=True) for i in todo],
                           **engine_kwargs)
            for i, o in zip(todo, run.outputs):
                out[i] = o
        return out

    def linear_control(idx):
        return run_dsv4(model, [TokensPrompt(prompt_token_ids=prompts[i]) for i in idx], params, LINEAR_CONTROL,
                        **engine_kwargs).outputs

    return GreedyOracle(reference, continue_greedy, NEAR_TIE_BF16, linear_control if control else None,
                        name="DeepSeek-V4 greedy oracle")


# ---------------------------------------------------------------------------
# Oracle drafter


class OracleTreeDrafter(TreeDrafter):
    """Random trees around the target's true greedy continuation (test drafter).

    shape:
        "chain"       the true continuation for a random length, then wrong tokens (partial acceptance)
        "random"      the true path of random length with 1-3 siblings per level (true child at a random
                      rank), plus wrong subtrees hung from random nodes until the budget is spent
        "two_branch"  two children of the root, each a chain; the true continuation is the second one
                      about half the time

    stops: {prompt: output indices}: the true path of a tree never reaches past one of these, so each of
    these tokens is chosen by a step's root row (where emulate_amx_flips acts), whatever the step boundaries.
    """

    def __init__(self, truth: dict[tuple[int, ...], list[int]], shape: str = "random", seed: int = 0,
                 vocab: int = 512, p_full: float = 0.5, stops: dict[tuple[int, ...], set[int]] | None = None):
        super().__init__()
        self.truth = truth
        self.shape = shape
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.p_full = p_full
        self.stops = stops or {}
        self._cap = 0  # the current tree's longest true path

    def _continuation(self, ctx: list[int]) -> list[int]:
        for prompt, out in self.truth.items():
            if len(ctx) >= len(prompt) and tuple(ctx[: len(prompt)]) == prompt:
                k = len(ctx) - len(prompt)  # the output index the root row chooses
                # accepting j true tokens makes the next root choose k + j + 1: stop at the next stop index
                self._cap = min((t - k - 1 for t in self.stops.get(prompt, ()) if t > k), default=len(out))
                return out[k:]
        raise KeyError(f"no known prompt is a prefix of a {len(ctx)}-token context")

    def _wrong(self, avoid: set[int]) -> int:
        while True:
            t = self.rng.randrange(LOW_TOKEN, self.vocab)
            if t not in avoid:
                return t

    def _propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[TreeProposal]:
        out = []
        for r, b in zip(requests, budgets):
            mode = deterministic_mode(r.temperature)
            if b == 0:
                out.append(TreeProposal.empty(mode))
                continue
            cont = self._continuation(list(r.token_ids))
            parents, tokens = getattr(self, f"_{self.shape}")(cont, b)
            out.append(TreeProposal(Tree(torch.tensor(parents, dtype=torch.long),
                                         torch.tensor(tokens, dtype=torch.long)), mode))
        return out

    def _true_len(self, cont, b):
        top = min(b, len(cont), self._cap)
        return top if self.rng.random() < self.p_full else self.rng.randint(0, top)

    def _chain(self, cont, b):
        n_true = self._true_len(cont, b)
        toks = list(cont[:n_true])
        while len(toks) < b:
            d = len(toks)
            toks.append(self._wrong({cont[d]} if d < len(cont) else set()))
        return [i - 1 for i in range(b)], toks

    def _two_branch(self, cont, b):
        n_true = self._true_len(cont, max(1, b // 2))
        true_first = self.rng.random() < 0.5
        a_len, c_len = (b + 1) // 2, b // 2
        true_chain = list(cont[:n_true])
        first_tok = cont[0] if cont else None
        wrong_chain = [self._wrong({first_tok} if first_tok is not None else set())]
        while len(wrong_chain) < max(a_len, c_len):
            wrong_chain.append(self._wrong(set()))
        while len(true_chain) < max(a_len, c_len):
            d = len(true_chain)
            true_chain.append(self._wrong({cont[d]} if d < len(cont) else set()))
        if n_true == 0:
            true_chain[0] = self._wrong({wrong_chain[0]} | ({first_tok} if first_tok is not None else set()))
        chains = [true_chain[:a_len], wrong_chain[:c_len]] if true_first else [wrong_chain[:a_len], true_chain[:c_len]]
        parents, tokens = [], []
        for chain in chains:
            for d, t in enumerate(chain):
                parents.append(-1 if d == 0 else len(parents) - 1)
                tokens.append(t)
        return parents, tokens

    def _random(self, cont, b):
        parents, tokens, depth = [], [], []
        children: dict[int, set[int]] = {-1: set()}

        def add(p, t):
            parents.append(p)
            tokens.append(t)
            depth.append(0 if p < 0 else depth[p] + 1)
            children[p].add(t)
            children[len(parents) - 1] = set()
            return len(parents) - 1

        n_true = self._true_len(cont, b)
        node = -1
        for d in range(n_true):
            if len(parents) >= b:
                break
            k = self.rng.randint(1, 3)
            rank = self.rng.randrange(k)
            true_node = None
            for j in range(k):
                if len(parents) >= b:
                    break
                if j == rank:
                    true_node = add(node, cont[d])
                else:
                    add(node, self._wrong(children[node] | {cont[d]}))
            if true_node is None:
                break
            node = true_node
        while len(parents) < b:  # wrong subtrees (deep ones too, so they complete blocks)
            p = self.rng.choice([-1] + list(range(len(parents))))
            avoid = set(children[p])
            on_path = p == -1 or (p < len(parents) and self._is_true_prefix(parents, tokens, p, cont))
            if on_path:
                d = 0 if p < 0 else depth[p] + 1
                if d < len(cont):
                    avoid.add(cont[d])
            add(p, self._wrong(avoid))
        return parents, tokens

    @staticmethod
    def _is_true_prefix(parents, tokens, node, cont) -> bool:
        path = []
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        path.reverse()
        return path == list(cont[: len(path)])


# ---------------------------------------------------------------------------
# Cache snapshots


def _positions_slots(block_table_row: torch.Tensor, block_size: int, positions: torch.Tensor) -> torch.Tensor:
    return block_table_row[positions // block_size].to(torch.long) * block_size + positions % block_size


def snapshot_request_caches(runner, req_index: int, length: int) -> dict[str, torch.Tensor]:
    """Every store of one request for a context of `length` tokens (rows 0 .. length-1), as raw values.

    SWA rows: the last `sliding_window` positions; compressor state rows: the last pooling window of each
    compressor; compressed entries and indexer keys: all complete ones. Keys name layer and store.
    """
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    from vllm_tree_spec.integration.dsv4 import layout

    ctx = runner.compilation_config.static_forward_context
    snap = {}
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        bt = runner.input_batch.block_table[gid].block_table.gpu[req_index]
        bs = group.kv_cache_spec.block_size
        for name in group.layer_names:
            layer = ctx[name]
            kv = layer.kv_cache
            if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                continue
            cls = type(layer).__name__
            if cls == "DeepseekV4SWACache":
                w = layer.window_size if hasattr(layer, "window_size") else 128
                pos = torch.arange(max(0, length - w), length)
                snap[name] = layout.read_rows(kv, _positions_slots(bt, bs, pos))
            elif isinstance(layer, CompressorStateCache):
                pos = torch.arange(max(0, length - layer.sliding_window), length)
                snap[name] = layout.read_rows(kv, _positions_slots(bt, bs, pos))
            else:
                ratio = layer.compress_ratio if isinstance(layer, DeepseekV4CPUAttention) else 4
                epb = bs // ratio
                w = torch.arange(length // ratio)
                snap[name] = layout.read_rows(kv, _positions_slots(bt, epb, w))
    return snap


# fp8 rows (vLLM 0.32 CPU layouts, vllm_tree_spec/integration/dsv4/layout.py), dequantized per quant block:
#   fp8_ds_mla (584 B: SWA window rows, C4 / C128 entries): 448 e4m3 values in 7 blocks of 64, each with a
#     UE8M0 scale byte (2^(byte - 127); the row's 8th scale byte is padding), then 64 bf16 RoPE values;
#   indexer keys (132 B): 128 e4m3 values and one fp32 scale.
E4M3_MANTISSA_BITS = 3
FP8_BLOCK = 64
ROW_STEP_TOL = 0.05  # fp8 rows: at most 5% of a row's values may be more than one code step apart (see below)
ROW_REL_TOL = 1e-2  # fp32 rows: max |a - b| <= 1e-2 * max(1, max |a|)


def _top_step(codes: torch.Tensor) -> torch.Tensor:
    """[..., k] values -> [...] one e4m3 code step at the block's largest magnitude (0 for an all-zero block)."""
    m = codes.abs().amax(-1)
    return torch.where(m > 0, torch.exp2(torch.floor(torch.log2(m.clamp(min=1e-300))) - E4M3_MANTISSA_BITS),
                       torch.zeros_like(m))


def dequantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, row bytes] uint8 -> (values [n, E] float64, quant block of each value [E] long, per block the
    dequantized size of one e4m3 code step at the top of the block [n, blocks] float64)."""
    n, width = rows.shape
    if width == 584:
        codes = rows[:, :448].contiguous().view(torch.float8_e4m3fn).to(torch.float64).view(n, 7, FP8_BLOCK)
        scale = torch.exp2(rows[:, 576:583].to(torch.float64) - 127)  # [n, 7]
        rope = rows[:, 448:576].contiguous().view(torch.bfloat16).to(torch.float64)  # [n, 64]
        values = torch.cat([(codes * scale[..., None]).view(n, 448), rope], dim=1)  # [n, 512]
        # the bf16 RoPE part (the 8th block) is held to the resolution of an e4m3 block of its magnitude
        units = torch.cat([_top_step(codes) * scale, _top_step(rope)[:, None]], dim=1)  # [n, 8]
        return values, torch.arange(512) // FP8_BLOCK, units
    if width == 132:
        codes = rows[:, :128].contiguous().view(torch.float8_e4m3fn).to(torch.float64)  # [n, 128]
        scale = rows[:, 128:].contiguous().view(torch.float32).to(torch.float64)  # [n, 1]
        return codes * scale, torch.zeros(128, dtype=torch.long), _top_step(codes)[:, None] * scale
    raise ValueError(f"uint8 cache rows of {width} bytes have no known DeepSeek-V4 layout (584 or 132 expected)")


def code_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, E] |a - b| of dequantized fp8 rows, in units of one e4m3 code step at the top of each value's
    quant block (the coarser of the two rows' grids).

    e4m3 has 3 mantissa bits: codes in [2^e, 2^(e+1)) are 2^(e-3) apart, so the top of a block has its
    coarsest step and every lower value a finer one. Rounding an input that moved by delta moves its code by
    at most one such unit unless |delta| reaches half a unit (>= 1/32 of the block's largest value): rows
    that differ only by rounding upstream of the quantizer (a different GEMM kernel, Intel AMX) are within
    one unit. A row of another token or position moves most values by many units.
    """
    va, blocks, ua = dequantize_rows(a)
    vb, _, ub = dequantize_rows(b)
    unit = torch.maximum(ua, ub)  # [n, blocks]
    unit = torch.where(unit > 0, unit, torch.ones_like(unit))  # both blocks all zero: any difference counts
    d = (va - vb).abs() / unit[:, blocks]
    return torch.nan_to_num(d, nan=float("inf"))  # a NaN code never matches


def compare_snapshots(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per store: the worst row's mismatch (fp8 stores: fraction of values more than one code step apart,
    `code_steps`; fp32 stores: relative max diff).

    Not bitwise: vLLM's CPU mHC op (hc_pre) is not batch-invariant (about 1% of rows differ in the last bit
    between a batch of 9 tokens and a batch of 1), and on Intel AMX every multi-row step (vLLM's own linear
    speculation too) rounds differently from a one-row decode step, so rows computed in a verify step can
    differ from sequential decoding by rounding: a flipped fp8 code is at most one step. A row from the
    wrong branch, or a stale one, differs by many steps in most values.
    """
    out = {}
    for k in a:
        x, y = a[k], b[k]
        if x.shape != y.shape:
            out[k] = float("inf")
        elif x.numel() == 0:
            out[k] = 0.0
        elif x.dtype == torch.uint8:
            out[k] = float((code_steps(x, y) > 1).double().mean(-1).max())
        else:
            scale = x.abs().amax(-1).clamp(min=1.0)
            out[k] = float(((x - y).abs().amax(-1) / scale).max())
    return out


def snapshot_mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Stores whose worst row is beyond the tolerances above."""
    return {k: v for k, v in compare_snapshots(a, b).items()
            if v > (ROW_STEP_TOL if a[k].dtype == torch.uint8 else ROW_REL_TOL)}


def snapshot_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------
# Recorders (on_llm callbacks for run_dsv4)


def record_base_snapshots(store: dict, snapshot=None):
    """on_llm: after every step of an engine without speculation, snapshot each request's caches
    (`snapshot(runner, req_index, length)`, default snapshot_request_caches: the CPU path's layout).

    Keys (request order index, L): L = tokens whose rows are in the cache (prompt + generated - 1).
    """

    def on_llm(llm):
        runner = worker_runner(llm)
        orig = runner._sample

        def _sample(logits, spec_decode_metadata):
            out = orig(logits, spec_decode_metadata)
            for i, rid in enumerate(runner.input_batch.req_ids):
                length = int(runner.input_batch.num_tokens_no_spec[i])
                store[(int(rid.split("-")[0]), length)] = (snapshot or snapshot_request_caches)(runner, i, length)
            return out

        runner._sample = _sample

    return on_llm


@dataclass
class TreeRecord:
    req: int  # request order index
    root_pos: int
    context: list[int]  # tokens 0 .. root (inclusive)
    parents: list[int]
    tokens: list[int]
    logprobs: torch.Tensor  # [1 + n, V] log-softmax of the tree step's rows (row 0 = root)
    accepted: list[int] = field(default_factory=list)


def row_starts(spec_meta) -> list[int]:
    """First logits row of each request in a speculative step (request-major, 1 + n_b rows each)."""
    starts = [0]
    for n in list(spec_meta.num_draft_tokens)[:-1]:
        starts.append(starts[-1] + n + 1)
    return starts


def record_tree_steps(records: list, snaps: dict | None = None):
    """on_llm: record every tree step's rows (log-probs) and, after each refresh, the request's caches."""

    def on_llm(llm):
        from vllm_tree_spec.integration import runner as runner_mod

        runner = worker_runner(llm)
        adapter = runner.tree_adapter
        real_tree_sample = runner_mod.tree_sample
        pending: dict[str, TreeRecord] = {}

        def tree_sample(rnr, logits, spec_meta, step):
            starts = row_starts(spec_meta)
            for r in step.requests:
                rows = logits[starts[r.req_index]: starts[r.req_index] + r.num_nodes + 1].float()
                ctx = rnr.input_batch.token_ids_cpu[r.req_index, : r.root_pos + 1].tolist()
                rec = TreeRecord(int(r.req_id.split("-")[0]), r.root_pos, ctx, r.tree.parents.tolist(),
                                 r.tree.tokens.tolist(), rows.log_softmax(-1))
                records.append(rec)
                pending[r.req_id] = rec
            return real_tree_sample(rnr, logits, spec_meta, step)

        orig_commit = adapter.commit

        def commit(rnr, reqs, paths):
            n = orig_commit(rnr, reqs, paths)
            for req, path in zip(reqs, paths):
                if req.req_id in pending:
                    pending.pop(req.req_id).accepted = list(path)
                if snaps is not None:
                    length = req.root_pos + 1 + len(path)
                    snaps[(int(req.req_id.split("-")[0]), length)] = \
                        snapshot_request_caches(rnr, req.req_index, length)
            return n

        runner_mod.tree_sample = tree_sample
        adapter.commit = commit
        llm._tree_spec_restore = lambda: setattr(runner_mod, "tree_sample", real_tree_sample)

    return on_llm


# ---------------------------------------------------------------------------
# AMX emulation (on_llm callback for run_dsv4)

AMX_FLIP = 1 / 64  # the largest margin measured to flip on Intel AMX (docs/testing.md)


def emulate_amx_flips(flips: list, max_flips_per_request: int = 1, margin: float = AMX_FLIP, flip: bool = True):
    """on_llm: make tree steps round near-ties the other way, as Intel AMX's multi-row bf16 GEMMs do.

    In every tree step, where the root row's argmax and runner-up are within `margin` the runner-up becomes
    the argmax (at most `max_flips_per_request` times per request). The root row's argmax is always the
    next token, so each flip changes the output at exactly that position (node rows, whose tokens count
    only where accepted, are left alone: a subset of what AMX flips, with an exact record). Records
    (request index, output index, argmax, runner-up, margin) in `flips`. With flip=False it only records
    every such near-tie (a survey: with stops at every output index, every token after the first is a root's).
    """

    def on_llm(llm):
        from vllm_tree_spec.integration import runner as runner_mod

        real_tree_sample = runner_mod.tree_sample
        done: dict[str, int] = {}

        def tree_sample(rnr, logits, spec_meta, step):
            starts = row_starts(spec_meta)
            for r in step.requests:
                if done.get(r.req_id, 0) >= max_flips_per_request:
                    continue
                row = starts[r.req_index]
                x = logits[row].float()  # [V]
                a = int(x.argmax())  # the token greedy picks (the lowest index among exact ties)
                v = float(x[a])
                x[a] = float("-inf")
                b = int(x.argmax())  # the runner-up
                gap = v - float(x[b])
                if gap > margin:
                    continue
                if flip:
                    logits[row, b] = v
                    logits[row, a] = v - max(abs(v), 1.0) * 2 ** -7  # at least one bf16 step below
                    done[r.req_id] = done.get(r.req_id, 0) + 1
                prompt_len = int(rnr.requests[r.req_id].num_prompt_tokens)
                flips.append((int(r.req_id.split("-")[0]), r.root_pos + 1 - prompt_len, a, b, gap))
            return real_tree_sample(rnr, logits, spec_meta, step)

        runner_mod.tree_sample = tree_sample
        llm._tree_spec_restore = lambda: setattr(runner_mod, "tree_sample", real_tree_sample)

    return on_llm
