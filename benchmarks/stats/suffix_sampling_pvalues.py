"""p-values of the suffix-tree sampling check (tests/integration/test_engine_sampling.py) over repeated runs.

Run from the repository root: `python benchmarks/stats/suffix_sampling_pvalues.py 40`. Each repetition
serves 1500 seeded requests with fresh seeds; under a lossless verifier the p-values are uniform.
Writes /tmp/pvals.json.
"""
import os, sys, json, tempfile
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0"); os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1"); os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, "tests/fixtures"); sys.path.insert(0, "tests/integration")
from vllm_cpu import register_cpu_kernel_overrides_once; register_cpu_kernel_overrides_once()
import shutil, torch
from tiny_models import TinyModelFactory, build_tiny_llama
import test_engine_sampling as T
from engine_utils import run_engine
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
f = TinyModelFactory(tempfile.mkdtemp())
tok = f.tokenizer(2048)
path = tok.parent / "llama-v48-peaked"
build_tiny_llama(3, vocab_size=T.VOCAB, num_layers=2, initializer_range=0.25).save_pretrained(str(path))
for x in tok.iterdir():
    if x.is_file(): shutil.copy2(x, path / x.name)
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
prompt = [7, 11, 13, 17]
with torch.no_grad():
    for _ in range(28):
        prompt.append(int(model(torch.tensor([prompt])).logits[0, -1].argmax()))
law = T.exact_law(model, prompt)
spec = {"method": "tree", "drafter": "suffix", "tree": "s3_k3_d8", "min_token_prob": 0.0}
n = T.N
res = []
for rep in range(int(sys.argv[1])):
    params = [SamplingParams(temperature=T.TEMPERATURE, top_p=T.TOP_P, max_tokens=3, seed=rep * 100000 + i,
                             ignore_eos=True, detokenize=False) for i in range(n)]
    run = run_engine(str(path), [TokensPrompt(prompt_token_ids=prompt)] * n, params, spec, max_num_seqs=16)
    c12, c23 = {}, {}
    for out in run.outputs:
        c12[tuple(out[:2])] = c12.get(tuple(out[:2]), 0) + 1
        c23[tuple(out[1:3])] = c23.get(tuple(out[1:3]), 0) + 1
    p12 = T.chi_square_fit(c12, law["12"], n); p23 = T.chi_square_fit(c23, law["23"], n)
    res.append((p12, p23, run.tree_stats["accepted"]))
    print(f"rep {rep}: p12 {p12:.3g} p23 {p23:.3g} accepted {run.tree_stats['accepted']}", flush=True)
json.dump(res, open("/tmp/pvals.json", "w"))
