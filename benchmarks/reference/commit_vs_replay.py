"""Commit from scratch vs commit by replay, on the DeepSeek-V4 reference model (CPU).

After a tree step has verified, the accepted path's state must reach the
persistent cache. Two ways:

    commit   copy the path's scratch rows (window KV, compressor and indexer
             state rows) and the entries it completed into the cache
    replay   drop the scratch and recompute root + accepted tokens as a chain
             (vLLM-style rollback + re-feed; one more forward over a + 1 tokens)

Both leave the same state (tests/reference/test_dsv4_tree.py checks it). This
script measures wall time (median of reps, one intra-op thread) and bytes:

    commit bytes     every copied element, read once from scratch and written once
    replay bytes     state traffic of the replay forward (slot gathers + writes,
                     counted by wrapping the two slot kernels) plus one read of
                     every weight matrix (a forward over a few tokens is
                     weight-bound; the embedding counts one row per token)

Run:  python benchmarks/reference/commit_vs_replay.py [--reps 20] [--config tiny|medium|both]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vllm_tree_spec.reference.dsv4 as dsv4_module
from vllm_tree_spec.reference import dsv4_tree as dt
from vllm_tree_spec.reference.dsv4 import DSV4Model
from vllm_tree_spec.reference.dsv4_cache import PAD_SLOT, DSV4Cache, gather_slots, write_slots
from vllm_tree_spec.reference.dsv4_config import DSV4Config
from vllm_tree_spec.tree import Tree

CONFIGS = {
    # the test model: layers [SWA, CSA 4, HCA 8, CSA 4], c = 16, W = 8
    "tiny": (DSV4Config(), 40, torch.float64),
    # V4-shaped but CPU-sized: c = 128, W = 128, CSA 4 / HCA 128, indexer 4 x 64 top-64
    "medium": (
        DSV4Config(
            vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, head_dim=128,
            qk_rope_head_dim=32, q_lora_rank=256, o_groups=2, o_lora_rank=256, sliding_window=128,
            compress_ratios=(0, 4, 128, 4), index_n_heads=4, index_head_dim=64, index_topk=64,
            intermediate_size=1024,
        ),
        1021,  # context: the root sits at 1021, so a 3-deep path completes CSA and HCA (1023) blocks
        torch.float32,
    ),
}

# A 10-node tree, depth 4: two root children, the first with a 3-deep branch.
PARENTS = [-1, -1, 0, 0, 2, 2, 4, 1, 7, 3]


class TrafficCounter:
    """Counts bytes through gather_slots / write_slots while active (wraps the model's references)."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self):
        def gather(persistent, scratch, slots):
            rows, valid = gather_slots(persistent, scratch, slots)
            self.bytes += int(valid.sum()) * persistent.shape[-1] * persistent.element_size()
            return rows, valid

        def write(persistent, scratch, slots, values):
            self.bytes += int((slots != PAD_SLOT).sum()) * values.shape[-1] * values.element_size()
            write_slots(persistent, scratch, slots, values)

        dsv4_module.gather_slots, dsv4_module.write_slots = gather, write
        return self

    def __exit__(self, *exc):
        dsv4_module.gather_slots, dsv4_module.write_slots = gather_slots, write_slots


def weight_bytes(model: DSV4Model, num_tokens: int) -> int:
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed"))
    return total + num_tokens * model.embed.weight[0].numel() * model.embed.weight.element_size()


def blocks_completed(cfg: DSV4Config, positions: list[int]) -> str:
    """Which entry kinds the committed positions complete: C (CSA), H (HCA), - (none)."""
    kinds = {cfg.layer_kind(i): cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)}
    done = [k for k, m in sorted(kinds.items()) if k != "swa" and any((p + 1) % m == 0 for p in positions)]
    return "".join(k[0].upper() for k in done) or "-"


def median_time(fn, reps: int, setup) -> float:
    times = []
    for _ in range(reps):
        arg = setup()
        t0 = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(name: str, reps: int) -> list[dict]:
    cfg, context, dtype = CONFIGS[name]
    model = DSV4Model(cfg, dtype, seed=0)
    gen = torch.Generator().manual_seed(0)
    cache = DSV4Cache.empty(cfg, 1, context + 16, dtype)
    prompt = torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist()
    for lo in range(0, context, 256):  # chunked prefill bounds the gather sizes
        dt.prefill(model, cache, [prompt[lo : lo + 256]])
    tree = Tree(torch.tensor(PARENTS), torch.randint(0, cfg.vocab_size, (len(PARENTS),), generator=gen))
    root = 1

    t_tree = median_time(lambda c: dt.tree_forward(model, c, [root], [tree]), reps, lambda: cache)
    step = dt.tree_forward(model, cache, [root], [tree])
    rows = []
    for node in [None, 0, 2, 4, 6]:  # accepted = path to node (None: nothing, only the root is committed)
        acc = [] if node is None else tree.path_to(node)
        t_commit = median_time(lambda c: dt.commit(c, step, [acc]), reps, cache.clone)
        bytes_commit = 2 * dt.commit(cache.clone(), step, [acc]).written  # read + write
        t_replay = median_time(lambda c: dt.commit_by_replay(model, c, step, [acc]), reps, cache.clone)
        with TrafficCounter() as traffic:
            dt.commit_by_replay(model, cache.clone(), step, [acc])
        positions = [context + k for k in range(len(acc) + 1)]  # root + accepted path
        rows.append(dict(
            config=name, accepted=len(acc), completes=blocks_completed(cfg, positions),
            t_tree_ms=1e3 * t_tree, t_commit_ms=1e3 * t_commit, t_replay_ms=1e3 * t_replay,
            commit_kib=bytes_commit / 1024, replay_state_kib=traffic.bytes / 1024,
            replay_weights_mib=weight_bytes(model, len(acc) + 1) / 2**20,
        ))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--config", choices=["tiny", "medium", "both"], default="both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = ["tiny", "medium"] if args.config == "both" else [args.config]
    print("| config | accepted | blocks completed (C=CSA, H=HCA) | tree fwd ms | commit ms | replay ms "
          "| commit KiB | replay state KiB | replay weights MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for r in run(name, args.reps):
            print(f"| {r['config']} | {r['accepted']} | {r['completes']} | {r['t_tree_ms']:.2f} "
                  f"| {r['t_commit_ms']:.3f} | {r['t_replay_ms']:.2f} | {r['commit_kib']:.1f} | {r['replay_state_kib']:.1f} "
                  f"| {r['replay_weights_mib']:.2f} |")


if __name__ == "__main__":
    main()
