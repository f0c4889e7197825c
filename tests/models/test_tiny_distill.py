"""MTP distillation of encore-tiny (models/tiny/distill.py): CPU-only, a toy model, a few steps."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from encore.models.tiny import distill
from encore.models.tiny.checkpoint import (
    WEIGHTS_FILE,
    bf16_main_model,
    load_checkpoint,
    replace_mtp_layer,
    save_checkpoint,
)
from encore.models.tiny.distill import (
    DistillConfig,
    chain_acceptance,
    continue_prefixes,
    distill_losses,
    parse_args,
)
from encore.models.tiny.mtp import chained_passes, draft_chain_mask
from encore.models.tiny.train import TrainConfig, make_optimizer, run
from test_tiny_train import TOY, toy_model

MTP = f"model.layers.{TOY.num_hidden_layers}."


def perturbed_toy(seed: int = 0):
    """A toy model with non-trivial weights everywhere (norms and biases included), in eval mode."""
    model = toy_model(seed).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    run(TrainConfig(out=out, device="cpu", steps=4, seq_len=32, batch_size=2, warmup_steps=1, corpus_mb=0.3,
                    heldout_every=4, eval_windows=2, eval_every=0, log_every=10, max_new_tokens=4), TOY)
    return out


def test_chained_passes_are_the_drafts_a_sequential_decode_makes() -> None:
    """Pass m at position j equals what drafting from base b = j - m + 1 computes one step at a time: a causal
    sequence of pass 1's inputs at 0..b, then each later pass's input (the previous pass's state at the
    position before, and the token embedding) appended, recomputed with plain causal attention."""
    model = perturbed_toy()
    length, depth, hidden_size = 10, 4, TOY.hidden_size
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, length, hidden_size, generator=g)
    embeds = torch.randn(2, length, hidden_size, generator=g)
    rotary = model.main.model.rotary_emb
    with torch.no_grad():
        states = chained_passes(model.mtp, hidden, embeds, rotary(hidden, torch.arange(length)[None]), depth)
        checked = 0
        for base in range(length):
            xs = model.mtp.combine(hidden[:, :base + 1], embeds[:, :base + 1])
            state = model.mtp.decode(xs, rotary(xs, torch.arange(base + 1)[None]))[:, -1:]
            torch.testing.assert_close(state[:, 0], states[0][:, base], rtol=1e-5, atol=1e-5)
            for m in range(2, min(depth, length - base) + 1):
                j = base + m - 1
                xs = torch.cat([xs, model.mtp.combine(state, embeds[:, j:j + 1])], dim=1)
                state = model.mtp.decode(xs, rotary(xs, torch.arange(j + 1)[None]))[:, -1:]
                torch.testing.assert_close(state[:, 0], states[m - 1][:, j], rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked == sum(min(depth, length - b) - 1 for b in range(length))


def test_draft_chain_mask_by_hand() -> None:
    """Two passes over three positions: pass 2 at j reads pass 1 up to j - 1 and its own key at j."""
    expected = torch.tensor([
        # pass 1 keys | pass 2 keys
        [1, 0, 0, 0, 0, 0],  # pass 1, j = 0
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],  # pass 2, j = 0: no base, its own key only
        [1, 0, 0, 0, 1, 0],  # pass 2, j = 1: base 0
        [1, 1, 0, 0, 0, 1],  # pass 2, j = 2: base 1
    ], dtype=torch.bool)
    assert torch.equal(draft_chain_mask(3, 2), expected)


def test_load_checkpoint_round_trips(tmp_path: Path) -> None:
    model = perturbed_toy()
    save_checkpoint(model, bf16_main_model(model), tmp_path)
    loaded = load_checkpoint(tmp_path)
    for (name, saved), (loaded_name, back) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert name == loaded_name
        stored = saved if saved.dtype != torch.float32 or "bias" in name or "inv_freq" in name else saved.bfloat16()
        assert torch.equal(stored.float(), back.float()), name


def test_replace_mtp_layer_changes_that_layer_alone(tmp_path: Path) -> None:
    model = perturbed_toy()
    src, out = tmp_path / "src", tmp_path / "out"
    save_checkpoint(model, bf16_main_model(model), src)
    (src / "report.json").write_text("{}")
    with torch.no_grad():
        for p in model.mtp.parameters():
            p.add_(0.5)
    replace_mtp_layer(model, src, out)
    before, after = load_file(src / WEIGHTS_FILE), load_file(out / WEIGHTS_FILE)
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(MTP) for k in changed)
    assert {p.name for p in out.iterdir()} == {p.name for p in src.iterdir()} - {"report.json"}
    with torch.no_grad():
        model.main.lm_head.weight.add_(1.0)
    with pytest.raises(ValueError, match="shared_head.head.weight"):
        replace_mtp_layer(model, src, tmp_path / "bad")


def test_continue_prefixes_greedy_is_generate() -> None:
    model = perturbed_toy()
    prefixes = torch.randint(3, TOY.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    ours = continue_prefixes(model, prefixes, 6, None, 2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.main.generate(prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=6,
                                  do_sample=False, eos_token_id=None, pad_token_id=2)
    assert torch.equal(ours, ref)
    sampled = continue_prefixes(model, prefixes, 6, 1.0, 2, torch.Generator().manual_seed(0))
    assert sampled.shape == ours.shape and torch.equal(sampled[:, :5], prefixes)


def test_chain_acceptance_counts_leading_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With drafts whose hits are set by hand, the metric is the capped run of leading hits over k."""
    vocab, length, depth = 8, 6, 3
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 1]])  # [1, T + 2]
    hit = {(0, 1): True, (1, 2): True, (2, 3): False,  # base 1: passes 1, 2 hit, pass 3 misses -> 2
           (0, 2): True, (1, 3): False, (2, 4): True,  # base 2: -> 1
           (0, 3): False, (1, 4): True, (2, 5): True}  # base 3: -> 0

    def fake_draft_logits(model, chunk, d):
        logits = [torch.zeros(1, length, vocab) for _ in range(d)]
        for (m, j), ok in hit.items():
            target = chunk[0, j + 2].item()
            logits[m][0, j, target if ok else (target + 1) % vocab] = 1.0
        return logits, None

    monkeypatch.setattr(distill, "draft_logits", fake_draft_logits)
    got = chain_acceptance(None, tokens, start=2, depth=depth, batch=4)
    assert got["bases"] == 3  # bases 1, 2, 3: start - 1 up to T - depth
    lead = [2, 1, 0]
    for k in (1, 2, 3):
        assert got["acceptance_by_k"][k] == pytest.approx(sum(min(a, k) for a in lead) / (3 * k))
    assert got["conditional_hit_by_pass"] == pytest.approx([2 / 3, 1 / 2, 0.0])


