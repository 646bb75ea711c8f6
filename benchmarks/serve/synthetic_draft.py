"""A synthetic draft model for draft-model speculation when no real small draft exists.

SmolLM2-135M has no smaller sibling in any pip package, so draft-model rows use a draft *derived from
the target* (same tokenizer, same chat template):

    truncate:N   the target's first N decoder layers + its final norm + its (tied) head, no training
                 ("early exit"). Cheap (N/30 of the target's layer cost) but poorly aligned: measured
                 greedy top-1 agreement with SmolLM2-135M on three chat answers was 4-9 % at N = 6,
                 1-8 % at N = 10, 8-12 % at N = 15, 18-20 % at N = 20, 28-47 % at N = 25.
    noisy:S      a full copy of the target with Gaussian noise of S x each tensor's std added (the
                 tests' construction): tunable agreement (measured top-1 / top-2 agreement with the
                 target's greedy token on two chat answers: S = 0.1: 71-74 % / 86-89 %, S = 0.2:
                 22-32 % / 33-46 %, S = 0.3: ~0), but as expensive as the target, so only its
                 acceptance numbers mean anything, never its speed.

Both are synthetic; results obtained with them say nothing about a trained draft (EAGLE heads, a
distilled small model). They exist so the draft-model code path (vLLM's linear `draft_model`, the tree
drafter's static and dynamic trees) is exercised end to end at equal budget.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def truncated_draft(target: str | Path, num_layers: int, out: str | Path | None = None) -> Path:
    """Keep layers [0, num_layers) + embeddings + final norm + head; write a safetensors checkpoint."""
    from safetensors.torch import load_file, save_file

    target = Path(target)
    out = Path(out or target.parent / f"{target.name}-draft-truncate{num_layers}")
    if (out / "model.safetensors").exists():
        return out
    cfg = json.loads((target / "config.json").read_text())
    if not 1 <= num_layers < cfg["num_hidden_layers"]:
        raise ValueError(f"truncate:{num_layers}: keep between 1 and {cfg['num_hidden_layers'] - 1} layers")
    state = load_file(str(target / "model.safetensors"))
    keep = {}
    for k, v in state.items():
        if ".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= num_layers:
            continue
        keep[k] = v.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    cfg["num_hidden_layers"] = num_layers
    cfg["_synthetic_draft"] = f"first {num_layers} layers of {target.name} (no training)"
    for key in ("layer_types",):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:num_layers]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(target, out)
    return out


def noisy_draft(target: str | Path, noise: float, seed: int = 1, out: str | Path | None = None) -> Path:
    """The target's weights plus noise * std(tensor) * N(0, 1), seeded."""
    import torch
    from safetensors.torch import load_file, save_file

    target = Path(target)
    out = Path(out or target.parent / f"{target.name}-draft-noisy{noise:g}")
    if (out / "model.safetensors").exists():
        return out
    state = load_file(str(target / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    noisy = {}
    for k, v in state.items():
        if v.is_floating_point() and v.numel() > 1:
            v = v + torch.randn(v.shape, generator=g, dtype=v.dtype) * noise * v.float().std().to(v.dtype)
        noisy[k] = v.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg["_synthetic_draft"] = f"{target.name} + {noise:g} x std Gaussian noise (seed {seed})"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(target, out)
    return out


def make_draft(spec: str, target: str | Path) -> Path:
    """'truncate:N' | 'noisy:S' | an existing model directory."""
    kind, _, arg = spec.partition(":")
    if kind == "truncate" and arg:
        return truncated_draft(target, int(arg))
    if kind == "noisy" and arg:
        return noisy_draft(target, float(arg))
    path = Path(spec)
    if (path / "config.json").exists():
        return path
    raise ValueError(f"--draft {spec!r}: give truncate:N, noisy:S or a model directory")
