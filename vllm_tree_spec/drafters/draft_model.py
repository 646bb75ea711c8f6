"""A small draft LM (same tokenizer as the target) that expands a draft tree per request.

p is the target's distribution, q the draft model's. Which rows get expanded
and which children are kept is the policy's business (`policy.py`, through
the builders in `build.py`); this module answers the builders' one question,
"q at these tree rows", cheaply:

* **Committed KV per request.** Each request owns a transformers
  `DynamicCache` holding exactly the tokens the drafter has seen, plus the
  logits after the last one (q at the root). A call extends it with the
  committed tokens it has not seen (in the usual flow: the accepted drafts
  and the bonus/correction token), in chunks with an explicit causal mask.
  If the cache holds tokens that are no longer the committed prefix (the
  target rejected what the drafter assumed, or the caller rewound), the cache
  is cropped to the common prefix first; at least the root is always re-fed,
  so its logits are fresh.
* **One forward per tree level.** A builder asks for q at all rows of one
  level (or one beam step) for all requests at once. Those rows' tokens go
  through the model in a single forward over a batch [B, n_max] with
  positions root_position + depth (RoPE sees true depths) and a 4-D additive
  mask: a node attends to its request's committed context and to its own
  ancestors' KV (appended by earlier levels), nothing else. Requests are
  batched by right-padding: request b's committed KV occupies columns
  [0, L_b) of a [B, H, L_max, D] copy, padding columns are masked out, and
  tree KV is appended after L_max.
* **Nothing of the tree survives.** With one request the tree KV is appended
  to the request's own cache and cropped back afterwards; with several the
  padded working copy is dropped. The committed caches only ever hold
  committed tokens.

Rows: row 0 is the root (the last committed token, position L - 1), row
i + 1 is draft node i (position L - 1 + depth(i)), as in tree.py.

Modes. Top-k trees (StaticPolicy, DynamicPolicy) rank the draft's q at
temperature 1 and are verified with the deterministic rule (GREEDY for T = 0
requests); their q is returned only if `return_draft_probs` is set, as a
diagnostic. Sampled trees (SampledPolicy) draw children from
q = softmax(logits / T) at the request's temperature with a per-request
generator and always return q: mode SAMPLED (i.i.d.) or
SAMPLED_WITHOUT_REPLACEMENT. A greedy request under a sampled policy gets
the same shape filled by rank instead (sampling at T = 0 is degenerate).
Without replacement, q is mixed with a 1e-6 uniform share so that c distinct
children exist even when softmax underflows at low temperature (q is
returned, so verification uses exactly that mixture).

Model requirements: a Hugging Face causal LM whose attention takes a custom
4-D float mask [B, 1, q_len, kv_len] and explicit `position_ids` (Llama,
Qwen2, Mistral without sliding windows; attn_implementation "eager" or
"sdpa", not flash-attention). The transformers Cache API is touched in two
helpers (`_crop`, `_stack_padded`), the only version-sensitive code here.

Nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from vllm_tree_spec import build
from vllm_tree_spec.drafters.base import (
    DraftRequest,
    DrafterError,
    TreeDrafter,
    TreeProposal,
    deterministic_mode,
)
from vllm_tree_spec.drafters.policy import DynamicPolicy, SampledPolicy, StaticPolicy, TreePolicy, parse_policy
from vllm_tree_spec.drafters.suffix import as_int_list
from vllm_tree_spec.sampling import GREEDY_TEMPERATURE
from vllm_tree_spec.verify import Mode

PREFILL_CHUNK = 512  # committed tokens per extension forward: bounds the [chunk, L] mask
TOPK_TEMPERATURE = 1.0  # top-k trees rank and score the raw draft distribution
WITHOUT_REPLACEMENT_FLOOR = 1e-6  # uniform share mixed into q for draws without replacement (see LevelSession)
UNSUPPORTED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of every layer of a DynamicCache.

    Per layer, so a forward that failed half-way (some layers appended, some
    not) is still undone exactly.
    """
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)  # a negative argument removes that many tokens


