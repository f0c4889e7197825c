"""The engine's command-line options, one set for ``encore serve``, ``encore generate`` and ``encore graphs
warmup``: a warm-up given the options a server will run with builds the graph keys, in the graph cache
(graphs/cache.py: the cache's identity covers the attention backend, the keys and their buckets, the
dtype, the page size...), that the server then finds. Unset, an option keeps EngineConfig's default."""

from __future__ import annotations

import argparse

from encore.engine.config import GRAPH_SIZES

_ENGINE_OPTIONS = ("dtype", "attention_backend", "max_num_batched_tokens", "chunked_prefill_size", "page_size",
                   "num_kv_pages", "max_num_seqs", "max_model_len", "seed", "enable_mixed_batch",
                   "enable_prefix_caching", "compile", "cuda_graphs", "overlap_schedule", "graph_cache_dir",
                   *GRAPH_SIZES)


def _sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1; empty for none."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return sizes


def add_engine_args(parser: argparse.ArgumentParser, device: str = "auto") -> None:
    """--model and the engine options, in an "engine" group; ``device`` is --device's default."""
    parser.add_argument("--model", help="Hugging Face model directory (default: the embedded encore-tiny)")
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default=device, help="cpu, cuda[:N] or auto (default: %(default)s)")
    group.add_argument("--dtype", help="float32, bfloat16, float16 or auto")
    group.add_argument("--attention-backend", help="auto (flashinfer where it takes the model, its decode steps "
                       "of at most 4 tokens on triton; else triton on CUDA; torch on CPU), torch, triton or "
                       "flashinfer (every row on flashinfer)")
    for flag in ("--max-num-batched-tokens", "--chunked-prefill-size", "--page-size", "--num-kv-pages",
                 "--max-num-seqs", "--max-model-len", "--seed"):
        group.add_argument(flag, type=int)
    for name in GRAPH_SIZES:  # the graph keys' buckets: fewer start sooner (EngineConfig's docstring)
        group.add_argument("--" + name.replace("_", "-"), type=_sizes, default=None, metavar="N,N,...",
                           help=f"EngineConfig.{name}, comma-separated ('' for none)")
    group.add_argument("--no-mixed-batch", dest="enable_mixed_batch", action="store_false", default=None,
                       help="run prefill-only and decode-only steps")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                       help="compute every prompt in full (default: start from KV pages cached for the same "
                            "leading tokens)")
    group.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                       help="run the model eagerly (default: compiled on CUDA)")
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                       help="do not capture CUDA graphs (default: captured on CUDA)")
    group.add_argument("--graph-cache-dir", help="root of the compiled-graph cache (default: "
                       "$XDG_CACHE_HOME/encore/graphs, else ~/.cache/encore/graphs)")
    group.add_argument("--no-overlap-schedule", dest="overlap_schedule", action="store_false", default=None,
                       help="read each step's tokens before launching the next (default on CUDA: the next step "
                            "is launched while the device runs the previous one)")
    group.add_argument("--speculative-method", choices=("mtp", "eagle3", "ngram"),
                       help="speculative decoding with the checkpoint's MTP layer, an EAGLE-3 drafter or n-gram lookup")
    group.add_argument("--draft-model", help="the EAGLE-3 draft model's directory (--speculative-method eagle3)")
    group.add_argument("--num-speculative-tokens", type=int, default=2, help="drafts per step (default: %(default)s)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Engine(**these) from ``add_engine_args``'s options: the model (default: encore-tiny's directory),
    the device, and every option that was given."""
    from encore.models.tiny import default_model_dir

    kwargs = {"model": args.model or str(default_model_dir()), "device": args.device}
    kwargs.update({name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name) is not None})
    if args.speculative_method:
        kwargs["speculative"] = {"method": args.speculative_method, "draft_model": args.draft_model,
                                 "num_speculative_tokens": args.num_speculative_tokens}
    return kwargs
