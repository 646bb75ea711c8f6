"""EAGLE-3 tree drafter: the head vLLM's linear `eagle3` loads, expanded one tree level per forward.

p is the target's distribution, q the head's. The head (`eagle3_head.py`)
pairs each token with a feature: at committed position t its entry is
(token x_{t+1}, g_t = fc(target aux hidden states at t)), as in vLLM's EAGLE
proposer (input ids shifted by one, positions of the target rows). So with
n committed tokens x_0..x_{n-1} (the last one is the root, just sampled by
the target) the head holds entries t = 0..n-2, and the last entry's output
is q at the root row.

* **Committed head KV, one store.** Every request owns a slot (batch row) of
  one store per layer, keys/values [slots, H_kv, capacity, D]; its entries
  fill columns [0, length). Each step the runner hands over the target rows
  it committed (`observe_target`: prefill rows, or the root and the accepted
  path of a tree step) with the target's features at those rows. The next
  `propose` feeds the new entries of every request through the head in one
  forward, writing their KV into the slots in place (the LM head runs on the
  last entry only: q at the root). If the committed tokens no longer match
  the entries (the caller rewound), the length is cut to the common prefix.
* **Prefix-cache hits.** A request whose first N tokens hit vLLM's prefix cache gets target rows from
  N only; its entries 0..N-1 are restored from the content-keyed pages every request archives as it goes
  (`prefix_pages.py`). Entries no page holds are holes: masked out of the head's attention (`valid`).
* **One forward per tree level, all requests.** A node at depth d with token
  y is the entry (y, g' of its parent) at position n - 2 + d, where g' is the
  head's own pre-norm output (at the root: the last committed entry's). Tree
  node s of the step has its own column after the committed ones, and
  attends to its request's committed entries and its ancestors' columns
  only: each node keeps its ancestor set as a boolean row, so a level's
  mask is one gather. The dense store runs the forward on a view of its
  slots when they are consecutive (no KV copy at all), else on one gathered
  copy per step; the runner's paged store reads the committed entries in
  place (`integration/v2/draft_attention.py`).
* **Draft vocabulary.** q is computed over the head's draft vocabulary only
  (softmax, ranking and draws over V_draft); tree tokens are mapped to target
  ids through d2t, and q rows returned with a tree are scattered onto the
  target vocabulary (0 outside the draft vocabulary): the draft law, exactly.

Policies and verification modes are those of `draft_model.py`
(`LevelTreeDrafter`): static top-k shapes, dynamic EAGLE-2 reranking by
cumulative log q, sampled children with or without replacement (q returned).

Needs vLLM (the head's config parser and RoPE); the vLLM runner wiring that
makes the target return its auxiliary hidden states is
`integration/eagle3_aux.py`. EAGLE-1 heads run on the same machinery
(`eagle.py`, `eagle_head.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from vllm_tree_spec import build
from vllm_tree_spec.drafters.base import DraftRequest, DrafterError
from vllm_tree_spec.drafters.draft_model import (
    WITHOUT_REPLACEMENT_FLOOR,
    LevelSession,
    LevelTreeDrafter,
    _request_seed,
)
from vllm_tree_spec.drafters.eagle3_head import Eagle3Head, load_head, to_target_vocab
from vllm_tree_spec.drafters.head_kv import DenseHeadKV
from vllm_tree_spec.drafters.policy import TreePolicy, parse_policy
from vllm_tree_spec.drafters.prefix_pages import PrefixPages, PrefixStats, chain_keys, page_tokens_for
from vllm_tree_spec.drafters.suffix import as_int_list

__all__ = ["Eagle3TreeDrafter", "WITHOUT_REPLACEMENT_FLOOR"]

TREE_RESERVE = 16  # tree columns a session reserves up front (grown on demand)


class _Features:
    """One request's target features not yet fed to the head: [capacity, F] by position, plus flags."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.buf = torch.zeros(0, size, dtype=dtype, device=device)
        self.have = torch.zeros(0, dtype=torch.bool)

    def put(self, pos: torch.Tensor, feats: torch.Tensor) -> None:
        end = int(pos.max()) + 1
        if end > self.buf.shape[0]:
            cap = max(2 * self.buf.shape[0], end, 64)
            buf = self.buf.new_zeros(cap, self.buf.shape[1])
            buf[: self.buf.shape[0]] = self.buf
            have = torch.zeros(cap, dtype=torch.bool)
            have[: self.have.shape[0]] = self.have
            self.buf, self.have = buf, have
        self.buf[pos.to(self.buf.device)] = feats
        self.have[pos.cpu()] = True

    def first(self) -> int | None:
        """The first position with a feature (None: none held)."""
        idx = self.have.nonzero()
        return int(idx[0]) if len(idx) else None

    def take(self, first: int, count: int) -> torch.Tensor:
        """Features at positions first .. first + count - 1 [count, F]; drops them and everything before."""
        end = first + count
        if end > self.have.shape[0] or not bool(self.have[first:end].all()):
            have = self.have[first:end] if first < self.have.shape[0] else torch.zeros(0, dtype=torch.bool)
            missing = [first + j for j in range(count) if j >= have.shape[0] or not have[j]]
            raise DrafterError(
                f"EAGLE drafter: no target hidden states for positions {missing[:4]} (the target did not "
                f"compute them and no prefix-cache page covers them)")
        out = self.buf[first:end]
        self.have[:end] = False  # consumed (or stale)
        return out


