"""EAGLE-3 tree drafter: the head vLLM's linear `eagle3` loads, expanded one tree level per forward.

p is the target's distribution, q the head's. The head (`eagle3_head.py`)
pairs each token with a feature: at committed position t its entry is
(token x_{t+1}, g_t = fc(target aux hidden states at t)), as in vLLM's EAGLE
proposer (input ids shifted by one, positions of the target rows). So with
n committed tokens x_0..x_{n-1} (the last one is the root, just sampled by
the target) the head holds entries t = 0..n-2, and the last entry's output
is q at the root row.

* **Committed head KV per request.** Each step the runner hands over the
  target rows it committed (`observe_target`: prefill rows, or the root and
  the accepted path of a tree step) with the target's auxiliary hidden
  states at those rows. The next `propose` feeds the new entries of every
  request through the head in one batched forward (right-padded, causal
  among a request's new entries, each over its own committed KV) and appends
  their KV. If the committed tokens no longer match the entries (the caller
  rewound), the head's KV is cropped to the common prefix first.
* **One forward per tree level.** A node at depth d with token y is the
  entry (y, g' of its parent) at position n - 2 + d, where g' is the head's
  own pre-norm output (at the root: the last committed entry's). It attends
  to its request's committed head KV and its ancestors' tree KV only (an
  explicit boolean mask over [committed | tree columns]); requests are
  batched by right-padding, as in `draft_model.py`. Tree KV is dropped after
  the step; committed KV only ever holds committed entries.
* **Draft vocabulary.** q lives on the target vocabulary: draft ids map to
  target ids through d2t, and tokens outside the draft vocabulary get q = 0.

Policies and verification modes are those of `draft_model.py`
(`LevelTreeDrafter`): static top-k shapes, dynamic EAGLE-2 reranking by
cumulative log q, sampled children with or without replacement (q returned).

Needs vLLM (the head's config parser and RoPE); the vLLM runner wiring that
makes the target return its auxiliary hidden states is
`integration/eagle3_aux.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from vllm_tree_spec import build
from vllm_tree_spec.drafters.base import DraftRequest, DrafterError
from vllm_tree_spec.drafters.draft_model import WITHOUT_REPLACEMENT_FLOOR, LevelTreeDrafter, _request_seed
from vllm_tree_spec.drafters.eagle3_head import Eagle3Head, load_head
from vllm_tree_spec.drafters.policy import TreePolicy, parse_policy
from vllm_tree_spec.drafters.suffix import as_int_list

__all__ = ["Eagle3TreeDrafter", "WITHOUT_REPLACEMENT_FLOOR"]


class _KVBuffer:
    """One request's committed head KV per layer: [1, H_kv, capacity, D], grown by doubling."""

    def __init__(self):
        self.layers: list[list[torch.Tensor]] = []  # per layer [keys, values]
        self.length = 0

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in self.layers]

    def append(self, new: list[tuple[torch.Tensor, torch.Tensor]], row: int, count: int) -> None:
        """Append count entries of batch row `row` of `new` (per layer [B, H_kv, n, D])."""
        end = self.length + count
        for i, (k, v) in enumerate(new):
            if i == len(self.layers):
                shape = (1, k.shape[1], max(64, 2 * end), k.shape[3])
                self.layers.append([k.new_empty(shape), v.new_empty(shape)])
            buf = self.layers[i]
            if buf[0].shape[2] < end:
                grow = max(2 * buf[0].shape[2], end)
                for j in range(2):
                    bigger = buf[j].new_empty(1, buf[j].shape[1], grow, buf[j].shape[3])
                    bigger[:, :, : self.length] = buf[j][:, :, : self.length]
                    buf[j] = bigger
            buf[0][:, :, self.length: end] = k[row: row + 1, :, :count]
            buf[1][:, :, self.length: end] = v[row: row + 1, :, :count]
        self.length = end


@dataclass
class _RequestState:
    entry_tokens: list[int] = field(default_factory=list)  # entry t's token x_{t+1}, t < kv.length
    kv: _KVBuffer = field(default_factory=_KVBuffer)
    root_logits: torch.Tensor | None = None  # [V_draft] output of the last entry (q at the root row)
    root_feature: torch.Tensor | None = None  # [H] its pre-norm output (g' for depth-1 nodes)
    aux: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [num_aux * H_t] not yet fed
    generator: torch.Generator | None = None


