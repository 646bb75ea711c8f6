"""Checks of vLLM's MTP model as the MTP tree drafter's head (integration/v2/mtp_head.py), run inside a live engine.

`check(drafter, target_model)` takes the engine's MTP drafter (its head: vLLM's `DeepSeekV4MTP` loaded by the V2
runner; its window: vLLM's page of the MTP layer) and builds a second drafter on the plugin's PyTorch drive of the
same checkpoint's MTP weights (float window), mixing with the same target's mHC ops. Both catch up on the same
committed rows (random target residuals, two pieces) and expand the same dynamic tree. It reports:

* `window`, `rows_in_page`, `page_vs_float_rows`: the engine drafter's window store (vLLM's page of the MTP
  layer), how many committed rows the check's request keeps there, and their max distance to the PyTorch
  drive's float rows relative to the rows' largest value (FP8 rounding: at most 2^-4, plus bf16 differences);
* `root_dp`: max |dq| of the root distributions, vLLM's model (FP8 window) vs the PyTorch drive (float window);
* `tree_vs_chain_dp`: max |dq| of every expanded tree row of vLLM's model against that model run one row at a
  time along the row's path (the path invariant for the draft head), and `rows`, how many rows;
* `tree_vs_torch_dp`: max |dq| of the same tree rows, vLLM's model vs the PyTorch drive;
* `planted_causal_dp`: the invariant's distance when the tree rows attend to the previous rows of their level
  in the session's order (a causal mask over the level) instead of their ancestors: a negative control that
  must move the rows.
"""

from __future__ import annotations

import torch
from test_dsv4_mtp import _caught_up, _chain_q  # the PyTorch drive's tree-row tests' helpers

from vllm_tree_spec.integration.v2.mtp_window import PagedMTPWindow

TOKENS = 14
POLICY = "s5_k2_d10"  # deeper than the engine's trees: five levels, expanded rows at depths 1 .. 4


def _tree(d, st, planted: bool = False):
    from vllm_tree_spec import build
    from vllm_tree_spec.drafters import mtp

    session = mtp._Session(d, [st])
    if planted:  # every row also sees the earlier rows of its own level (a causal mask over the level)
        level = session._level

        def causal_level(rows, out):
            orig = d.head.forward

            def forward(tokens, positions, prev, context_fn, **kw):
                def ctx(kv_new):
                    c, v = context_fn(kv_new)
                    extra = kv_new[None].expand(c.shape[0], -1, -1)
                    tri = torch.ones(c.shape[0], c.shape[0], dtype=torch.bool, device=v.device).tril(-1)
                    return torch.cat([c, extra], 1), torch.cat([v, tri], 1)
                return orig(tokens, positions, prev, ctx, **kw)

            d.head.forward = forward
            try:
                level(rows, out)
            finally:
                del d.head.forward

        session._level = causal_level
    with torch.no_grad():
        build.build_dynamic_batch(session, d.policy.shape, [()])
    return session.nodes[0]


def check(drafter, target_model) -> dict:
    from vllm_tree_spec.drafters.mtp import MTPTreeDrafter

    head = drafter.head
    c = head.cfg
    torch_drafter = MTPTreeDrafter(POLICY, model_dir=drafter.model_dir, hf_config=drafter.hf_config,
                                   dtype=drafter.dtype, device=str(drafter.device))
    torch_drafter.load_model(target_model)
    tokens = [int(t) for t in torch.randint(0, c.vocab, (TOKENS,), generator=torch.Generator().manual_seed(7))]
    fresh = MTPTreeDrafter(POLICY, dtype=drafter.dtype, device=str(drafter.device), head=head)
    engine_window = drafter.window  # vLLM's page of the MTP layer (integration/v2/mtp_window.py)
    # the check's request in that page: blocks 1.. (every request has finished; block 0 is vLLM's null block)
    window = PagedMTPWindow(c.window, lambda rid: list(range(1, 1 + -(-TOKENS // engine_window.block_size))))
    window.attach(engine_window.cache, engine_window.block_size, "check")
    fresh.use_window(window)
    with torch.no_grad():  # both catch up on the same committed rows (same residuals), in two pieces
        st_v, _ = _caught_up(fresh, tokens, pieces=2)
        st_t, _ = _caught_up(torch_drafter, tokens, pieces=2)
        root_dp = float((torch.softmax(st_v.root_logits.float(), -1)
                         - torch.softmax(st_t.root_logits.float(), -1)).abs().max())
        # the committed rows as vLLM's page holds them vs the PyTorch drive's float rows (FP8 rounding)
        paged = window.rows_many([(st_v, st_v.kv_pos0, st_v.next_pos)])[0]
        page_vs_float = float(((paged - st_t.kv[-paged.shape[0]:].float().cpu()).abs().max()
                               / st_t.kv.float().abs().max()))
        nodes = _tree(fresh, st_v)
        chain, versus_torch = 0.0, 0.0
        for path, (x, _) in nodes.items():
            got = torch.softmax(head.logits(x[None])[0], -1)
            chain = max(chain, float((got - _chain_q(fresh, st_v, path)).abs().max()))
            versus_torch = max(versus_torch, float((got - _chain_q(torch_drafter, st_t, path)).abs().max()))
        planted = _tree(fresh, st_v, planted=True)
        planted_dp = max(float((torch.softmax(head.logits(x[None])[0], -1) - _chain_q(fresh, st_v, path)).abs().max())
                         for path, (x, _) in planted.items())
    return {"head": type(head).__name__, "window": type(engine_window).__name__, "rows_in_page": paged.shape[0],
            "page_vs_float_rows": page_vs_float, "root_dp": root_dp, "rows": len(nodes), "tree_vs_chain_dp": chain,
            "tree_vs_torch_dp": versus_torch, "planted_causal_dp": planted_dp,
            "depths": sorted({len(p) for p in nodes})}