def _stack_padded(caches: Sequence[Any], lengths: Sequence[int]):
    """A batched DynamicCache [B, H, max(L), D] per layer; request b's KV in columns [0, L_b), zeros after."""
    from transformers import DynamicCache

    out = DynamicCache()
    l_max = max(lengths)
    for layer in range(len(caches[0].layers)):
        ref = caches[0].layers[layer].keys  # [1, H, L_0, D]
        keys = ref.new_zeros(len(caches), ref.shape[1], l_max, ref.shape[3])  # [B, H, L_max, D]
        values = torch.zeros_like(keys)
        for b, c in enumerate(caches):
            keys[b, :, : lengths[b]] = c.layers[layer].keys[0]
            values[b, :, : lengths[b]] = c.layers[layer].values[0]
        out.update(keys, values, layer)
    return out


def _request_seed(seed: int, req_id: Hashable) -> int:
    """A stable per-request seed (Python's hash() of a str changes between processes)."""
    digest = hashlib.sha256(f"{seed}:{req_id!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class _RequestState:
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in `cache`
    cache: Any = None  # DynamicCache, batch 1
    root_logits: torch.Tensor | None = None  # [V] logits after tokens[-1]
    generator: torch.Generator | None = None


@dataclass
class _Node:
    slot: int  # tree column (after L_max) holding the node's KV
    ancestors: list[int]  # tree columns of its proper ancestors


class LevelSession:
    """Base of a model drafter's `build.DraftFn` for one builder call: q at tree rows, one forward per call.

    Query b of a builder call is request b of `states` (each with `root_logits`, the logits at the
    root row); a query's path is the draft tokens from the root's child down to its row (() = the
    root row). Subclasses implement `_level(per_req)`: one forward over every queried non-root row,
    returning their logits [B, n_max, V'] (request b's rows in the order given).
    """

    def __init__(self, states: list[Any], temperatures: list[float], uniform_floor: float = 0.0):
        self.states = states
        self.temperatures = temperatures
        self.uniform_floor = uniform_floor

    def close(self) -> None:
        pass

    def _level(self, per_req: list[list[tuple[int, tuple[int, ...]]]]) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, queries: Sequence[build.DraftQuery]) -> torch.Tensor:
        per_req: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in self.states]
        roots = []  # (query index, request) of root rows: q from the logits kept by the last extension
        for qi, query in enumerate(queries):
            if query.path:
                per_req[query.request].append((qi, query.path))
            else:
                roots.append((qi, query.request))
        parts, order, req = [], [], []
        if roots:
            parts.append(torch.stack([self.states[b].root_logits for _, b in roots]))  # [n_root, V']
            order += [qi for qi, _ in roots]
            req += [b for _, b in roots]
        if any(per_req):
            logits = self._level(per_req)  # [B, n_max, V']
            bi = [b for b, rows in enumerate(per_req) for _ in rows]
            ji = [j for rows in per_req for j in range(len(rows))]
            parts.append(logits[bi, ji].to(parts[0].device if parts else logits.device))
            order += [qi for rows in per_req for qi, _ in rows]
            req += bi
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]  # [len(queries), V'] in `order`
        temps = torch.tensor([self.temperatures[b] for b in req], dtype=torch.float32, device=logits.device)
        q = torch.softmax(logits.float() / temps[:, None], dim=-1)
        if self.uniform_floor:
            # At low temperature softmax underflows to a handful of nonzero tokens, too few for c
            # distinct draws; a tiny uniform share keeps every token drawable. This mixture is the
            # q returned with the tree, so verification stays exact.
            q = (1 - self.uniform_floor) * q + self.uniform_floor / q.shape[-1]
        out = torch.empty_like(q)
        out[torch.tensor(order, device=q.device)] = q
        return out  # [len(queries), V']


