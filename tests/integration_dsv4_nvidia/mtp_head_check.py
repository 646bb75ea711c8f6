"""Checks of vLLM's MTP model as the MTP tree drafter's head (integration/v2/mtp_head.py), run inside a live engine.

`check(drafter, target_model)` takes the engine's MTP drafter (its head: vLLM's `DeepSeekV4MTP` loaded by the V2
runner) and builds a second drafter on the plugin's PyTorch drive of the same checkpoint's MTP weights, mixing
with the same target's mHC ops. Both catch up on the same committed rows (random target residuals, two
pieces) and expand the same dynamic tree. It reports:

* `root_dp`: max |dq| of the root distributions, vLLM's model vs the PyTorch drive (same maths, different
  kernels and roundings);
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

            def forward(tokens, positions, prev, context_fn):
                def ctx(kv_new):
                    c, v = context_fn(kv_new)
                    extra = kv_new[None].expand(c.shape[0], -1, -1)
                    tri = torch.ones(c.shape[0], c.shape[0], dtype=torch.bool, device=v.device).tril(-1)
                    return torch.cat([c, extra], 1), torch.cat([v, tri], 1)
                return orig(tokens, positions, prev, ctx)

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
    with torch.no_grad():  # both catch up on the same committed rows (same residuals), in two pieces
        st_v, _ = _caught_up(fresh, tokens, pieces=2)
        st_t, _ = _caught_up(torch_drafter, tokens, pieces=2)
        root_dp = float((torch.softmax(st_v.root_logits.float(), -1)
                         - torch.softmax(st_t.root_logits.float(), -1)).abs().max())
        nodes = _tree(fresh, st_v)
        chain, versus_torch = 0.0, 0.0
        for path, (x, _) in nodes.items():
            got = torch.softmax(head.logits(x[None])[0], -1)
            chain = max(chain, float((got - _chain_q(fresh, st_v, path)).abs().max()))
            versus_torch = max(versus_torch, float((got - _chain_q(torch_drafter, st_t, path)).abs().max()))
        planted = _tree(fresh, st_v, planted=True)
        planted_dp = max(float((torch.softmax(head.logits(x[None])[0], -1) - _chain_q(fresh, st_v, path)).abs().max())
                         for path, (x, _) in planted.items())
    return {"head": type(head).__name__, "root_dp": root_dp, "rows": len(nodes), "tree_vs_chain_dp": chain,
            "tree_vs_torch_dp": versus_torch, "planted_causal_dp": planted_dp,
            "depths": sorted({len(p) for p in nodes})}