@dataclass
class _RequestState:
    slot: int
    features: _Features
    length: int = 0  # committed entries in the head's KV (columns [0, length) of its slot)
    entry_tokens: list[int] = field(default_factory=list)  # entry t's token x_{t+1}, t < length
    root_logits: torch.Tensor | None = None  # [V_draft] output of the last entry (q at the root row)
    root_feature: torch.Tensor | None = None  # [H] its pre-norm output (g' for depth-1 nodes)
    generator: torch.Generator | None = None
    keys: list[bytes] = field(default_factory=list)  # prefix-page keys of pages 0.. (prefix_pages.chain_keys)
    archived: int = 0  # pages 0..archived-1 are archived (or holes of a prefix hit)
    tainted: bool = False  # holes feed into later entries (heads of > 1 layer): archive nothing more


class _TreeSession(LevelSession):
    """The head's session: every level of every request in one forward, tree KV after the committed KV.

    Tree node s of this step (in creation order) lives in column base + s of the store's keys for the session
    (`HeadCall`: after every committed column in a dense batch, after the unsaved roots in the paged store's
    own columns), with its ancestor set as a boolean row over tree columns (`anc`) and its g' (`feats`).
    """

    def __init__(self, drafter: "Eagle3TreeDrafter", states: list[_RequestState], temperatures: list[float],
                 uniform_floor: float = 0.0):
        super().__init__(states, temperatures, uniform_floor)
        self.drafter = drafter
        device = drafter.device
        self.lengths = torch.tensor([s.length for s in states], device=device)  # [B]
        self.slots = [s.slot for s in states]
        self.cap = TREE_RESERVE
        # the keys: every request's committed entries, then the tree's columns from `call.base` on (the roots'
        # entries of a drafter that does not persist them are the feed's: `persist_last`)
        self.call = drafter.store.session(self.slots, [s.length for s in states], self.cap,
                                          0 if drafter.persist_last else 1)
        batch = len(states)
        self.anc = torch.zeros(batch, self.cap, self.cap, dtype=torch.bool, device=device)  # [B, S, S]
        self.feats = torch.zeros(batch, self.cap, drafter.head.cfg.hidden, dtype=drafter.dtype, device=device)
        self.root_feats = torch.stack([s.root_feature for s in states])  # [B, H]
        self.nodes: list[dict[tuple[int, ...], int]] = [{} for _ in states]  # path -> tree slot
        self.num_slots = 0

    def close(self) -> None:
        self.call = self.anc = self.feats = None

    def _grow(self, slots: int) -> None:
        """Room for `slots` tree columns (rare: a tree wider than TREE_RESERVE)."""
        cap = max(2 * self.cap, slots)
        self.drafter.store.grow(self.call, self.slots, cap)
        anc = self.anc.new_zeros(len(self.states), cap, cap)
        anc[:, : self.cap, : self.cap] = self.anc
        feats = self.feats.new_zeros(len(self.states), cap, self.feats.shape[-1])
        feats[:, : self.cap] = self.feats
        self.anc, self.feats, self.cap = anc, feats, cap

    def _level(self, per_req) -> torch.Tensor:
        head, device = self.drafter.head, self.drafter.device
        batch, width = len(self.states), max(len(r) for r in per_req)
        s0 = self.num_slots
        if s0 + width > self.cap:
            self._grow(s0 + width)
        ids = [[0] * width for _ in range(batch)]
        parent = [[-1] * width for _ in range(batch)]  # tree slot of the parent, -1: the root
        depth = [[1] * width for _ in range(batch)]
        for b, rows in enumerate(per_req):
            nodes = self.nodes[b]
            for j, (_, path) in enumerate(rows):
                if len(path) > 1:
                    p = nodes.get(path[:-1])
                    if p is None:
                        raise DrafterError(f"tree row {path} was queried before its parent row {path[:-1]}; "
                                           f"builders must expand a row only after its parent (one level per call)")
                    parent[b][j] = p
                ids[b][j], depth[b][j] = path[-1], len(path)
                nodes[path] = s0 + j
        ids_t = self.drafter._target_ids[torch.tensor(ids, device=device)]  # [B, n] paths hold draft ids
        par = torch.tensor(parent, device=device)  # [B, n]
        pos = self.lengths[:, None] - 1 + torch.tensor(depth, device=device)  # root entry + depth  [B, n]
        bi = torch.arange(batch, device=device)[:, None]
        has_parent = par >= 0
        pc = par.clamp(min=0)
        g = torch.where(has_parent[..., None], self.feats[bi, pc], self.root_feats[:, None])  # [B, n, H]
        own = s0 + torch.arange(width, device=device)  # [n] tree slots of this level
        anc = self.anc[bi, pc] & has_parent[..., None]  # [B, n, S] the parent's ancestors and itself
        anc[:, torch.arange(width, device=device), own] = True
        self.anc[:, s0: s0 + width] = anc
        call = self.call
        mask = torch.cat([call.base_mask[:, None].expand(batch, width, call.base), anc[:, :, : s0 + width]], -1)
        with torch.no_grad():
            logits, g_next = head(ids_t, g, pos, mask, call.cache, (call.base + own).expand(batch, width))
        self.feats[:, s0: s0 + width] = g_next
        self.num_slots += width
        return logits  # [B, n, V_draft]


