"""The only package that touches vLLM internals. Every touch point is recorded here.

    P1  EngineArgs.create_speculative_config (wrapped, main process)
        Why: SpeculativeConfig rejects method "tree" and unknown keys (Literal method, extra="forbid").
        What: a tree config is validated by TreeSpecConfig, moved to additional_config["tree_spec"], and
              replaced by a custom_class config pointing at our proposer; worker_cls -> TreeCPUWorker /
              TreeGPUWorker; on CUDA, compilation_config.cudagraph_mode -> PIECEWISE (attention eager).
        Removal: an upstream plugin hook for speculative methods (a registry like the attention backends').
    P2  AttentionBackendEnum.CPU_ATTN -> TreeCPUAttentionBackend; FLASH_ATTN / TRITON_ATTN ->
        TreeFlashAttentionBackend / TreeTritonAttentionBackend (documented registry, worker process only)
        Why: the stock kernels have no tree mask. What: one attention pass per layer in steps with trees.
              CPU: vLLM's `cpu_attention_with_kv_cache` is called once with our own sequence split (each
              branching tree's root + nodes as one non-causal sequence over the prefix, via its per-sequence
              `dynamic_causal`; chains stay causal), then each node is merged with its tree part by log-sum-exp weights (the
              prefix LSE computed on the side: the op returns none); every cache read and the commit go through
              kv_layout's `cpu_*` functions for the layer's ISA (`layer.isa`, set by vLLM's metadata builder:
              vec / vec16, and amx for bf16 on AMX CPUs), each layout pinned by `kv_layout.self_test` against
              vLLM's `cpu_attn_reshape_and_cache` at start-up. GPU: the stock kernel does not run;
              the Triton tree kernel computes every row of the step from the paged cache.
        Removal: a tree/custom-mask argument in the attention ops, or (CPU) an LSE output of
              cpu_attention_with_kv_cache, which would remove the side pass (extend_attention_cpu's
              tree_mask is bf16/fp16 only, token-major and refuses sliding windows; Triton
              unified_attention's qq_bias is one 2-D bias per batch).
    P3  vllm.v1.worker.cpu_worker.CPUModelRunner swapped during TreeCPUWorker.init_device only
        Why: CPUWorker builds its runner by module-global name and has no factory hook.
        Removal: a `_make_model_runner` hook on CPUWorker (GPU's Worker has one; TreeGPUWorker uses it).
    P4  Model-runner method overrides in TreeRunnerMixin (propose_draft_token_ids, _update_states,
        _prepare_inputs, _build_attention_metadata, _model_forward, _sample, initialize_kv_cache,
        _input_fits_in_drafter, load_model, _bookkeeping_sync),
        on a subclass used only by tree engines; model-specific adapters hook in there (DeepSeek-V4: integration/dsv4/,
        whose own touch points D1-D5 are recorded in its package docstring)
        Why: depth positions, tree masks, tree verification and KV compaction have no upstream hooks.
        Removal: upstream tree speculation (vLLM PR #22752 was the closest; closed).
        initialize_kv_cache also runs `tree_check_caches` after vLLM's own: each layer's override checks it
        can read its cache (CPU: the ISA vLLM picked), so an unreadable layout is refused at start-up.
        _input_fits_in_drafter returns True: vLLM zeroes *every* request's drafts once the longest request
        cannot take num_spec_tokens more positions, and those zeros would be scheduled with no tree behind
        them; the tree drafter sizes each request's tree by its own room instead. Removal: a per-request
        room check upstream (or drafts cleared rather than zeroed).
        _model_forward runs vLLM's forward, then checks that every attention layer of the target applied
        the tree mask in a step with trees (each override marks the step: no silent causal fallback).
        Removal: a tree-mask argument in the attention ops (P2), which would make a lost mask impossible.
        _sample samples every row itself, steps without trees included: vLLM's chain RejectionSampler
        crashes on vLLM-cpu when a step has spec-decode metadata and no drafts (empty top-k input), and its
        Sampler lacks min-p / logit bias under speculation. _bookkeeping_sync hides the generators of
        discarded partial-prefill rows (which draw nothing) from vLLM's Philox rewind, which CPU generators
        do not support. Removal: the upstream fixes, or a sampler hook on the model runner.
        In a step with trees _sample returns `sampled_token_ids` as a host tensor (the step's one
        device-to-host transfer, which also carries the accepted paths the commit and counters read);
        vLLM's _bookkeeping_sync reads it through RejectionSampler.parse_output, whose `.cpu()` is then
        a no-op. Removal: a hook that hands the proposer vLLM's own host copy of the sampled tokens.

    P5  (launcher.py) the `vllm-cpu` distribution name, for `vllm-tree-spec serve`.
    P6  vllm.utils.cpu_triton_utils._expand_kernel_impl, only with VLLM_TREE_SPEC_FIX_CPU_EXPAND=1
        Why: vLLM-cpu 0.32's version writes into a copy, so linear speculation at T > 0 sees NaN target
              probabilities (the benchmark's linear baseline). What: a dtype-preserving expand.
        Removal: the upstream fix (vllm_cpu_fixes.py has the details).
    P7  (eagle3_aux.py) runner.use_aux_hidden_state_outputs + model.set_aux_hidden_state_layers on tree
        runners whose drafter reads the target's features (drafter 'eagle3'), after load_model.
        Why: method 'tree' reaches vLLM as 'custom_class', for which vLLM never turns aux outputs on.
        Removal: an aux-hidden-states flag for custom_class proposers upstream.
        P7b: drafter 'eagle' (EAGLE-1) taps no aux layers; runner.py reads propose_draft_token_ids' 4th
        argument (the target's output hidden states) and hands it over. Removal: hidden states in the
        custom_class proposer interface.

    G   (vllm_guard.py) reads, changes nothing: at start-up of a tree engine, refuses an untested vLLM
        version (VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM=1: a warning) and any overridden method (P2-P4, D2-D3,
        derived from our classes), patched method (P1, P8) or attribute (P2, P3, D5) that is missing or has
        other parameters than in vLLM 0.32.0. Why: the hooks above are private. Removal: upstream tree hooks.

    P8  (request_validation.py) SamplingParams._validate_spec_decode, for tree engines only: min_p and
        logit_bias are accepted (the tree sampler applies them on every row).
        Why: vLLM refuses both for every speculative method (its chain sampler lacks them).
        Removal: per-method validation upstream (a proposer that declares which parameters it supports).

    P9  (logs.py) the "vllm_tree_spec" logger gets the "vllm" logger's handlers and level, in tree workers.
        Why: vLLM configures only "vllm.*" loggers, so the plugin's INFO records (plan changes, the CPU
        tree-attention path) were dropped by Python's root logger.
        Removal: a documented logging hook for plugins (or VLLM_LOGGING_CONFIG_PATH covering them).

    P10 (cpu_gemm.py) calls vLLM's dispatch_cpu_unquantized_gemm on the drafters' own networks (the EAGLE-3 /
        EAGLE head, a draft model) on CPU, changing nothing in vLLM: each nn.Linear gets vLLM's oneDNN handler.
        Why: F.linear goes to MKL, whose small-M sgemm is 2-3x slower on the head's shapes than vLLM's handler.
        Removal: the head run as vLLM's Eagle3LlamaForCausalLM with tree attention metadata.

    L   (live_state.py) reads, changes nothing: the tree workers' `tree_live_state` method (reachable with
        vLLM's collective_rpc; served: POST /collective_rpc under VLLM_SERVER_DEV_MODE=1) lists the request
        ids held in every per-request place of the plugin, next to vLLM's runner.requests / input batch.
        Why: leak checks after aborts and preemption (tests/integration/test_engine_faults.py, the soak).
        Removal: none needed (a worker method of our own; it reads vLLM's runner attributes only).
        The workers' `tree_memory` method (worker_memory.py) reads their RSS and glibc heap the same way
        (optionally after malloc_trim), so the soak tells retained free memory from live memory.
        Not a vLLM touch, but process-wide: tree workers call glibc's malloc_trim(0) at most every
        VLLM_TREE_SPEC_TRIM_INTERVAL_S seconds (default 30, 0: off) between steps (worker_memory.HeapTrimmer),
        because glibc keeps the freed pages of large per-step tensors resident. Removal: tcmalloc preloaded
        as vLLM-cpu recommends (then the call is a no-op on an empty glibc heap), or an allocator hook in vLLM.

`install()` is what the plugin entry point calls; it applies P1 (inert unless a tree config is given),
P6 (only when its variable is set) and P8 (inert unless the engine is a tree engine). P2-P4 happen in
the worker that P1 selects, i.e. only in tree engines.
"""

from __future__ import annotations

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from vllm_tree_spec.integration import engine_config

    engine_config.install()
    from vllm_tree_spec.integration import vllm_cpu_fixes

    vllm_cpu_fixes.install_if_requested()
    from vllm_tree_spec.integration import request_validation

    request_validation.install()
    _installed = True
