"""Distil encore-tiny's MTP layer into the drafter encore runs: k passes deep, matching the target's choices.

    python -m encore.models.tiny.distill --model DIR --out DIR [--depth 4] [--steps 800] [--device cuda] ...

`train.py` trains the MTP layer together with the model, one pass deep, on the corpus's next-next token. encore
drafts with it k passes deep (engine/spec/speculator.py): pass m > 1 is fed pass m - 1's normed state and its
own draft, and a draft counts only when it equals the target's token. This script fine-tunes the MTP layer
alone for that use (EAGLE-3's training-time test, Medusa-2's self-distillation), from the shipped weights:

- the main model, the embedding and the head are frozen: the main model's tensors are written back unchanged,
  so its outputs are too;
- inputs: corpus prefixes continued by the target itself, greedily and sampled at temperature 1 (what
  verification accepts), plus plain corpus windows (what prompts look like);
- targets: the target's own next-token distribution at each position (soft cross-entropy, i.e. forward KL),
  not the corpus token;
- passes 1..depth unrolled exactly as a depth-deep draft runs them (`mtp.chained_passes`, equal weights).

Held-out prefixes continued greedily by the target measure, before and after, what greedy verification
would accept at each base position for k = 1..depth (`chain_acceptance`). The checkpoint written to `--out`
is `--model`'s with the MTP layer's tensors replaced (`checkpoint.replace_mtp_layer`), and this run is appended to
its report.json's `mtp_distillation` list.
"""

import argparse
import inspect
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM

from encore.models.tiny.checkpoint import load_checkpoint, replace_mtp_layer
from encore.models.tiny.corpus import WindowSampler, split_heldout, stdlib_sources, token_stream
from encore.models.tiny.mtp import DeepseekV3WithMTP, chained_passes
from encore.models.tiny.tokenizer import BOS, EOS
from encore.models.tiny.train import autocast, lr_at, make_optimizer

# transformers 5.24 renamed the forward's and its output's `past_key_values` to `cache` (the old name warns).
_CACHE = "cache" if "cache" in inspect.signature(DeepseekV3ForCausalLM.forward).parameters else "past_key_values"