def target_embedding_layer(target_model) -> torch.nn.Module:
    """The target's input embedding module (vLLM's VocabParallelEmbedding in vLLM models)."""
    if hasattr(target_model, "get_input_embeddings"):
        return target_model.get_input_embeddings()
    return target_model.model.embed_tokens


def shared_table(layer: torch.nn.Module, who: str, what: str):
    """A function returning the target's full [V, H] table of `layer` (its embedding / LM head), called by
    the head's loader only if the checkpoint lacks the tensor. Under tensor parallelism it all-gathers the
    vocab-parallel shards (integration/tp_weights.py), a collective: vLLM loads the drafter on every rank
    and every rank reads the same checkpoint, so all ranks call it or none does."""
    def table() -> torch.Tensor:
        from vllm_tree_spec.integration.tp_weights import full_vocab_table

        return full_vocab_table(layer, who, what)

    return table


class Eagle3TreeDrafter(LevelTreeDrafter):
    """Tree drafts from an EAGLE-3 head fed by the target's auxiliary hidden states.

    Args:
        head: the loaded head (`eagle3_head.load_head`; the EAGLE-1 subclass in `eagle.py` takes an
            `eagle_head.EagleHead`), or None to load `path` in `load_model`.
        policy: the tree policy (anything `parse_policy` accepts).
        path: the head's checkpoint directory (when `head` is None).
        dtype, device: where the head runs.
        seed: base seed of the per-request generators (sampled policies).
        return_draft_probs, validate_proposals: see `DraftModelTreeDrafter` / `TreeDrafter`.
    """

    key = "eagle3"  # the config's drafter key
    reads_aux_hidden_states = True  # the runner turns on the target's aux outputs (integration/eagle3_aux.py)
    # Entry t pairs token x_{t + entry_shift} with the target's feature at position t (EAGLE: shifted by one).
    # A drafter without features (a draft model on the runner's pages: draft_model_paged.py) has entry t =
    # x_t; its last entry (the root, whose slot the runner may not have allocated yet) is fed every step and
    # written to the pages only once a later step has allocated it (`persist_last` False).
    entry_shift = 1
    reads_features = True
    persist_last = True
    feed_chunk: int | None = None  # entries per request per feed forward (None: all; the target chunks EAGLE's)

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
            self.set_head(head)
        self._states: dict[Hashable, _RequestState] = {}
        self._pages_cfg: tuple[int, Any] | None = None  # (page tokens, capacity in tokens or its getter)
        self._pages: PrefixPages | None = None
        # counts of restored / dropped / missing entries on prefix-cache hits (None: prefix caching off)
        self.prefix_stats: PrefixStats | None = None

    def set_head(self, head: Eagle3Head) -> None:
        """The head to draft with (a loaded `Eagle3Head`, or one with its interface: `integration/v2/draft_head.py`).
        A network the runner loaded is taken as it is: it shares modules with the target (embedding, LM head,
        vLLM's cached RoPE), which a dtype cast would change under the target."""
        self.head = (head if getattr(head, "loaded_by_runner", False) else head.to(self.device, self.dtype)).eval()
        self.vocab_size = head.cfg.vocab
        c = head.cfg
        self.store = DenseHeadKV(c.layers, c.kv_heads, c.head_dim, self.dtype, self.device)
        self._target_ids = head.target_ids

    def load_model(self, target_model=None) -> None:
        """Load the head (sharing the target's input embedding if the head has none)."""
        if self.head is not None:
            return
        emb = None
        if target_model is not None:
            emb = shared_table(target_embedding_layer(target_model), f"EAGLE-3 head {self.path}", "embedding")
        self.set_head(load_head(self.path, target_embedding=emb, dtype=self.dtype, device=self.device))

    def networks(self) -> list[torch.nn.Module]:
        return [] if self.head is None else [self.head]

    def enable_prefix_pages(self, block_size: int, capacity_tokens: int | Any) -> None:
        """Serve with vLLM's prefix caching: archive the head's committed KV by content (prefix_pages.py) and
        restore it on hits. capacity_tokens: the target cache's token capacity, or a function returning it
        (read at the first archive: vLLM sizes its cache after the drafter is built)."""
        self._pages_cfg = (page_tokens_for(block_size), capacity_tokens)
        self.prefix_stats = PrefixStats()

    def use_runner_kv(self, store) -> None:
        """Keep the head's committed KV in the runner's paged KV cache (`integration/v2/draft_kv.py`) instead of
        the dense store; prefix-cache hits are then found in the runner's blocks, not in an archive."""
        if self._states:
            raise RuntimeError("use_runner_kv: requests are already drafting from the dense store")
        store.stats = self.prefix_stats  # None: prefix caching off
        self.store = store
        self._pages_cfg = self._pages = None

    @property
    def state_in_runner_kv(self) -> bool:
        """The head's entries live in the request's blocks: a preempted request loses them with its blocks."""
        return self.store.paged

    def _prefix_pages(self) -> PrefixPages:
        if self._pages is None:
            page, cap = self._pages_cfg
            tokens = int(cap() if callable(cap) else cap)
            c = self.head.cfg
            self._pages = PrefixPages(c.layers, c.kv_heads, c.head_dim, self.dtype, page, tokens // page,
                                      pin=self.device.type == "cuda", stats=self.prefix_stats)
        return self._pages

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        """The target layers whose inputs the head reads (None: vLLM's default for the target)."""
        return self.head.cfg.aux_layer_ids

    # -- lifecycle ------------------------------------------------------------

    def _start(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(_request_seed(self.seed, self.rng_key(req_id)))
        feats = _Features(self.head.feature_size, self.dtype, self.device)
        self._states[req_id] = _RequestState(slot=self.store.acquire(req_id), features=feats, generator=gen)

    def _finish(self, req_id: Hashable) -> None:
        self.store.release(self._states.pop(req_id).slot)

    def cached_tokens(self, req_id: Hashable) -> list[int]:
        """Tokens x_1..x_L of the head's committed entries (for tests and debugging)."""
        return list(self._states[req_id].entry_tokens)

    # -- the target's features --------------------------------------------------

    def observe_target(self, req_ids: Sequence[Hashable], rows: Sequence[Sequence[int]], positions: torch.Tensor,
                       aux_hidden_states: Sequence[torch.Tensor] | torch.Tensor | None = None) -> None:
        """Target rows committed this step, per request (flattened row indices into `positions` / aux).

        aux_hidden_states: the target's features: for EAGLE-3 its auxiliary hidden states, a list of
        [T, H_t] (one per aux layer, as vLLM's runner returns them) or one [T, num_aux * H_t] tensor;
        for EAGLE-1 its last hidden state [T, H].
        """
        if aux_hidden_states is None:
            raise DrafterError(f"drafter {self.key!r} got no hidden states from the target; the runner must "
                               f"hand them over (integration/eagle3_aux.py)")
        aux = aux_hidden_states if isinstance(aux_hidden_states, torch.Tensor) else torch.cat(
            list(aux_hidden_states), dim=-1)  # [T, F]
        for rid, r in zip(req_ids, rows):
            st = self._states.get(rid)
            if st is None or not len(r):
                continue
            idx = torch.as_tensor(list(r), dtype=torch.long)
            st.features.put(positions[idx.to(positions.device)], aux[idx.to(aux.device)].to(self.device, self.dtype))

    # -- committed entries ------------------------------------------------------

    def _prepare(self, requests: list[DraftRequest]) -> list[_RequestState]:
        """Feed every request's new committed entries through the head in one forward (and one more per
        prefix-cache hit length in the batch)."""
        states = [self._states[r.req_id] for r in requests]
        self.store.begin_step()
        todo: list[tuple[_RequestState, int, list[int]]] = []  # (state, first entry, entry tokens)
        fed: list[tuple[_RequestState, list[int]]] = []  # (state, committed tokens) of every request in todo
        hits: dict[int, list[tuple[_RequestState, int, list[int]]]] = {}  # prefix-cache hits by their length
        for st, req in zip(states, requests):
            tokens = as_int_list(req.token_ids)
            want = tokens[self.entry_shift:]  # entry t's token x_{t+shift}
            old = st.entry_tokens
            common = next((i for i, (a, b) in enumerate(zip(old, want)) if a != b), min(len(old), len(want)))
            if common == len(old) == len(want) and st.root_logits is not None and self.persist_last:
                continue
            if not want:
                raise DrafterError(f"request {req.req_id!r}: EAGLE drafting needs >= 2 committed tokens")
            # re-feed at least the last entry (its output is q at the root), and every entry not in the pages
            persisted = st.length if self.persist_last else max(0, st.length - 1)
            keep = min(common, len(want) - 1, persisted)
            if keep < st.length:
                st.length = keep
                del st.entry_tokens[keep:]
                st.archived = min(st.archived, keep // self._page_size())
                del st.keys[st.archived:]
            first = st.features.first() if self._restores else None
            if first is not None and keep < first:  # the target began at `first`: a prefix-cache hit
                hits.setdefault(first, []).append((st, keep, tokens))
            else:
                todo.append((st, keep, want[keep:]))
                fed.append((st, tokens))
        self._feed_and_archive(todo, fed)
        # A hit may read pages that requests of this step write (vLLM serves blocks scheduled in the same step):
        # restore after they are fed, shortest hit first (a request writes pages only past its own hit).
        for first in sorted(hits):
            group = hits[first]
            for st, keep, tokens in group:
                self._restore(st, tokens, keep, first)
            self._feed_and_archive([(st, first, tokens[first + 1:]) for st, _, tokens in group],
                                   [(st, tokens) for st, _, tokens in group])
        return states

    def _feed_and_archive(self, todo: list[tuple[_RequestState, int, list[int]]],
                          fed: list[tuple[_RequestState, list[int]]]) -> None:
        chunk = self.feed_chunk
        if todo and chunk is None:
            self._feed(todo)
        elif todo:  # a drafter that computes whole prompts itself feeds them in chunks (they bound the mask),
            # aligned so that every request's last chunk is in the last forward: its batch, roots included,
            # is the one the tree levels reuse (PagedHeadKV.batch)
            rounds = max(-(-len(toks) // chunk) for _, _, toks in todo)
            for r in range(rounds):
                part = []
                for st, first, toks in todo:
                    end = len(toks) - (rounds - 1 - r) * chunk  # this request's entries up to `end` by round r
                    if end > 0:
                        start = max(0, end - chunk)
                        part.append((st, first + start, toks[start:end]))
                self._feed(part, final=[r == rounds - 1] * len(part))
        if self._restores:
            for st, tokens in fed:
                self._archive(st, tokens)

    @property
    def _restores(self) -> bool:
        """Prefix caching is on: hits are restored (from the archive, or vouched for in the runner's blocks).
        A drafter without the target's features computes every entry itself: nothing to restore."""
        if not self.reads_features:
            return False
        return self._pages_cfg is not None or (self.store.paged and self.prefix_stats is not None)

    def _page_size(self) -> int:
        if self.store.paged:
            return self.store.block_size or 1
        return self._pages_cfg[0] if self._pages_cfg is not None else 1

    def _restore(self, st: _RequestState, tokens: list[int], keep: int, first: int) -> None:
        """Entries keep..first-1, which the target did not compute (a prefix-cache hit), from the archive's
        pages (the runner's blocks, with a paged store); what no page holds becomes a hole (masked). The
        request's length becomes `first`."""
        if self.store.paged:
            size = self.store.block_size
            keys = st.keys[: keep // size]
            holes = self.store.restore(st.slot, tokens, keep, first, keys)
        else:
            size, keys, holes = self._restore_from_archive(st, tokens, keep, first)
        if holes:  # a hole reaches later entries' KV through a head's second layer
            st.tainted = st.tainted or self.head.cfg.layers > 1
        st.length = first
        st.entry_tokens[keep:] = tokens[keep + 1: first + 1]
        st.keys, st.archived = keys, -(-first // size)  # a page with holes is never archived

    def _restore_from_archive(self, st: _RequestState, tokens: list[int], keep: int,
                              first: int) -> tuple[int, list[bytes], int]:
        """The dense store's restore: entries keep..first-1 copied from the archive's pages, holes masked;
        returns (page size, the request's page keys, holes)."""
        pages, store = self._prefix_pages(), self.store
        size = pages.page
        stats = pages.stats
        stats.hits += 1
        j0, j1 = keep // size, first // size  # pages j0..j1-1 lie in the hit; entries past j1 * size: holes
        keys = st.keys[:j0]
        keys += chain_keys(tokens[: j1 * size], size, first=len(keys), prev=keys[-1] if keys else b"")
        found = []
        for key in keys[j0:]:
            got = pages.get(key)
            if got is None:
                break
            found.append(got)
        end = (j0 + len(found)) * size  # pages cover entries j0 * size .. end - 1
        restored = keep  # entries keep..restored-1 come from pages (those before keep are the request's own)
        store.reserve(first + TREE_RESERVE)
        if end > keep:
            # page by page onto the device: copies from pinned pages stay stream-ordered after their archiving
            kv = torch.stack([pg.to(self.device, non_blocking=True) for pg, _ in found])  # [m, layers, 2, H, P, D]
            kv = kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)[..., keep - j0 * size:, :]  # [layers, 2, H_kv, n, D]
            for layer, (k, v) in enumerate(store.layers):
                k[st.slot, :, keep:end] = kv[layer, 0]
                v[st.slot, :, keep:end] = kv[layer, 1]
            restored = end
        store.valid[st.slot, keep:first] = True
        # A page's last entry read the token after the page, which its key does not cover: where the writer's
        # differs from ours, that entry is dropped (a hole).
        dropped = [(j + 1) * size - 1 for j, (_, nxt) in enumerate(found, j0)
                   if (j + 1) * size - 1 >= keep and nxt != tokens[(j + 1) * size]]
        holes = len(dropped) + first - restored
        stats.restored += restored - keep - len(dropped)
        stats.dropped += len(dropped)
        stats.missing += first - restored
        if holes:
            store.valid[st.slot, dropped] = False
            store.valid[st.slot, restored:first] = False
            store.has_holes = True
        return size, keys, holes

    def _archive(self, st: _RequestState, tokens: list[int]) -> None:
        """Archive the pages this request completed (all entries computed, none a hole); with a paged store,
        record the blocks it completed."""
        if self.store.paged:
            if not st.tainted:
                st.archived = self.store.record(st.slot, tokens, st.length, st.keys, st.archived)
            return
        size = self._pages_cfg[0]
        full = st.length // size
        if st.tainted or full <= st.archived:
            return
        pages = self._prefix_pages()
        st.keys += chain_keys(tokens[: full * size], size, first=len(st.keys), prev=st.keys[-1] if st.keys else b"")
        for j in range(st.archived, full):
            cols = slice(j * size, (j + 1) * size)
            pages.put(st.keys[j], [(k[st.slot, :, cols], v[st.slot, :, cols]) for k, v in self.store.layers],
                      tokens[(j + 1) * size])
        st.archived = full

    def _feed(self, todo: list[tuple[_RequestState, int, list[int]]], final: list[bool] | None = None) -> None:
        """New entries of several requests: one forward, KV written into each request's slot. final: whether
        each request's entries end at its root (default: all do)."""
        head, device = self.head, self.device
        batch, width = len(todo), max(len(t) for _, _, t in todo)
        firsts = torch.tensor([first for _, first, _ in todo], device=device)  # [B]
        counts = [len(t) for _, _, t in todo]
        ids = torch.zeros(batch, width, dtype=torch.long)
        feats = torch.zeros(batch, width, head.feature_size, dtype=self.dtype, device=device)
        for b, (st, first, toks) in enumerate(todo):
            ids[b, : counts[b]] = torch.tensor(toks)
            if self.reads_features:
                feats[b, : counts[b]] = st.features.take(first, counts[b])
        positions = firsts[:, None] + torch.arange(width, device=device)  # [B, n] padding rows: scratch
        slots = [st.slot for st, _, _ in todo]
        call = self.store.feed(slots, [first for _, first, _ in todo], counts)
        last = torch.tensor(counts, device=device) - 1  # [B]
        with torch.no_grad():
            g = head.combine(feats) if self.reads_features else None
            logits, g_next = head(ids.to(device), g, positions, call.mask, call.cache, call.cols, rows=last)
        final = final or [True] * batch
        unsaved = [int(f and not self.persist_last) for f in final]  # the root waits for its slot (class comment)
        self.store.fed(call, slots, [(first, first + c - u) for (_, first, _), c, u in zip(todo, counts, unsaved)])
        for b, (st, first, toks) in enumerate(todo):
            st.length = first + counts[b]
            st.entry_tokens.extend(toks)
            st.root_logits, st.root_feature = logits[b], g_next[b]

    def _session(self, states: list[_RequestState], temps: list[float], floor: float) -> _TreeSession:
        return _TreeSession(self, states, temps, floor)

    def _to_target(self, dt: build.DraftTree) -> build.DraftTree:
        """Draft ids -> target ids (d2t); q rows scattered onto the target vocabulary (0 outside the draft's)."""
        ids = self._target_ids
        tree = dt.tree.with_tokens(ids[dt.tree.tokens.to(ids.device)].cpu())
        q = None if dt.q is None else to_target_vocab(dt.q, ids.to(dt.q.device), self.vocab_size, 0.0)
        return build.DraftTree(tree=tree, scores=dt.scores, sampling=dt.sampling, q=q)