class _TreeSession(LevelSession):
    """The draft model's session: per-request transformers caches, padded into one batch."""

    def __init__(
        self,
        drafter: "DraftModelTreeDrafter",
        states: list[_RequestState],
        temperatures: list[float],
        uniform_floor: float = 0.0,
    ):
        super().__init__(states, temperatures, uniform_floor)
        self.drafter = drafter
        self.lengths = [len(s.tokens) for s in states]
        self.l_max = max(self.lengths)
        # One request: extend its own cache and crop later (no copy); several: a padded working copy.
        self.own = len(states) == 1
        self.cache = states[0].cache if self.own else _stack_padded([s.cache for s in states], self.lengths)
        self.nodes: list[dict[tuple[int, ...], _Node]] = [{} for _ in states]
        self.num_slots = 0

    def close(self) -> None:
        if self.own:
            _crop(self.cache, self.lengths[0])
        self.cache = None

    def _level(self, per_req) -> torch.Tensor:
        """One forward over every queried row of this call -> logits [B, n_max, V]."""
        model, device = self.drafter.model, self.drafter.device
        batch, width = len(self.states), max(len(r) for r in per_req)
        kv_len = self.l_max + self.num_slots + width
        ids = torch.zeros(batch, width, dtype=torch.long)  # [B, n_max]
        pos = torch.zeros(batch, width, dtype=torch.long)  # [B, n_max]
        allowed = torch.zeros(batch, width, kv_len, dtype=torch.bool)  # [B, n_max, L_max + S + n_max]
        for b, rows in enumerate(per_req):
            root_pos = self.lengths[b] - 1
            for j in range(width):
                col = self.l_max + self.num_slots + j  # the column this query's own KV lands in
                if j >= len(rows):  # padding query: attends to one real column, its output is unused
                    pos[b, j] = root_pos
                    allowed[b, j, 0] = True
                    continue
                path = rows[j][1]
                parent = self.nodes[b].get(path[:-1]) if len(path) > 1 else None
                if len(path) > 1 and parent is None:
                    raise DrafterError(
                        f"tree row {path} was queried before its parent row {path[:-1]}; builders must expand "
                        f"a row only after its parent (one level per call)"
                    )
                ancestors = [] if parent is None else parent.ancestors + [parent.slot]
                ids[b, j] = path[-1]
                pos[b, j] = root_pos + len(path)  # positions = root position + depth
                allowed[b, j, : self.lengths[b]] = True
                allowed[b, j, [self.l_max + s for s in ancestors]] = True
                allowed[b, j, col] = True
                self.nodes[b][path] = _Node(self.num_slots + j, ancestors)
        dtype = self.drafter.dtype
        mask = torch.zeros(batch, 1, width, kv_len, dtype=dtype)  # [B, 1, n_max, kv] additive
        mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
        with torch.no_grad():
            logits = model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=pos.to(device),
                past_key_values=self.cache,
                use_cache=True,
            ).logits  # [B, n_max, V]
        self.num_slots += width
        return logits