def test_distillation_lowers_the_divergence_on_a_fixed_batch() -> None:
    model = perturbed_toy()
    model.main.requires_grad_(False)
    optimizer = make_optimizer(model.mtp, DistillConfig(model=Path("."), out=Path("."), lr=1e-2))
    tokens = torch.randint(3, TOY.vocab_size, (2, 18), generator=torch.Generator().manual_seed(3))
    kls = []
    for _ in range(10):
        ce, kl = distill_losses(model, tokens, 3)
        kls.append(kl)
        optimizer.zero_grad()
        ce.mean().backward()
        optimizer.step()
    assert all(p.grad is None for p in model.main.parameters())
    assert (kls[-1] < 0.8 * kls[0]).all(), (kls[0], kls[-1])


def test_run_replaces_the_mtp_layer_and_reports(toy_checkpoint: Path, tmp_path: Path) -> None:
    cfg = DistillConfig(model=toy_checkpoint, out=tmp_path, device="cpu", depth=2, steps=3, batch_size=4,
                        seq_len=24, prefix_len=6, sequences=6, generate_batch=4, eval_sequences=3, corpus_mb=0.3,
                        heldout_every=4, log_every=1, warmup_steps=1)
    entry = distill.run(cfg)
    assert entry["steps"] == 3 and [p["step"] for p in entry["curve"]] == [1, 2, 3]
    assert entry["data"] == {"continuations": 6, "sampled": 3, "greedy": 3, "tokens": 6 * 26,
                             "generate_seconds": entry["data"]["generate_seconds"]}
    for when in ("heldout_greedy_before", "heldout_greedy_after"):
        assert set(entry[when]["acceptance_by_k"]) == {1, 2}
        assert entry[when]["bases"] == 3 * len(range(6 - 1, 24 - 2 + 1))  # bases from the prefix to T - depth
    before, after = load_file(toy_checkpoint / WEIGHTS_FILE), load_file(tmp_path / WEIGHTS_FILE)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(MTP) for k in changed)
    report = json.loads((tmp_path / "report.json").read_text())
    assert "heldout" in report and report["mtp_distillation"] == [json.loads(json.dumps(entry))]  # train.py's, extended
    again = distill.run(replace(cfg, model=tmp_path, out=tmp_path / "again"))  # from the distilled checkpoint
    runs = json.loads((tmp_path / "again" / "report.json").read_text())["mtp_distillation"]
    assert [run["config"]["model"] for run in runs] == [str(toy_checkpoint), str(tmp_path)]
    assert runs[1] == json.loads(json.dumps(again))


def test_cli_flags_and_bad_values() -> None:
    cfg = parse_args(["--model", "a", "--out", "b", "--depth", "3", "--sample-fraction", "0.25", "--device", "cpu"])
    assert (cfg.model, cfg.out, cfg.depth, cfg.sample_fraction, cfg.device) == (Path("a"), Path("b"), 3, 0.25, "cpu")
    with pytest.raises(ValueError, match="depth=0"):
        DistillConfig(model=Path("."), out=Path("."), depth=0)
    with pytest.raises(ValueError, match="prefix_len=512"):
        DistillConfig(model=Path("."), out=Path("."), prefix_len=512)
    with pytest.raises(ValueError, match="corpus_fraction=1"):
        DistillConfig(model=Path("."), out=Path("."), corpus_fraction=1.0)