@dataclass(frozen=True, slots=True)
class DistillConfig:
    """One distillation run; every field is a CLI flag (`seq_len` is `--seq-len`) with this default."""

    model: Path
    out: Path
    device: str = "cuda"
    seed: int = 0
    depth: int = 4  # passes trained and evaluated: drafts k = 1..depth
    steps: int = 800
    batch_size: int = 32
    seq_len: int = 512  # positions trained per sequence (a sequence holds seq_len + 2 tokens)
    prefix_len: int = 32  # corpus tokens before the target's continuation
    sequences: int = 4096  # continued by the target for training
    sample_fraction: float = 0.5  # of those sampled at temperature 1; the rest greedy
    corpus_fraction: float = 0.25  # of each batch: plain corpus windows
    generate_batch: int = 512
    eval_sequences: int = 256  # held-out prefixes continued greedily
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    corpus_mb: float = 40.0  # as train.py: the same files, the same held-out split
    heldout_every: int = 50
    log_every: int = 50

    def __post_init__(self) -> None:
        positive = ("depth", "steps", "batch_size", "seq_len", "prefix_len", "sequences", "generate_batch",
                    "eval_sequences", "lr", "corpus_mb", "log_every")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.prefix_len >= self.seq_len:
            raise ValueError(f"prefix_len={self.prefix_len} must be below seq_len={self.seq_len}")
        for name in ("sample_fraction", "corpus_fraction", "min_lr_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.corpus_fraction == 1:
            raise ValueError("corpus_fraction=1 leaves no room for the target's continuations")
        if min(self.warmup_steps, self.weight_decay) < 0 or self.grad_clip <= 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0 and grad_clip > 0")

    def summary(self) -> dict:
        return {**asdict(self), "model": str(self.model), "out": str(self.out)}


@torch.no_grad()
def continue_prefixes(model: DeepseekV3WithMTP, prefixes: torch.Tensor, new_tokens: int,
                      temperature: float | None, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Each prefix [N, P] continued by the main model for `new_tokens` tokens, greedily (`temperature` None) or
    sampled; no stop at EOS (the engine's `ignore_eos`). [N, P + new_tokens]"""
    device = prefixes.device
    chunks = []
    for chunk in prefixes.split(batch):
        with autocast(device):
            out = model.main(input_ids=chunk, use_cache=True)
        tokens = [chunk]
        for step in range(new_tokens):
            logits = out.logits[:, -1].float()  # [n, V]
            if temperature is None:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
            tokens.append(nxt)
            if step + 1 < new_tokens:
                with autocast(device):
                    out = model.main(input_ids=nxt, use_cache=True, **{_CACHE: getattr(out, _CACHE)})
        chunks.append(torch.cat(tokens, dim=1))
    return torch.cat(chunks)


def draft_logits(model: DeepseekV3WithMTP, tokens: torch.Tensor, depth: int
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """For sequences [B, T + 2]: the MTP passes' logits [B, T, V] each (pass m at position j drafts t_{j+2} from
    base j - m + 1) and the target's log-probabilities of t_{j+2}, [B, T, V] float32 (its state at j + 1)."""
    length = tokens.shape[1] - 2
    main = model.main
    with torch.no_grad():
        hidden = main.model(input_ids=tokens[:, :-1], use_cache=False).last_hidden_state  # [B, T + 1, H], final-normed
        teacher = torch.log_softmax(main.lm_head(hidden[:, 1:]).float(), dim=-1)  # [B, T, V]
    hidden = hidden[:, :length]
    next_embeds = main.model.embed_tokens(tokens[:, 1:length + 1])  # [B, T, H]
    positions = torch.arange(length, device=tokens.device)[None]  # [1, T]
    states = chained_passes(model.mtp, hidden, next_embeds, main.model.rotary_emb(hidden, positions), depth)
    return [main.lm_head(s) for s in states], teacher


def distill_losses(model: DeepseekV3WithMTP, tokens: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pass: soft cross-entropy against the target's distribution [depth], and the KL divergence (the same
    minus the target's entropy, for the log), over the positions where that pass has a base (j >= m - 1)."""
    logits, teacher = draft_logits(model, tokens, depth)
    ce, kl = [], []
    for m, pass_logits in enumerate(logits):
        target = teacher[:, m:]  # [B, T - m, V]
        p = target.exp()
        soft = -(p * torch.log_softmax(pass_logits[:, m:].float(), dim=-1)).sum(-1).mean()
        ce.append(soft)
        kl.append(soft.detach() + (p * target).sum(-1).mean())
    return torch.stack(ce), torch.stack(kl)


@torch.no_grad()
def chain_acceptance(model: DeepseekV3WithMTP, sequences: torch.Tensor, start: int, depth: int, batch: int) -> dict:
    """What greedy verification accepts from a depth-deep draft at every base position of `sequences` [N, T + 2],
    whose tokens from `start` on are the target's greedy continuation (so the token after each base, and each
    draft that matches, is what the target verified): drafts accepted per verify step, capped at k, over k.
    Also each pass's hit rate given that the passes before it hit (`conditional`)."""
    length = sequences.shape[1] - 2
    accepted = []  # [bases] per chunk: leading passes that hit
    for chunk in sequences.split(batch):
        with autocast(chunk.device):
            logits, _ = draft_logits(model, chunk, depth)
        bases = torch.arange(start - 1, length - depth + 1, device=chunk.device)  # pass m reads j = base + m - 1
        hits = torch.stack([logits[m][:, bases + m].argmax(-1) == chunk[:, bases + m + 2] for m in range(depth)], -1)
        accepted.append(hits.long().cumprod(-1).sum(-1).flatten())  # [n * bases]
    lead = torch.cat(accepted)
    by_k = {k: (lead.clamp(max=k).float().mean() / k).item() for k in range(1, depth + 1)}
    conditional = [((lead >= m + 1).sum() / (lead >= m).sum()).item() for m in range(depth)]
    return {"acceptance_by_k": by_k, "mean_accepted_length_by_k": {k: 1 + v * k for k, v in by_k.items()},
            "conditional_hit_by_pass": conditional, "bases": lead.numel()}


def corpus_streams(model_dir: Path, cfg: DistillConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """train.py's corpus and held-out split, tokenized by the checkpoint's own tokenizer. Two [N] id streams."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    corpus = split_heldout(stdlib_sources(max_bytes=int(cfg.corpus_mb * 1e6)), cfg.heldout_every)
    return (token_stream(tokenizer, corpus.train, bos, eos).to(device),
            token_stream(tokenizer, corpus.heldout, bos, eos).to(device))


def run(cfg: DistillConfig) -> dict:
    """Data, evaluation before, training, evaluation after, checkpoint; returns the report entry."""
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg.device}: CUDA is not available here; pass --device cpu")
    wall = time.perf_counter()
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    model = load_checkpoint(cfg.model, device)
    model.main.requires_grad_(False)
    train_stream, heldout_stream = corpus_streams(cfg.model, cfg, device)
    new_tokens = cfg.seq_len + 2 - cfg.prefix_len

    start = time.perf_counter()
    prefixes = WindowSampler(train_stream, cfg.prefix_len, seed=cfg.seed).sample(cfg.sequences)
    sampled = round(cfg.sequences * cfg.sample_fraction)
    pool = torch.cat([continue_prefixes(model, prefixes[:sampled], new_tokens, 1.0, cfg.generate_batch, generator),
                      continue_prefixes(model, prefixes[sampled:], new_tokens, None, cfg.generate_batch, generator)])
    held = WindowSampler(heldout_stream, cfg.prefix_len, seed=cfg.seed + 1).sample(cfg.eval_sequences)
    eval_set = continue_prefixes(model, held, new_tokens, None, cfg.generate_batch, generator)
    generate_s = time.perf_counter() - start
    print(f"generated {pool.shape[0]} + {eval_set.shape[0]} continuations of {new_tokens} tokens in "
          f"{generate_s:.0f} s", flush=True)

    model.eval()
    before = chain_acceptance(model, eval_set, cfg.prefix_len, cfg.depth, cfg.batch_size)
    print(f"before: acceptance by k {_fmt(before['acceptance_by_k'])}", flush=True)
    train_info = train(model, pool, train_stream, cfg)
    model.eval()
    after = chain_acceptance(model, eval_set, cfg.prefix_len, cfg.depth, cfg.batch_size)
    print(f"after:  acceptance by k {_fmt(after['acceptance_by_k'])}", flush=True)

    entry = {
        "config": cfg.summary(),
        "data": {"continuations": pool.shape[0], "sampled": sampled, "greedy": pool.shape[0] - sampled,
                 "tokens": pool.numel(), "generate_seconds": round(generate_s, 1)},
        **train_info,
        "heldout_greedy_before": before,
        "heldout_greedy_after": after,
        "wall_seconds": round(time.perf_counter() - wall, 1),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    replace_mtp_layer(model, cfg.model, cfg.out)
    report_path = cfg.model / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    runs = report.get("mtp_distillation", []) + [entry]  # a run may start from an earlier run's checkpoint
    (cfg.out / "report.json").write_text(json.dumps({**report, "mtp_distillation": runs}, indent=2) + "\n")
    print(f"checkpoint     {cfg.out} (report.json: mtp_distillation)", flush=True)
    return entry


def train(model: DeepseekV3WithMTP, pool: torch.Tensor, corpus: torch.Tensor, cfg: DistillConfig) -> dict:
    """`cfg.steps` AdamW steps on the MTP layer; each batch draws continuations from `pool` [N, T + 2] and
    fills `corpus_fraction` of its rows with corpus windows."""
    device = pool.device
    windows = WindowSampler(corpus, cfg.seq_len + 2, seed=cfg.seed + 2)
    picks = torch.Generator().manual_seed(cfg.seed + 3)
    from_corpus = round(cfg.batch_size * cfg.corpus_fraction)
    optimizer = make_optimizer(model.mtp, cfg)
    model.mtp.train()
    curve = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg)
        rows = torch.randint(0, pool.shape[0], (cfg.batch_size - from_corpus,), generator=picks).to(device)
        batch = torch.cat([pool[rows], windows.sample(from_corpus)]) if from_corpus else pool[rows]
        with autocast(device):
            ce, kl = distill_losses(model, batch, cfg.depth)
        loss = ce.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.mtp.parameters(), cfg.grad_clip)
        optimizer.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            kl_by_pass = [round(v, 4) for v in kl.tolist()]
            curve.append({"step": step + 1, "kl_by_pass": kl_by_pass})
            print(f"step {step + 1:>5}/{cfg.steps}  kl by pass {kl_by_pass}  lr {lr_at(step, cfg.steps, cfg):.2e}  "
                  f"{time.perf_counter() - start:5.0f}s", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return {"steps": cfg.steps, "train_seconds": round(seconds, 1),
            "positions_per_s": round(cfg.steps * cfg.batch_size * cfg.seq_len / seconds, 1), "curve": curve}


def _fmt(by_k: dict) -> str:
    return "  ".join(f"k={k} {v:.3f}" for k, v in by_k.items())


def parse_args(argv: list[str] | None = None) -> DistillConfig:
    defaults = DistillConfig(model=Path("."), out=Path("."))
    parser = argparse.ArgumentParser(prog="python -m encore.models.tiny.distill", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory to start from")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write (may be --model)")
    for field in DistillConfig.__dataclass_fields__:
        if field in ("model", "out"):
            continue
        default = getattr(defaults, field)
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default,
                            help=f"default {default}")
    return DistillConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