class LevelTreeDrafter(TreeDrafter):
    """A model drafter whose trees come from a policy and one draft forward per tree level.

    Subclasses set `policy`, `return_draft_probs` and `vocab_size`, and provide
    `_prepare` (bring every request's committed draft state up to date, batched
    where they can; returns per-request states with a `generator`) and
    `_session` (a `LevelSession` over those states: it answers the builders' q queries, one
    forward per level, and the softmax / temperature / uniform floor are shared here). A drafter
    whose session answers over its own vocabulary (EAGLE's draft vocabulary) maps each built tree to
    target ids in `_to_target`.
    """

    policy: TreePolicy
    return_draft_probs: bool = False

    def _prepare(self, requests: list[DraftRequest]) -> list[Any]:
        raise NotImplementedError

    def _session(self, states: list[Any], temps: list[float], floor: float) -> LevelSession:
        raise NotImplementedError

    def _to_target(self, dt: build.DraftTree) -> build.DraftTree:
        """A tree built over the session's vocabulary -> target token ids (identity: the same vocabulary)."""
        return dt

    def networks(self) -> list[torch.nn.Module]:
        """The torch networks this drafter runs (the serving runner routes their CPU linears through
        vLLM's GEMM: integration/cpu_gemm.py). Empty until the model is loaded."""
        return []

    # -- drafting -------------------------------------------------------------

    def _plan(self, request: DraftRequest, budget: int) -> tuple[TreePolicy | None, Mode]:
        """The policy for this request's budget and temperature, and the proposal's mode."""
        policy = self.policy
        greedy = request.temperature <= GREEDY_TEMPERATURE
        if isinstance(policy, SampledPolicy):
            if greedy:
                policy = policy.as_static()
            else:
                mode = Mode.SAMPLED if policy.replacement else Mode.SAMPLED_WITHOUT_REPLACEMENT
                shrunk = policy.for_budget(budget)
                return (shrunk if shrunk.max_nodes else None), mode
        mode = deterministic_mode(request.temperature)
        shrunk = policy.for_budget(budget)
        return (shrunk if shrunk is not None and shrunk.max_nodes else None), mode

    def _propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[TreeProposal]:
        out: list[TreeProposal | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        modes: list[Mode] = []
        for i, (req, budget) in enumerate(zip(requests, budgets)):
            policy, mode = self._plan(req, budget)
            modes.append(mode)
            if policy is None:
                out[i] = TreeProposal.empty(mode)
            else:
                groups.setdefault((policy, mode.needs_draft_probs), []).append(i)
        # Only requests that draft feed their new committed tokens through the draft model: one that is not
        # speculated this step (budget 0, e.g. the shape policy's `none` plan) catches up when it next drafts,
        # in one forward over the gap, instead of paying a draft forward every step for nothing.
        drafting = sorted(i for idx in groups.values() for i in idx)
        prepared = dict(zip(drafting, self._prepare([requests[i] for i in drafting]))) if drafting else {}
        for (policy, sampled), idx in groups.items():
            states = [prepared[i] for i in idx]
            temps = [requests[i].temperature if sampled else TOPK_TEMPERATURE for i in idx]
            trees = [self._to_target(dt) for dt in self._build(policy, states, temps)]
            for i, dt in zip(idx, trees):
                q = dt.q if (sampled or self.return_draft_probs) else None
                out[i] = TreeProposal(dt.tree, modes[i], draft_probs=q, scores=dt.scores)
        return out  # type: ignore[return-value]

    def _build(self, policy: TreePolicy, states: list[Any], temps: list[float]) -> list[build.DraftTree]:
        floor = WITHOUT_REPLACEMENT_FLOOR if isinstance(policy, SampledPolicy) and not policy.replacement else 0.0
        session = self._session(states, temps, floor)
        prefixes = [()] * len(states)  # the session knows each request's context itself
        try:
            if isinstance(policy, StaticPolicy):
                return build.expand_static_batch(
                    session, list(policy.paths), prefixes, return_q=self.return_draft_probs
                )
            if isinstance(policy, DynamicPolicy):
                return build.build_dynamic_batch(session, policy.shape, prefixes, return_q=self.return_draft_probs)
            return build.sample_children_batch(
                session,
                list(policy.paths),
                prefixes,
                replacement=policy.replacement,
                generators=[s.generator for s in states],
            )
        finally:
            session.close()


class DraftModelTreeDrafter(LevelTreeDrafter):
    """Tree drafts from a small causal LM sharing the target's tokenizer.

    Args:
        model: a Hugging Face causal LM (see the module docstring for requirements).
        policy: the tree policy (or anything `parse_policy` accepts: a TreeShape /
            "s3_k2_d6" string for dynamic trees, a shape-only Tree or rank paths for static).
        device: where the model runs (default: the model's device).
        seed: base seed of the per-request generators (sampled policies).
        return_draft_probs: also return q for top-k trees (a diagnostic; verification
            of deterministic trees must not use it).
        prefill_chunk: committed tokens per extension forward.
        validate_proposals: see `TreeDrafter`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: TreePolicy | Any,
        *,
        device: torch.device | str | None = None,
        seed: int = 0,
        return_draft_probs: bool = False,
        prefill_chunk: int = PREFILL_CHUNK,
        validate_proposals: bool = True,
    ) -> None:
        super().__init__(validate_proposals=validate_proposals)
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl in UNSUPPORTED_ATTENTION:
            raise DrafterError(
                f"draft model uses attn_implementation={impl!r}, which ignores custom 4-D tree masks; "
                f"load it with attn_implementation='sdpa' or 'eager'"
            )
        if prefill_chunk < 1:
            raise DrafterError(f"prefill_chunk = {prefill_chunk} must be >= 1")
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.model = model.to(self.device).eval()
        self.dtype = param.dtype
        self.policy = parse_policy(policy)
        self.seed = seed
        self.return_draft_probs = return_draft_probs
        self.prefill_chunk = prefill_chunk
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.vocab_size = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        # Extensions need only the last position's logits; older/other models may lack the argument.
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._states: dict[Hashable, _RequestState] = {}

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        policy: TreePolicy | Any,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        **kwargs,
    ) -> "DraftModelTreeDrafter":
        """Load a draft model from a local directory (or anything `from_pretrained` resolves)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        return cls(model, policy, device=device, **kwargs)

    def networks(self) -> list[torch.nn.Module]:
        return [self.model]

    # -- lifecycle ------------------------------------------------------------

    def _start(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        # The prompt's KV is computed lazily by the first propose (start_request stays cheap).
        gen = torch.Generator(device=self.device)
        gen.manual_seed(_request_seed(self.seed, self.rng_key(req_id)))
        self._states[req_id] = _RequestState(cache=_new_cache(), generator=gen)

    def _finish(self, req_id: Hashable) -> None:
        del self._states[req_id]

    def cached_tokens(self, req_id: Hashable) -> list[int]:
        """The tokens whose KV the drafter holds for a request (for tests and debugging)."""
        return list(self._states[req_id].tokens)

    # -- committed context ----------------------------------------------------

    def _sync(self, state: _RequestState, tokens: list[int]) -> None:
        """Make state.cache hold exactly `tokens` and state.root_logits the logits after the last one."""
        old = state.tokens
        if len(old) <= len(tokens) and old == tokens[: len(old)]:
            common = len(old)
        else:
            common = next((i for i, (a, b) in enumerate(zip(old, tokens)) if a != b), min(len(old), len(tokens)))
        if common == len(old) == len(tokens) and state.root_logits is not None:
            return
        keep = min(common, len(tokens) - 1)  # always re-feed at least the root: its logits are q at row 0
        _crop(state.cache, keep)
        del state.tokens[keep:]
        state.root_logits = None
        try:
            for start in range(keep, len(tokens), self.prefill_chunk):
                chunk = tokens[start : start + self.prefill_chunk]
                state.root_logits = self._extend(state.cache, chunk, start)
                state.tokens.extend(chunk)
        except BaseException:
            _crop(state.cache, len(state.tokens))  # drop a half-done chunk: cache == tokens again
            state.root_logits = None
            raise

    def _extend(self, cache, chunk: list[int], start: int) -> torch.Tensor:
        """Append `chunk` at positions start.. to a batch-1 cache; returns the last position's logits [V]."""
        n = len(chunk)
        # Causal mask with offset: query i (position start + i) sees columns <= start + i.
        cols = torch.arange(start + n)
        allowed = cols[None, :] <= (start + torch.arange(n))[:, None]  # [n, start + n]
        mask = torch.zeros(1, 1, n, start + n, dtype=self.dtype)
        mask.masked_fill_(~allowed[None, None], torch.finfo(self.dtype).min)
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([chunk], device=self.device),
                attention_mask=mask.to(self.device),
                position_ids=torch.arange(start, start + n, device=self.device)[None],
                past_key_values=cache,
                use_cache=True,
                **({"logits_to_keep": 1} if self._logits_to_keep else {}),
            )
        return out.logits[0, -1]

    # -- drafting -------------------------------------------------------------

    def _prepare(self, requests: list[DraftRequest]) -> list[_RequestState]:
        states = [self._states[r.req_id] for r in requests]
        for st, req in zip(states, requests):
            self._sync(st, as_int_list(req.token_ids))
        return states

    def _session(self, states: list[_RequestState], temps: list[float], floor: float) -> "_TreeSession":
        return _TreeSession(self, states, temps, floor)