@dataclass
class _Node:
    slot: int  # tree column holding the node's KV
    ancestors: list[int]  # tree columns of its proper ancestors
    feature: torch.Tensor  # [H] the node's pre-norm output: g' for its children


def _stack(states: list[_RequestState]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Committed KV of several requests as one right-padded batch per layer [B, H_kv, L_max, D]."""
    if len(states) == 1:
        return states[0].kv.view() if states[0].kv.length else None
    l_max = max(s.kv.length for s in states)
    if l_max == 0:
        return None
    ref = next(s for s in states if s.kv.length).kv.layers
    out = []
    for i in range(len(ref)):
        k = ref[i][0].new_zeros(len(states), ref[i][0].shape[1], l_max, ref[i][0].shape[3])
        v = torch.zeros_like(k)
        for b, s in enumerate(states):
            if s.kv.length:
                k[b, :, : s.kv.length] = s.kv.layers[i][0][0, :, : s.kv.length]
                v[b, :, : s.kv.length] = s.kv.layers[i][1][0, :, : s.kv.length]
        out.append((k, v))
    return out


class _TreeSession:
    """The `build.DraftFn` for one builder call: q at tree rows, one head forward per call."""

    def __init__(self, drafter: "Eagle3TreeDrafter", states: list[_RequestState], temperatures: list[float],
                 uniform_floor: float = 0.0):
        self.drafter = drafter
        self.states = states
        self.temperatures = temperatures
        self.uniform_floor = uniform_floor
        self.lengths = [s.kv.length for s in states]
        self.l_max = max(self.lengths)
        self.past = _stack(states)  # committed, per layer [B, H_kv, L_max, D]
        self.tree_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [B, H_kv, S, D]
        self.nodes: list[dict[tuple[int, ...], _Node]] = [{} for _ in states]
        self.num_slots = 0

    def close(self) -> None:
        self.past = self.tree_kv = None

    def _q(self, draft_logits: torch.Tensor, b: int) -> torch.Tensor:
        logits = self.drafter.head.target_logits(draft_logits.float())  # [V]
        q = torch.softmax(logits / self.temperatures[b], dim=-1)
        if self.uniform_floor:
            # as in draft_model: every token stays drawable without replacement; this mixture is the q returned
            q = (1 - self.uniform_floor) * q + self.uniform_floor / q.shape[-1]
        return q

    def __call__(self, queries: Sequence[build.DraftQuery]) -> torch.Tensor:
        out: list[torch.Tensor | None] = [None] * len(queries)
        per_req: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in self.states]
        for qi, query in enumerate(queries):
            if query.path:
                per_req[query.request].append((qi, query.path))
            else:
                out[qi] = self._q(self.states[query.request].root_logits, query.request)
        if any(per_req):
            self._level(per_req, out)
        return torch.stack(out)  # [len(queries), V]

    def _level(self, per_req, out) -> None:
        head, device = self.drafter.head, self.drafter.device
        batch, width = len(self.states), max(len(r) for r in per_req)
        kv_len = self.l_max + self.num_slots + width
        hidden = head.cfg.hidden
        ids = torch.zeros(batch, width, dtype=torch.long)  # [B, n_max]
        pos = torch.zeros(batch, width, dtype=torch.long)  # [B, n_max]
        feats = torch.zeros(batch, width, hidden, dtype=self.drafter.dtype, device=device)  # [B, n_max, H]
        allowed = torch.zeros(batch, width, kv_len, dtype=torch.bool)  # [B, n_max, L_max + S + n_max]
        for b, rows in enumerate(per_req):
            root_pos = self.lengths[b] - 1  # the last committed entry's position (n - 2)
            for j in range(width):
                col = self.l_max + self.num_slots + j
                if j >= len(rows):  # padding query: attends to itself only, output unused
                    pos[b, j] = max(root_pos, 0)
                    allowed[b, j, col] = True
                    continue
                path = rows[j][1]
                parent = self.nodes[b].get(path[:-1]) if len(path) > 1 else None
                if len(path) > 1 and parent is None:
                    raise DrafterError(f"tree row {path} was queried before its parent row {path[:-1]}; builders "
                                       f"must expand a row only after its parent (one level per call)")
                ancestors = [] if parent is None else parent.ancestors + [parent.slot]
                ids[b, j] = path[-1]
                pos[b, j] = root_pos + len(path)  # positions = root entry + depth
                feats[b, j] = self.states[b].root_feature if parent is None else parent.feature
                allowed[b, j, : self.lengths[b]] = True
                allowed[b, j, [self.l_max + s for s in ancestors]] = True
                allowed[b, j, col] = True
                self.nodes[b][path] = _Node(self.num_slots + j, ancestors, None)  # feature set below
        past = self.past
        if self.tree_kv is not None:
            past = [(torch.cat([p[0], t[0]], 2), torch.cat([p[1], t[1]], 2)) for p, t in zip(past, self.tree_kv)] \
                if past is not None else self.tree_kv
        if past is None:  # no committed KV at all (only possible for a request with a 1-token context)
            allowed = allowed[:, :, self.l_max:]
        with torch.no_grad():
            logits, g_next, new = head(ids.to(device), feats, pos.to(device), past, allowed.to(device))
        self.tree_kv = new if self.tree_kv is None else [
            (torch.cat([t[0], n[0]], 2), torch.cat([t[1], n[1]], 2)) for t, n in zip(self.tree_kv, new)]
        self.num_slots += width
        for b, rows in enumerate(per_req):
            for j, (qi, path) in enumerate(rows):
                self.nodes[b][path].feature = g_next[b, j]
                out[qi] = self._q(logits[b, j], b)


class Eagle3TreeDrafter(LevelTreeDrafter):
    """Tree drafts from an EAGLE-3 head fed by the target's auxiliary hidden states.

    Args:
        head: the loaded head (`eagle3_head.load_head`), or None to load `path` in `load_model`.
        policy: the tree policy (anything `parse_policy` accepts).
        path: the head's checkpoint directory (when `head` is None).
        dtype, device: where the head runs.
        seed: base seed of the per-request generators (sampled policies).
        return_draft_probs, validate_proposals: see `DraftModelTreeDrafter` / `TreeDrafter`.
    """

    reads_aux_hidden_states = True  # the runner turns on the target's aux outputs (integration/eagle3_aux.py)

    def __init__(self, head: Eagle3Head | None, policy: TreePolicy | Any, *, path: str | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0,
                 return_draft_probs: bool = False, validate_proposals: bool = True) -> None:
        super().__init__(validate_proposals=validate_proposals)
        if head is None and path is None:
            raise DrafterError("Eagle3TreeDrafter needs a head or the path of its checkpoint")
        self.path = path
        self.dtype = dtype
        self.device = torch.device(device)
        self.policy = parse_policy(policy)
        self.seed = seed
        self.return_draft_probs = return_draft_probs
        self.head: Eagle3Head | None = None
        if head is not None:
            self._set_head(head)
        self._states: dict[Hashable, _RequestState] = {}

    def _set_head(self, head: Eagle3Head) -> None:
        self.head = head.to(self.device, self.dtype).eval()
        self.vocab_size = head.cfg.vocab

    def load_model(self, target_model=None) -> None:
        """Load the head (sharing the target's input embedding if the head has none)."""
        if self.head is not None:
            return
        emb = None
        if target_model is not None and hasattr(target_model, "get_input_embeddings"):
            emb = target_model.get_input_embeddings().weight
        elif target_model is not None:
            emb = target_model.model.embed_tokens.weight
        self._set_head(load_head(self.path, target_embedding=emb, dtype=self.dtype, device=self.device))

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        """The target layers whose inputs the head reads (None: vLLM's default for the target)."""
        return self.head.cfg.aux_layer_ids

    # -- lifecycle ------------------------------------------------------------

    def _start(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(_request_seed(self.seed, req_id))
        self._states[req_id] = _RequestState(generator=gen)

    def _finish(self, req_id: Hashable) -> None:
        del self._states[req_id]

    def cached_tokens(self, req_id: Hashable) -> list[int]:
        """Tokens x_1..x_L of the head's committed entries (for tests and debugging)."""
        return list(self._states[req_id].entry_tokens)

    # -- the target's features --------------------------------------------------

    def observe_target(self, req_ids: Sequence[Hashable], rows: Sequence[Sequence[int]], positions: torch.Tensor,
                       aux_hidden_states: Sequence[torch.Tensor] | torch.Tensor | None = None) -> None:
        """Target rows committed this step, per request (flattened row indices into `positions` / aux).

        aux_hidden_states: the target's auxiliary hidden states, a list of [T, H_t] (one per aux layer, as
        vLLM's runner returns them) or one [T, num_aux * H_t] tensor.
        """
        if aux_hidden_states is None:
            raise DrafterError("drafter 'eagle3' got no auxiliary hidden states from the target; the runner must "
                               "enable them (integration/eagle3_aux.py)")
        aux = aux_hidden_states if isinstance(aux_hidden_states, torch.Tensor) else torch.cat(
            list(aux_hidden_states), dim=-1)  # [T, num_aux * H_t]
        for rid, r in zip(req_ids, rows):
            st = self._states.get(rid)
            if st is None or not len(r):
                continue
            idx = torch.as_tensor(list(r), dtype=torch.long)
            pos = positions[idx.to(positions.device)].tolist()
            feats = aux[idx.to(aux.device)].to(self.device, self.dtype)
            for p, f in zip(pos, feats):
                st.aux[int(p)] = f

    # -- committed entries ------------------------------------------------------

    def _prepare(self, requests: list[DraftRequest]) -> list[_RequestState]:
        """Feed every request's new committed entries through the head in one forward."""
        states = [self._states[r.req_id] for r in requests]
        todo: list[tuple[_RequestState, int, list[int]]] = []  # (state, first entry, entry tokens)
        for st, req in zip(states, requests):
            tokens = as_int_list(req.token_ids)
            want = tokens[1:]  # entry t's token x_{t+1}, t = 0..n-2
            old = st.entry_tokens
            common = next((i for i, (a, b) in enumerate(zip(old, want)) if a != b), min(len(old), len(want)))
            if common == len(old) == len(want) and st.root_logits is not None:
                continue
            keep = min(common, len(want) - 1)  # re-feed at least the last entry: its output is q at the root
            if keep < st.kv.length:
                st.kv.length = keep
                del st.entry_tokens[keep:]
            if not want:
                raise DrafterError(f"request {req.req_id!r}: EAGLE-3 drafting needs >= 2 committed tokens")
            todo.append((st, keep, want[keep:]))
        if todo:
            self._feed(todo)
        return states

    def _feed(self, todo: list[tuple[_RequestState, int, list[int]]]) -> None:
        head, device = self.head, self.device
        batch = len(todo)
        width = max(len(t) for _, _, t in todo)
        group = [st for st, _, _ in todo]
        lengths = [st.kv.length for st in group]
        l_max = max(lengths)
        ids = torch.zeros(batch, width, dtype=torch.long)
        pos = torch.zeros(batch, width, dtype=torch.long)
        aux = torch.zeros(batch, width, head.fc.in_features, dtype=self.dtype, device=device)
        allowed = torch.zeros(batch, width, l_max + width, dtype=torch.bool)
        for b, (st, first, toks) in enumerate(todo):
            missing = [first + j for j in range(len(toks)) if first + j not in st.aux]
            if missing:
                raise DrafterError(
                    f"EAGLE-3 drafter: no target hidden states for positions {missing[:4]} (the target did not "
                    f"compute them, e.g. prefix-cached blocks); serve drafter 'eagle3' without prefix caching")
            m = len(toks)
            ids[b, :m] = torch.tensor(toks)
            pos[b, :m] = torch.arange(first, first + m)
            aux[b, :m] = torch.stack([st.aux[first + j] for j in range(m)])
            allowed[b, :m, : lengths[b]] = True
            causal = torch.tril(torch.ones(m, m, dtype=torch.bool))
            allowed[b, :m, l_max: l_max + m] = causal
            for j in range(m, width):  # padding rows see themselves only
                allowed[b, j, l_max + j] = True
        past = _stack(group)
        if past is None:
            allowed = allowed[:, :, l_max:]
        with torch.no_grad():
            logits, g_next, new = head(ids.to(device), head.combine(aux), pos.to(device), past,
                                       allowed.to(device))
        for b, (st, first, toks) in enumerate(todo):
            m = len(toks)
            st.kv.append(new, b, m)
            st.entry_tokens.extend(toks)
            st.root_logits, st.root_feature = logits[b, m - 1], g_next[b, m - 1]
            for p in [p for p in st.aux if p < first + m]:  # consumed (or stale) features
                del st.aux[p]

    def _session(self, states: list[_RequestState], temps: list[float], floor: float) -> _TreeSession:
        return _TreeSession(self, states, temps, floor)
