"""The batch verifier: B requests with different trees, vectorised over nodes and requests.

`verify_batch` gives the reference walk's outputs (`reference_walk.py`) token for token given the
same coins. Python loops run only over sibling rank in the sampled modes and over depth in the
deterministic mode, whose draws are made only where the walk goes. On CPU an all-greedy batch is
walked on host lists instead (`verify_greedy_host`, the same outputs): there a handful of small
tensor ops per step is the whole cost.

On accelerators (`sync_free`) the serving path avoids data-dependent host syncs: metadata goes up
in one transfer (`upload`), the deterministic walk draws at every depth and the sampled rules
update every row with `torch.where`, with the same outputs bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_tree_spec.tree import NO_NODE, PAD_TOKEN_ID, TreeBatch
from vllm_tree_spec.verify.coins import VerifyCoins, race
from vllm_tree_spec.verify.rules import Mode, _truncate, residual, row_sum


@dataclass
class TreeVerifyOutput:
    """Result of `verify_batch`, in vLLM's chain contract where it applies.

    Attributes:
        accepted_nodes: [B, D] int64 local node indices of the accepted path, NO_NODE-padded.
        num_accepted: [B] int64 accepted draft nodes (after EOS / max_tokens cuts).
        next_token: [B] int64 recovered or bonus token (the last emitted token).
        output_token_ids: [B, D + 1] int64 accepted tokens then next_token, -1 padded
            (the layout of vLLM's `sampled_token_ids`).
        walked: [B] int64 accepted nodes before the EOS / max_tokens cuts (the depth the walk
            stopped at: a deterministic walk read walked + 1 exponential rows), or None.
    """

    accepted_nodes: torch.Tensor  # [B, D]
    num_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B]
    output_token_ids: torch.Tensor  # [B, D + 1]
    walked: torch.Tensor | None = None  # [B]

    def accepted(self, b: int) -> list[int]:
        return self.accepted_nodes[b, : int(self.num_accepted[b])].tolist()


def _as_modes(modes, batch_size: int) -> torch.Tensor:
    if isinstance(modes, (str, Mode, int)):
        modes = [modes] * batch_size
    if isinstance(modes, torch.Tensor):
        return modes.to(torch.long).cpu()
    return torch.tensor([int(Mode.parse(m)) for m in modes], dtype=torch.long)


def sync_free(device) -> bool:
    """Whether the serving path avoids data-dependent host syncs on this device: on accelerators,
    where a sync stalls the queue. On CPU a sync costs nothing and compacting saves work."""
    return torch.device(device).type != "cpu"


def upload(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """Host int64 tensors -> the device in one transfer (views of one packed buffer; CPU: no copy)."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]) if tensors else torch.zeros(0)
    dev = flat.to(device, non_blocking=True)
    out, o = [], 0
    for t in tensors:
        out.append(dev[o: o + t.numel()].view(t.shape).to(t.dtype))
        o += t.numel()
    return out


def verify_batch(
    batch: TreeBatch,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    modes,
    coins: VerifyCoins | None = None,
    *,
    eos_token_id: torch.Tensor | None = None,
    max_tokens: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
    sync_free: bool = False,
    host_greedy: bool = True,
) -> TreeVerifyOutput:
    """Verify B trees at once.

    Args:
        batch: the B trees (with tokens).
        target_probs: [R, V] p per row, R = sum(N_b + 1), request-major, root row
            first (`batch.cu_num_rows`).
        draft_probs: [R, V] or None; required if any request uses a sampled mode.
        modes: one mode for all, or [B] modes (names, `Mode`s or an int tensor).
        coins: `VerifyCoins` with at least [B, D + 1, K] / [B, D + 1, V]; drawn
            from the default RNG when None (not needed if all requests are greedy).
        eos_token_id: [B] int64, -1 = none; or [B, S] stop ids per request (EOS and stop_token_ids),
            -1 padded: the round ends at the first emitted one.
        max_tokens: [B] int64 remaining token budget (>= 1), or None; checked where it is on the host.
        target_argmax: [R] int64 argmax of p per row; when every request is greedy it may stand
            in for target_probs (pass None there): greedy verification reads nothing else.
        sync_free: no data-dependent host synchronisation (device tensors): the deterministic walk
            draws at every depth for every deterministic request (lazy coins: pass host-side
            streams and `rewind` them afterwards with `walked + 1`), and the sampled modes update
            every row with `torch.where` instead of compacting the rejecting rows. Same outputs
            bit for bit given the same coins; more work on the device, no round trips.
        host_greedy: on CPU, when every request is greedy and sync_free is off, walk the trees on
            host lists (`verify_greedy_host`: the same outputs, a few microseconds per request instead
            of ~60 tensor ops per step). False: the tensor walk (the tests compare the two).
    """
    modes = _as_modes(modes, batch.batch_size)  # host
    present = set(modes.tolist())
    if target_probs is None and (target_argmax is None or present - {int(Mode.GREEDY)}):
        raise ValueError("target_probs is required unless every request is greedy and target_argmax is given")
    device = (target_probs if target_probs is not None else target_argmax).device
    if host_greedy and present <= {int(Mode.GREEDY)} and device.type == "cpu" and not sync_free:
        y = target_argmax if target_argmax is not None else target_probs.argmax(-1)
        return verify_greedy_host(batch, y, eos_token_id=eos_token_id, max_tokens=max_tokens)
    B, M = batch.batch_size, batch.max_nodes
    V = target_probs.shape[1] if target_probs is not None else 0
    D = batch.max_depth
    if any(Mode(m).needs_draft_probs for m in present) and draft_probs is None:
        raise ValueError("draft_probs is required when a request uses a sampled mode")
    if coins is None and present != {int(Mode.GREEDY)}:
        coins = VerifyCoins.draw(B, D, batch.max_children, V, dtype=target_probs.dtype, device=device, lazy=True)
    if max_tokens is not None and isinstance(max_tokens, torch.Tensor) and max_tokens.device.type != "cpu":
        mt_host = None if sync_free else max_tokens.cpu()  # sync_free: the caller guarantees >= 1
    else:
        mt_host = None if max_tokens is None else torch.as_tensor(max_tokens, dtype=torch.long).expand(B)
    if mt_host is not None and bool((mt_host < 1).any()):
        raise ValueError("max_tokens must be >= 1 for every request")

    # Per-node metadata, flattened over requests ([T] = all draft nodes), built on the host and
    # moved in one transfer.
    T, R = int(batch.cu_num_nodes[-1]), int(batch.cu_num_rows[-1])
    node_req = torch.repeat_interleave(torch.arange(B), batch.num_nodes)  # [T]
    node_local = torch.arange(T) - batch.cu_num_nodes[:-1].repeat_interleave(batch.num_nodes)  # [T]
    row_base_h = batch.cu_num_rows[:-1]  # [B] global row of each root
    node_row_h = row_base_h[node_req] + node_local + 1  # [T]
    row_depth_h = torch.zeros(R, dtype=torch.long)
    row_depth_h[node_row_h] = batch.depth  # [R], root rows 0
    sib_rank_h = torch.cat([t.sibling_rank for t in batch.trees]) if batch.trees else torch.zeros(0, dtype=torch.long)
    host = [node_req, node_local, row_base_h, node_row_h, row_base_h[node_req] + batch.parents + 1, batch.tokens,
            row_depth_h, torch.repeat_interleave(torch.arange(B), batch.num_nodes + 1), sib_rank_h, modes,
            batch.padded_tokens, batch.padded_depth, batch.valid, batch.dense_mask]
    (node_req, node_local, row_base, node_row, parent_row, tokens, row_depth, row_req, sib_rank, modes_d,
     padded_tokens, depth_pad, valid, mask) = upload(host, device)
    node_mode = modes_d[node_req]  # [T]

    # taken[t]: node t is the child that its parent row's step picks (entry T: a sink for "no child").
    taken = torch.zeros(T + 1, dtype=torch.bool, device=device)  # [T + 1]
    y_row = torch.zeros(R, dtype=torch.long, device=device)  # [R] greedy / deterministic draw per row
    p_final = None
    # child_node[r, j]: global node index of the j-th child of row r (-1 = none).
    K = max(1, batch.max_children)
    child_node = torch.full((R, K), NO_NODE, dtype=torch.long, device=device)
    child_node[parent_row, sib_rank] = torch.arange(T, device=device)

    if int(Mode.GREEDY) in present:
        y_row = (target_argmax.to(device) if target_argmax is not None else target_probs.argmax(-1)).clone()  # [R]
        match = tokens == y_row[parent_row]  # [T]
        # Among matching siblings only the first counts (duplicates are legal in greedy mode).
        big = torch.full_like(sib_rank, 1 << 30)
        first = torch.full((R,), 1 << 30, dtype=torch.long, device=device)
        first = first.scatter_reduce(0, parent_row, torch.where(match, sib_rank, big), reduce="amin")
        taken[:T] = match & (sib_rank == first[parent_row]) & (node_mode == Mode.GREEDY)

    if int(Mode.DETERMINISTIC) in present:
        # Sample-and-match, one depth at a time. Default: over the requests still walking, so a draw is
        # made only at rows the walk reaches (lazy coins then draw only those exponential rows).
        # sync_free: over every deterministic request at every depth, finished walks masked.
        tokens_or_none = torch.cat([tokens, tokens.new_full((1,), -1)])  # [T + 1]: index -1 (no child) -> -1
        det = (modes == Mode.DETERMINISTIC).nonzero().flatten()  # [n] request ids (host)
        walking = det.to(device) if not sync_free else upload([det], device)[0]
        row = row_base[walking]  # [n] the row each walking request is at
        active = torch.ones_like(walking, dtype=torch.bool)  # sync_free: the walk has not stopped
        for d in range(D + 1):
            if not sync_free and walking.numel() == 0:
                break
            ids = det if sync_free else walking
            y = race(target_probs[row], coins.exponential_at(ids, torch.full_like(walking, d)))  # [n]
            children = child_node[row]  # [n, K]
            hit = tokens_or_none[children] == y[:, None]  # [n, K]
            on = hit.any(-1)
            nxt = children.gather(1, hit.to(torch.int8).argmax(-1, keepdim=True)).squeeze(1)  # first match
            if sync_free:
                y_row[row] = torch.where(active, y, y_row[row])
                on &= active
                taken[torch.where(on, nxt, T)] = on  # the sink takes the misses
                row, active = torch.where(on, node_row[nxt.clamp(min=0)], row), on
            else:
                y_row[row] = y
                taken[nxt[on]] = True
                det, walking, row = None, walking[on], node_row[nxt[on]]

    if present & {int(Mode.SAMPLED), int(Mode.SAMPLED_WITHOUT_REPLACEMENT)}:
        row_mode = modes_d[row_req]  # [R]
        sampled_row = row_mode >= Mode.SAMPLED
        wor_row = row_mode == Mode.SAMPLED_WITHOUT_REPLACEMENT
        p_cur = target_probs.clone()  # [R, V] residual target per row
        q_cur = draft_probs.clone()  # [R, V] (renormalised q for without-replacement rows)
        done = torch.zeros(R, dtype=torch.bool, device=device)  # a child of the row was accepted
        for j in range(K if T else 0):  # sibling rank; everything else is vectorised
            c = child_node[:, j]  # [R]
            has = (c >= 0) & sampled_row
            cc = c.clamp(min=0)
            x = torch.where(has, tokens[cc], torch.zeros_like(cc))  # [R]
            px = p_cur.gather(1, x[:, None]).squeeze(1)
            qx = q_cur.gather(1, x[:, None]).squeeze(1)
            # q(x) = 0 cannot be drafted; reject rather than divide by zero.
            ratio = torch.where(qx > 0, px / torch.where(qx > 0, qx, torch.ones_like(qx)), torch.zeros_like(px))
            u = coins.uniform[row_req, row_depth, j]  # [R]
            acc = has & ~done & (u < ratio.to(u.dtype))
            taken[torch.where(acc, cc, T)] = acc
            step = has & ~done & ~acc  # rows that reject child j and move on
            wor = step & wor_row
            if sync_free:  # every row computed, the rejecting rows kept (row-wise ops: same bits)
                p_cur = torch.where(step[:, None], residual(p_cur, q_cur), p_cur)
                q_new = q_cur.scatter(1, x[:, None], 0.0)
                q_new = q_new / row_sum(q_new).clamp(min=torch.finfo(q_new.dtype).tiny)
                q_cur = torch.where(wor[:, None], q_new, q_cur)
            else:  # row-wise updates of the rejecting rows only
                si = step.nonzero().flatten()
                if si.numel():
                    p_cur[si] = residual(p_cur[si], q_cur[si])
                wi = wor.nonzero().flatten()
                if wi.numel():
                    q_new = q_cur[wi].scatter(1, x[wi, None], 0.0)
                    q_cur[wi] = q_new / row_sum(q_new).clamp(min=torch.finfo(q_new.dtype).tiny)
            done |= acc
        p_final = p_cur

    # A node is accepted iff every node on its path (itself included) was taken.
    taken_pad = torch.zeros(B, M, dtype=torch.bool, device=device)
    taken_pad[node_req, node_local] = taken[:T]
    accepted_pad = ~(mask & ~taken_pad[:, None, :]).any(-1) & valid  # [B, M]
    num_accepted = (depth_pad * accepted_pad).amax(-1) if M else torch.zeros(B, dtype=torch.long, device=device)

    # At most one accepted node per depth: scatter node ni to column depth - 1 (the others to column D).
    accepted_nodes = torch.full((B, max(D, 0) + 1), NO_NODE, dtype=torch.long, device=device)
    if M:
        col = torch.where(accepted_pad, depth_pad - 1, torch.full_like(depth_pad, D))
        local = torch.arange(M, device=device).expand(B, M)
        accepted_nodes.scatter_(1, col, torch.where(accepted_pad, local, torch.full_like(local, NO_NODE)))
        accepted_nodes[:, D] = NO_NODE
    accepted_nodes = accepted_nodes[:, :D]
    deepest = torch.zeros_like(num_accepted)  # [B] local row where the walk stopped (0 = root)
    if D:
        last = accepted_nodes.gather(1, (num_accepted - 1).clamp(min=0)[:, None]).squeeze(1)
        deepest = torch.where(num_accepted > 0, last + 1, deepest)
    last_row = row_base + deepest  # [B] global row where the walk stopped

    next_token = y_row[last_row]
    if p_final is not None:
        sampled_h = (modes >= Mode.SAMPLED).nonzero().flatten()  # [s] request ids (host)
        sampled = upload([sampled_h], device)[0] if sync_free else sampled_h.to(device)
        e_last = coins.exponential_at(sampled_h if coins.exponential is None else sampled,
                                      num_accepted[sampled])  # [s, V]
        next_token = next_token.clone()
        next_token[sampled] = race(p_final[last_row[sampled]], e_last)
    walked = num_accepted

    # Emitted tokens: accepted tokens, then next_token; cut at EOS / max_tokens.
    acc_tok = torch.where(accepted_nodes >= 0, padded_tokens.gather(1, accepted_nodes.clamp(min=0)),
                          torch.full_like(accepted_nodes, PAD_TOKEN_ID)) if D else accepted_nodes
    emitted = torch.cat([acc_tok, torch.full((B, 1), PAD_TOKEN_ID, dtype=torch.long, device=device)], 1)
    emitted.scatter_(1, num_accepted[:, None], next_token[:, None])  # [B, D + 1]
    length = num_accepted + 1
    pos = torch.arange(D + 1, device=device)[None, :]
    if eos_token_id is not None:
        eos = eos_token_id if isinstance(eos_token_id, torch.Tensor) else torch.as_tensor(eos_token_id)
        eos = upload([eos.to(torch.long)], device)[0] if eos.device.type == "cpu" else eos.to(device)
        eos = eos.expand(B)[:, None] if eos.dim() < 2 else eos  # [B, S] stop ids, -1 padded
        hit = ((emitted[:, :, None] == eos[:, None, :]) & (eos[:, None, :] >= 0)).any(-1)  # [B, D + 1]
        is_eos = hit & (pos < length[:, None])
        first_eos = torch.where(is_eos, pos, torch.full_like(pos, D + 1)).amin(-1)
        length = torch.minimum(length, first_eos + 1)
    if max_tokens is not None:
        mt = upload([mt_host], device)[0] if mt_host is not None else max_tokens.to(device=device, dtype=torch.long)
        length = torch.minimum(length, mt.expand(B))
    output = torch.where(pos < length[:, None], emitted, torch.full_like(emitted, PAD_TOKEN_ID))
    num_accepted = length - 1
    next_token = output.gather(1, num_accepted[:, None]).squeeze(1)
    if D:
        accepted_nodes = torch.where(pos[:, :D] < num_accepted[:, None], accepted_nodes,
                                     torch.full_like(accepted_nodes, NO_NODE))
    return TreeVerifyOutput(accepted_nodes, num_accepted, next_token, output, walked)


def verify_greedy_host(batch: TreeBatch, target_argmax: torch.Tensor, *, eos_token_id: torch.Tensor | None = None,
                       max_tokens: torch.Tensor | None = None) -> TreeVerifyOutput:
    """`verify_batch` for a batch whose every request is greedy, walked on host lists (CPU serving).

    target_argmax: [R] int64 argmax of p per row (request-major, `batch.cu_num_rows`); eos_token_id and
    max_tokens as in `verify_batch`. At each row the first child (in sibling order) whose token is the
    row's argmax is accepted; the walk stops at a row with none, whose argmax is the next token. Then
    the emitted tokens are cut at the first stop id and at max_tokens by `_truncate` (`rules.py`), as
    the reference walk cuts them.
    """
    B, D = batch.batch_size, batch.max_depth
    y = target_argmax.tolist()  # [R] (CPU: no device round trip)
    base = batch.cu_num_rows.tolist()
    stops: list[set[int]] = [set() for _ in range(B)]
    if eos_token_id is not None:
        eos = torch.as_tensor(eos_token_id).to(torch.long)
        eos = eos.expand(B)[:, None] if eos.dim() < 2 else eos  # [B, S] stop ids, -1 padded
        stops = [{t for t in row if t >= 0} for row in eos.tolist()]
    budget = None if max_tokens is None else torch.as_tensor(max_tokens, dtype=torch.long).expand(B).tolist()
    if budget is not None and min(budget, default=1) < 1:
        raise ValueError("max_tokens must be >= 1 for every request")
    accepted = [[NO_NODE] * D for _ in range(B)]
    output = [[PAD_TOKEN_ID] * (D + 1) for _ in range(B)]
    num, nxt, walked = [0] * B, [0] * B, [0] * B
    for b, tree in enumerate(batch.trees):
        if tree.tokens is None and tree.num_nodes:
            raise ValueError(f"tree {b} has {tree.num_nodes} nodes but no tokens; verification needs them")
        toks, children, r0 = [] if tree.tokens is None else tree.tokens.tolist(), tree.children, base[b]
        path, row = [], 0
        while True:  # descend while a child carries the row's argmax (the first such sibling)
            want = y[r0 + row]
            hit = next((c for c in children[row] if toks[c] == want), None)
            if hit is None:
                break
            path.append(hit)
            row = hit + 1
        kept, nxt[b] = _truncate(path, y[r0 + row], toks, stops[b], None if budget is None else budget[b])
        walked[b], num[b] = len(path), len(kept)
        accepted[b][: len(kept)] = kept
        output[b][: len(kept) + 1] = [toks[c] for c in kept] + [nxt[b]]
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return TreeVerifyOutput(t(accepted).view(B, D), t(num), t(nxt), t(output).view(B, D + 1), t(walked))
