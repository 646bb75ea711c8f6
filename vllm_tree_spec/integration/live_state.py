"""Live per-request state of a tree worker: every place the plugin keeps something per request.

A leak check needs the list of places, and for each the request ids it holds. After any load
(finished, aborted, preempted requests) a place may hold only requests vLLM still holds itself
(`runner.requests`: running and preempted ones); once the engine has drained, every place is empty.

    place                        holds, between steps                    kept by
    vllm.requests                running + preempted requests            vLLM's runner (the reference)
    vllm.batch                   requests in the persistent batch        vLLM's input batch
    vllm.generators              seeded requests in the batch            input_batch.generators (the
                                                                         verify coins' streams)
    (Model Runner V2: vllm.requests are V2's request states and the preempted requests it dropped until they
    resume; speculator.requests / .generators the
    requests' host state the V2 adapter keeps, speculator.trees their last drafts, v2/speculator.py; a
    network drafter's runner.kv_blocks, its requests' block ids, and store.slots, its store's slots,
    v2/draft_kv.py)
    runner.drafts                the last proposal's trees               TreeRunnerMixin._tree_drafts
    runner.committed             rows committed by the last tree step    TreeRunnerMixin._tree_committed
    runner.skip_logged           requests served without drafts          TreeRunnerMixin._tree_skip_logged
    runner.step                  nothing (reset after sampling)          the step's TreeStep: slots, masks,
                                                                         attention plans (scratch)
    drafter.active               started, not finished                   TreeDrafter.active_requests
    drafter.<attr>               the same requests                       every per-request dict / set of
                                                                         the drafter (draft_model / eagle3 /
                                                                         mtp `_states`: KV caches, features,
                                                                         generators; suffix `_num_added`, ...)
    drafter.suffix_cache         the same requests                       Arctic's active responses

The drafter's per-request containers are found by scanning its attributes (any dict or set keyed by
request ids), so a new one is counted without being listed here. The tree counters
(`integration/stats.py`) are aggregates and hold no request ids. Arctic's global suffix tree keeps
finished responses on purpose (later requests match against them), bounded by
`max_cached_requests`; `cached_responses` reports its size, which is not per-request state.

Reachable in-process (`live_state(runner)`) and through vLLM's `collective_rpc` as the tree
workers' `tree_live_state` method; a server started with `VLLM_SERVER_DEV_MODE=1` answers
`POST /collective_rpc {"method": "tree_live_state"}` with one such dict per worker.
"""

from __future__ import annotations

REFERENCE = "vllm.requests"


def _ids(container) -> list[str]:
    return sorted(str(k) for k in container)


def _per_request_containers(obj, prefix: str) -> dict[str, list[str]]:
    """Every dict / set attribute of `obj` keyed by strings (request ids are strings in vLLM)."""
    return {f"{prefix}.{name.lstrip('_')}": _ids(value) for name, value in vars(obj).items()
            if isinstance(value, (dict, set)) and all(isinstance(k, str) for k in value)}


def live_state(runner) -> dict[str, list[str]]:
    """{place: sorted request ids held there} for one tree model runner (see the module docstring)."""
    if hasattr(runner, "req_states"):  # Model Runner V2: request states by slot, no persistent batch
        spec = runner.speculator
        state = {
            # V2's request states, and the preempted requests it dropped until they resume (V1 holds both)
            REFERENCE: _ids(set(runner.req_states.req_id_to_index) | runner._tree_preempted),
            "speculator.requests": _ids(spec.requests),  # the requests' host state (v2/speculator.py)
            "speculator.generators": sorted(r for r, st in spec.requests.items() if st.generator is not None),
            "speculator.trees": _ids(spec.trees),  # the last draft per request, empty ones included
        }
        blocks = getattr(runner, "_tree_head_kv", None)  # a network drafter's block ids (v2/draft_kv.py)
        if blocks is not None:
            state["runner.kv_blocks"] = _ids(blocks.blocks)
            slots = getattr(getattr(blocks, "store", None), "req_of", None)  # its store's slots by request
            if slots is not None:
                state["store.slots"] = sorted(str(r) for r in slots.values() if r is not None)
    else:
        batch = runner.input_batch
        batch_ids = [rid for rid in batch.req_ids if rid is not None]
        state = {
            REFERENCE: _ids(runner.requests),
            "vllm.batch": sorted(batch_ids),
            "vllm.generators": sorted(batch_ids[i] for i in batch.generators if i < len(batch_ids)),
        }
    state.update({
        "runner.drafts": _ids(runner._tree_drafts),
        "runner.committed": _ids(runner._tree_committed),
        "runner.skip_logged": _ids(runner._tree_skip_logged),
        "runner.step": sorted(r.req_id for r in runner._tree_step.requests),
    })
    drafter = getattr(runner.drafter, "drafter", runner.drafter)  # TreeProposer wraps the tree drafter
    state["drafter.active"] = _ids(drafter.active_requests)
    for place, ids in _per_request_containers(drafter, "drafter").items():
        if place != "drafter.prompt_len":  # the same dict as drafter.active
            state[place] = ids
    cache = getattr(drafter, "cache", None)  # suffix drafter: Arctic's SuffixDecodingCache
    if cache is not None and hasattr(cache, "active_requests"):
        state["drafter.suffix_cache"] = _ids(cache.active_requests)
    return state


def cached_responses(runner) -> int:
    """Finished responses the suffix drafter's global tree keeps for matching (bounded; 0 for other drafters)."""
    cache = getattr(getattr(runner.drafter, "drafter", None), "cache", None)
    return len(getattr(cache, "cached_requests", ()) or ())


def leaks(state: dict[str, list[str]], live: set[str] | None = None) -> dict[str, list[str]]:
    """Places holding ids that are not live. live: the live request ids (default: vLLM's own `vllm.requests`)."""
    live = set(state[REFERENCE]) if live is None else set(live)
    out = {}
    for place, ids in state.items():
        extra = [i for i in ids if i not in live]
        if extra:
            out[place] = extra
    return out


def counts(state: dict[str, list[str]]) -> dict[str, int]:
    return {place: len(ids) for place, ids in state.items()}
