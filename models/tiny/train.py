"""Train encore-tiny from scratch and write it as a DeepSeek-V3-format checkpoint.

    python -m encore.models.tiny.train --out DIR [--minutes 10] [--device cuda] [--steps N] [--seed 0] ...

Everything is offline: the corpus is the running interpreter's standard library (corpus.py), the tokenizer
is trained here (tokenizer.py), the model is transformers' `DeepseekV3ForCausalLM` plus one MTP layer
(mtp.py). Precision: fp32 master weights and AdamW state, bf16 autocast for the forward on CUDA (plain fp32
on CPU); the checkpoint is bf16. Loss = main CE + mtp_weight * MTP CE, with mtp_weight 0.3 by default:
DeepSeek-V3 used 0.3 for its first 10T tokens and 0.1 after, and this run is all "early". Router biases get
DeepSeek-V3's auxiliary-loss-free update (balance.py).

`--minutes` bounds the training loop. Without `--steps`, the step count for the cosine schedule is fixed
after timing the first steps and recorded in report.json; rerun with `--steps N` to repeat that schedule.
"""

import argparse
import json
import math
import platform
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers

from encore.models.tiny.balance import ExpertBiasBalancer
from encore.models.tiny.checkpoint import bf16_main_model, check_reload, greedy, save_checkpoint
from encore.models.tiny.config import TinyModelConfig
from encore.models.tiny.corpus import (
    WindowSampler,
    sequential_windows,
    split_heldout,
    stdlib_root,
    stdlib_sources,
    token_stream,
)
from encore.models.tiny.mtp import DeepseekV3WithMTP
from encore.models.tiny.tokenizer import BOS, EOS, PAD, save_tokenizer, train_tokenizer

PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
# Steps timed to size the schedule when --steps is not given: the first few include CUDA/cuBLAS warm-up.
TIMING_FROM, TIMING_TO = 5, 25
QUICK_EVAL_WINDOWS = 32


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """One training run; every field is a CLI flag (`seq_len` is `--seq-len`) with this default."""

    out: Path
    minutes: float = 10.0
    steps: int | None = None
    device: str = "cuda"
    seed: int = 0
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    bias_update_rate: float = 1e-3  # DeepSeek-V3's gamma
    corpus_mb: float = 40.0
    heldout_every: int = 50
    eval_windows: int = 512
    eval_every: int = 500  # steps between quick held-out checks (over-fitting shows there); 0 disables
    log_every: int = 50
    max_new_tokens: int = 48
    experts: str = "grouped_mm"  # transformers' experts implementation on CUDA ("eager" loops per expert)

    def __post_init__(self) -> None:
        positive = (
            "minutes", "seq_len", "batch_size", "lr", "corpus_mb", "eval_windows", "log_every", "max_new_tokens",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"steps={self.steps} must be > 0 (or omitted to fit --minutes)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.experts not in ("eager", "grouped_mm", "batched_mm"):
            raise ValueError(f"experts={self.experts!r} must be 'eager', 'grouped_mm' or 'batched_mm'")
        if min(self.warmup_steps, self.eval_every, self.mtp_weight, self.weight_decay) < 0 or self.grad_clip <= 0:
            raise ValueError("warmup_steps, eval_every, mtp_weight and weight_decay must be >= 0 and grad_clip > 0")

    def summary(self) -> dict:
        return {**asdict(self), "out": str(self.out)}


def lr_at(step: int, total: int | None, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine from lr to lr * min_lr_ratio at `total` (peak while `total` is unknown)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if total is None or total <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; norms and biases (1-D) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model: DeepseekV3WithMTP, stream: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig) -> dict:
    """Train until `cfg.steps` (or the schedule sized to `cfg.minutes`) or the time budget runs out."""
    device = stream.device
    curve: list[dict[str, float]] = []  # held-out loss over QUICK_EVAL_WINDOWS windows, every eval_every steps
    sampler = WindowSampler(stream, cfg.seq_len + 2, seed=cfg.seed)
    optimizer = make_optimizer(model, cfg)
    balancer = ExpertBiasBalancer(model, cfg.bias_update_rate)
    budget_s, total, step, eval_s = cfg.minutes * 60, cfg.steps, 0, 0.0
    tokens_per_step = cfg.batch_size * cfg.seq_len
    model.train()
    start = time.perf_counter()
    while total is None or step < total:
        lr = lr_at(step, total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sampler.sample(cfg.batch_size)  # [B, T + 2]
        balancer.reset()
        with autocast(device):
            _, _, main_loss, mtp_loss = model(batch)
        loss = main_loss + cfg.mtp_weight * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        balancer.update()
        max_violation = balancer.max_violation()  # read now: evaluation below also passes through the routers
        step += 1

        if step == TIMING_FROM:
            _sync(device)
            timing_start = time.perf_counter()
        if total is None and step == TIMING_TO:
            _sync(device)
            now = time.perf_counter()
            step_s = (now - timing_start) / (TIMING_TO - TIMING_FROM)
            total = step + max(1, int((budget_s - (now - start)) / step_s))
            print(f"timed {step_s * 1e3:.1f} ms/step: schedule set to {total} steps", flush=True)
        elapsed = time.perf_counter() - start
        if step % cfg.log_every == 0 or step == total:
            print(
                f"step {step:>6}/{total or '?'}  {step * tokens_per_step / (elapsed - eval_s):>9,.0f} tok/s  "
                f"loss {main_loss.item():.4f}  mtp {mtp_loss.item():.4f}  lr {lr:.2e}  "
                f"maxvio {max_violation:.2f}  {elapsed:6.0f}s",
                flush=True,
            )
        if cfg.eval_every and step % cfg.eval_every == 0:
            eval_start = time.perf_counter()
            quick = evaluate(model, heldout, cfg, max_windows=QUICK_EVAL_WINDOWS)
            eval_s += time.perf_counter() - eval_start
            curve.append({"step": step, "loss": quick["loss"], "mtp_loss": quick["mtp_loss"]})
            print(f"step {step:>6}  held-out loss {quick['loss']:.4f}  mtp {quick['mtp_loss']:.4f}", flush=True)
        if elapsed > budget_s:
            print(f"time budget of {cfg.minutes} min reached at step {step}", flush=True)
            break
    _sync(device)
    seconds = time.perf_counter() - start
    balancer.close()
    return {
        "steps": step,
        "planned_steps": total,
        "train_tokens": step * tokens_per_step,
        "train_seconds": round(seconds, 2),  # including the quick held-out checks
        "tokens_per_s": round(step * tokens_per_step / (seconds - eval_s), 1),
        "final_loss": main_loss.item(),
        "final_mtp_loss": mtp_loss.item(),
        "expert_load_max_violation": max_violation,  # of the last step
        "heldout_curve": curve,
    }


@torch.no_grad()
def evaluate(model: DeepseekV3WithMTP, stream: torch.Tensor, cfg: TrainConfig, max_windows: int) -> dict:
    """Held-out loss/perplexity of the main model, and how good the MTP layer is as a 1-token drafter."""
    windows = sequential_windows(stream, cfg.seq_len + 2, stride=cfg.seq_len)[:max_windows]
    model.eval()
    main_nll = mtp_nll = mtp_hits = agree = 0.0
    count = agree_count = 0
    for batch in windows.split(cfg.batch_size):
        with autocast(stream.device):
            logits, mtp_logits, main_loss, mtp_loss = model(batch)
        n = batch[:, 2:].numel()
        main_nll += main_loss.item() * n
        mtp_nll += mtp_loss.item() * n
        mtp_pred, main_pred = mtp_logits.argmax(-1), logits.argmax(-1)  # [B, T]: for t_{i+2}, for t_{i+1}
        mtp_hits += (mtp_pred == batch[:, 2:]).sum().item()
        # A greedy verifier accepts the draft for t_{i+2} iff it equals the main model's argmax at i+1.
        agree += (mtp_pred[:, :-1] == main_pred[:, 1:]).sum().item()
        count, agree_count = count + n, agree_count + mtp_pred[:, :-1].numel()
    model.train()
    loss = main_nll / count
    return {
        "eval_tokens": count,
        "loss": loss,
        "perplexity": math.exp(loss),
        "mtp_loss": mtp_nll / count,
        "mtp_top1_accuracy": mtp_hits / count,
        "mtp_greedy_acceptance": agree / agree_count,
    }


def run(cfg: TrainConfig, model_cfg: TinyModelConfig | None = None) -> dict:
    """The whole pipeline: corpus, tokenizer, training, evaluation, checkpoint, reload check, report.json."""
    model_cfg = TinyModelConfig() if model_cfg is None else model_cfg
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg.device}: CUDA is not available here; pass --device cpu")
    wall_start = time.perf_counter()
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)

    corpus = split_heldout(stdlib_sources(max_bytes=int(cfg.corpus_mb * 1e6)), cfg.heldout_every)
    tokenizer = train_tokenizer([f.text for f in corpus.train], model_cfg.vocab_size)
    bos, eos, pad = (tokenizer.token_to_id(t) for t in (BOS, EOS, PAD))
    train_stream = token_stream(tokenizer, corpus.train, bos, eos).to(device)
    heldout_stream = token_stream(tokenizer, corpus.heldout, bos, eos).to(device)
    corpus_info = {**corpus.summary(), "train_tokens": train_stream.numel(), "heldout_tokens": heldout_stream.numel()}
    print(f"corpus {stdlib_root()}: {json.dumps(corpus_info)}", flush=True)

    hf_config = model_cfg.to_hf(bos, eos, pad)
    if device.type == "cuda":
        hf_config._experts_implementation = cfg.experts
    model = DeepseekV3WithMTP(hf_config).to(device)
    print(f"model: {model.parameter_count():,} trainable parameters, device {device}", flush=True)
    train_info = train(model, train_stream, heldout_stream, cfg)
    heldout = evaluate(model, heldout_stream, cfg, max_windows=cfg.eval_windows)

    cfg.out.mkdir(parents=True, exist_ok=True)
    shipped = bf16_main_model(model)
    prompts = [torch.tensor([tokenizer.encode(p).ids], device=device) for p in PROMPTS]
    completions = [greedy(shipped, p, cfg.max_new_tokens) for p in prompts]
    save_checkpoint(model, shipped, cfg.out)
    save_tokenizer(tokenizer, cfg.out, model_max_length=model_cfg.max_position_embeddings)
    reload = check_reload(cfg.out, completions, prompts, cfg.max_new_tokens)

    files = {p.name: p.stat().st_size for p in sorted(cfg.out.iterdir()) if p.name != "report.json"}
    report = {
        "model": model_cfg.summary(),
        "train_config": cfg.summary(),
        "parameters": {
            "trainable": model.parameter_count(),
            "main_model": sum(p.numel() for p in model.main.parameters()),
            "mtp_layer_own": sum(p.numel() for p in model.mtp.parameters()),
        },
        "checkpoint_bytes": {**files, "total": sum(files.values())},
        "corpus": {**corpus_info, "root": str(stdlib_root())},
        "tokenizer_vocab_size": tokenizer.get_vocab_size(),
        **train_info,
        "wall_seconds": round(time.perf_counter() - wall_start, 2),
        "heldout": heldout,
        "completions": {p: tokenizer.decode(ids, skip_special_tokens=False) for p, ids in zip(PROMPTS, completions)},
        "reload": asdict(reload),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    (cfg.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _print_summary(report)
    return report


def _print_summary(report: dict) -> None:
    heldout, reload = report["heldout"], report["reload"]
    print("\n=== encore-tiny ===")
    print(f"parameters     {report['parameters']['trainable']:,} trainable; checkpoint "
          f"{report['checkpoint_bytes']['total'] / 1e6:.2f} MB")
    print(f"training       {report['steps']} steps, {report['train_tokens']:,} tokens, "
          f"{report['tokens_per_s']:,.0f} tok/s, {report['train_seconds']:.0f} s (wall {report['wall_seconds']:.0f} s)")
    print(f"held-out       loss {heldout['loss']:.4f}  ppl {heldout['perplexity']:.2f}  mtp loss "
          f"{heldout['mtp_loss']:.4f}  mtp greedy acceptance {heldout['mtp_greedy_acceptance']:.3f}")
    print(f"reload         same greedy tokens: {reload['same_greedy_tokens']}; "
          f"{reload['unexpected_key_count']} MTP keys not loaded by DeepseekV3ForCausalLM "
          f"(all MTP: {reload['unexpected_keys_are_the_mtp_layer']}); missing: {reload['missing_keys'] or 'none'}")
    for prompt, text in report["completions"].items():
        print(f"--- {prompt!r}\n{prompt}{text}")
    print(f"report         {report['train_config']['out']}/report.json")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    defaults = TrainConfig(out=Path("."))
    parser = argparse.ArgumentParser(prog="python -m encore.models.tiny.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory (created)")
    parser.add_argument("--steps", type=int, default=None, help="exact step count (default: fit --minutes)")
    for field in ("minutes", "device", "seed", "seq_len", "batch_size", "lr", "min_lr_ratio", "warmup_steps",
                  "weight_decay", "grad_clip", "mtp_weight", "bias_update_rate", "corpus_mb", "heldout_every",
                  "eval_windows", "eval_every", "log_every", "max_new_tokens", "experts"):
        default = getattr(defaults, field)
        flag = f"--{field.replace('_', '-')}"
        parser.add_argument(flag, type=type(default), default=default, help=f"default {default}")
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    report = run(parse_args(argv))
    if not report["reload"]["same_greedy_tokens"]:
        sys.exit("reloaded checkpoint does not reproduce the in-memory model's greedy tokens")


if __name__ == "__main__":
    main()
