"""encore-tiny training script (models/tiny): CPU-only, a toy model, a few steps."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, DeepseekV3ForCausalLM

from encore.models.tiny.balance import ExpertBiasBalancer
from encore.models.tiny.checkpoint import MTP_ONLY_TENSORS, bf16_main_model, save_checkpoint
from encore.models.tiny.config import TinyModelConfig
from encore.models.tiny.corpus import EXCLUDED_DIRS, WindowSampler, split_heldout, stdlib_sources
from encore.models.tiny.mtp import DeepseekV3WithMTP
from encore.models.tiny.train import PROMPTS, TIMING_TO, TrainConfig, lr_at, make_optimizer, parse_args, run, train

# Every architectural feature of the real config (MLA with q_lora, grouped sigmoid MoE, YaRN, MTP), at toy size.
TOY = TinyModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    moe_intermediate_size=16,
    max_position_embeddings=256,
    original_max_position_embeddings=64,
)
SOURCE = 'def f(xs):\n\t"""Tabs, ünïcode ✓ and  double  spaces."""\n    return [x ** 2 for x in xs]  # done\n\n'


def toy_model(seed: int = 0) -> DeepseekV3WithMTP:
    torch.manual_seed(seed)
    return DeepseekV3WithMTP(TOY.to_hf(bos_token_id=0, eos_token_id=1, pad_token_id=2))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One end-to-end run of the script's pipeline (corpus, tokenizer, train, eval, export, reload)."""
    out = tmp_path_factory.mktemp("encore-tiny")
    cfg = TrainConfig(
        out=out, device="cpu", steps=3, seq_len=32, batch_size=2, warmup_steps=1, corpus_mb=0.3,
        heldout_every=4, eval_windows=2, eval_every=2, log_every=1, max_new_tokens=4,
    )
    return out, run(cfg, TOY)


def test_run_reports_and_reloads_identically(trained: tuple[Path, dict]) -> None:
    out, report = trained
    assert {p.name for p in out.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "report.json",
    }
    assert json.loads((out / "report.json").read_text()) == report
    assert report["steps"] == 3 and report["train_tokens"] == 3 * 2 * 32
    assert set(report["completions"]) == set(PROMPTS)
    assert report["heldout"]["perplexity"] > 1
    assert [point["step"] for point in report["heldout_curve"]] == [2]
    # from_pretrained loads everything but the MTP layer, which it reports as unexpected, and matches greedily.
    # 22 = 7 attention + 7 MoE (experts fused by transformers' loader into 2) + 2 layer norms + 6 MTP-only.
    assert report["reload"] == {
        "same_greedy_tokens": True,
        "missing_keys": [],
        "unexpected_keys_are_the_mtp_layer": True,
        "unexpected_key_count": 22,
    }


def test_checkpoint_has_deepseek_v3_mtp_tensors(trained: tuple[Path, dict]) -> None:
    out, _ = trained
    c = TOY
    h, v, e, i = c.hidden_size, c.vocab_size, c.n_routed_experts, c.moe_intermediate_size
    expected = {
        "embed_tokens.weight": (v, h),
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (v, h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_a_proj.weight": (c.q_lora_rank, h),
        "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
        "self_attn.q_b_proj.weight": (c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
        "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        "self_attn.o_proj.weight": (h, c.num_attention_heads * c.v_head_dim),
        "mlp.gate.weight": (e, h),
        "mlp.gate.e_score_correction_bias": (e,),
        "mlp.shared_experts.gate_proj.weight": (i, h),
        "mlp.shared_experts.up_proj.weight": (i, h),
        "mlp.shared_experts.down_proj.weight": (h, i),
        **{f"mlp.experts.{x}.{p}_proj.weight": (i, h) for x in range(e) for p in ("gate", "up")},
        **{f"mlp.experts.{x}.down_proj.weight": (h, i) for x in range(e)},
    }
    assert set(MTP_ONLY_TENSORS) < expected.keys()
    mtp = f"model.layers.{c.num_hidden_layers}."
    with safe_open(out / "model.safetensors", "pt") as f:
        shapes = {k[len(mtp) :]: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith(mtp)}
        assert shapes == expected
        assert f.get_tensor(mtp + "mlp.gate.e_score_correction_bias").dtype == torch.float32
        assert f.get_tensor(mtp + "eh_proj.weight").dtype == torch.bfloat16
        # The MTP layer's embedding and head are copies of the main model's (shared while training).
        assert torch.equal(f.get_tensor(mtp + "embed_tokens.weight"), f.get_tensor("model.embed_tokens.weight"))
        assert torch.equal(f.get_tensor(mtp + "shared_head.head.weight"), f.get_tensor("lm_head.weight"))
    config = json.loads((out / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_interleave"] is True


def test_mtp_layer_loads_through_transformers_as_a_decoder_layer(trained: tuple[Path, dict]) -> None:
    """Read with one more layer, transformers' own loader (expert fusing included) maps the MTP layer's
    decoder tensors onto layer L: the per-expert names are the ones it expects."""
    out, _ = trained
    config = AutoConfig.from_pretrained(out)
    config.num_hidden_layers += 1
    model = DeepseekV3ForCausalLM.from_pretrained(out, config=config, dtype=torch.bfloat16)
    layer, mtp = model.model.layers[TOY.num_hidden_layers], f"model.layers.{TOY.num_hidden_layers}."
    with safe_open(out / "model.safetensors", "pt") as f:
        experts = range(TOY.n_routed_experts)
        gate = torch.stack([f.get_tensor(f"{mtp}mlp.experts.{x}.gate_proj.weight") for x in experts])
        up = torch.stack([f.get_tensor(f"{mtp}mlp.experts.{x}.up_proj.weight") for x in experts])
        down = torch.stack([f.get_tensor(f"{mtp}mlp.experts.{x}.down_proj.weight") for x in experts])
        assert torch.equal(layer.mlp.experts.gate_up_proj, torch.cat([gate, up], dim=1))
        assert torch.equal(layer.mlp.experts.down_proj, down)
        assert torch.equal(layer.self_attn.kv_b_proj.weight, f.get_tensor(mtp + "self_attn.kv_b_proj.weight"))
        bias = f.get_tensor(mtp + "mlp.gate.e_score_correction_bias")
        assert torch.equal(layer.mlp.gate.e_score_correction_bias, bias)


def test_shipped_model_is_numerically_what_from_pretrained_builds(tmp_path: Path) -> None:
    """The in-memory bf16 model the completions come from keeps fp32 buffers (RoPE frequencies, router biases)
    exactly as `from_pretrained(dtype=bf16)` does, so their logits agree bit for bit."""
    model = toy_model()
    shipped = bf16_main_model(model)
    save_checkpoint(model, shipped, tmp_path)
    loaded = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert {n: b.dtype for n, b in shipped.named_buffers()} == {n: b.dtype for n, b in loaded.named_buffers()}
    assert {b.dtype for n, b in shipped.named_buffers()} == {torch.float32}
    tokens = torch.randint(3, TOY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(shipped(tokens).logits, loaded(tokens).logits)


def test_tokenizer_round_trips_python_source(trained: tuple[Path, dict]) -> None:
    out, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|bos|>", "<|eos|>", "<|pad|>"]
    text = SOURCE + stdlib_sources(max_bytes=100_000)[0].text
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_loss_decreases_on_a_repeated_batch() -> None:
    model = toy_model()
    optimizer = make_optimizer(model, TrainConfig(out=Path("unused"), lr=1e-2))
    batch = torch.randint(3, TOY.vocab_size, (2, 34), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        _, _, main_loss, mtp_loss = model(batch)
        losses.append((main_loss.item(), mtp_loss.item()))
        optimizer.zero_grad()
        (main_loss + 0.3 * mtp_loss).backward()
        optimizer.step()
    (main_first, mtp_first), (main_last, mtp_last) = losses[0], losses[-1]
    assert main_last < 0.8 * main_first and mtp_last < 0.8 * mtp_first


def test_minutes_bound_the_loop_and_size_the_schedule() -> None:
    stream = torch.randint(3, TOY.vocab_size, (2000,), generator=torch.Generator().manual_seed(4))
    cfg = TrainConfig(
        out=Path("unused"), device="cpu", minutes=0.05, seq_len=16, batch_size=2, warmup_steps=2, eval_every=0,
        log_every=1000,
    )
    info = train(toy_model(), stream, stream, cfg)
    # Either the timed schedule ran to its end, or the 3 s budget cut it short (a loaded machine).
    assert info["planned_steps"] is None or info["planned_steps"] >= TIMING_TO
    assert info["steps"] == info["planned_steps"] or info["train_seconds"] >= 3.0


def test_mtp_is_causal_and_reads_the_next_token() -> None:
    """MTP row i sees t_0..t_{i+1}: changing t_k may move rows >= k-1 and must leave rows < k-1 alone."""
    model = toy_model().eval()
    tokens = torch.randint(3, TOY.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % TOY.vocab_size
    with torch.no_grad():
        _, before, _, _ = model(tokens)
        _, after, _, _ = model(changed)
    # Not bit-equal: the changed token re-groups the experts' batches, which reorders float sums.
    torch.testing.assert_close(before[0, :9], after[0, :9], rtol=1e-5, atol=1e-5)
    assert (before[0, 9] - after[0, 9]).abs().max() > 1e-3


def test_mtp_matches_transformers_mtp_layer() -> None:
    """Same tensors in transformers' MtpModel (the drafter behind `generate(use_mtp=True)`) give the same logits
    from the same hidden states; and transformers feeds it the final-normed states, as this module assumes."""
    modeling_layers = pytest.importorskip("transformers.modeling_layers")
    if not hasattr(modeling_layers, "MtpModel"):
        pytest.skip("this transformers has no MtpModel")
    model = toy_model().eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a swapped or missing norm shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    reference = modeling_layers.MtpModel(model.main, 1).eval()
    renamed = {}
    for name, tensor in model.mtp.state_dict().items():
        if name.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            renamed[f"layers.0.{name}"] = tensor
        elif name.startswith("shared_head.norm."):
            renamed[f"layers.0.post_norm.{name.removeprefix('shared_head.norm.')}"] = tensor
        else:
            renamed[f"layers.0.mtp_block.{name}"] = tensor
    missing, unexpected = reference.load_state_dict(renamed, strict=False)
    assert not unexpected and all(k in ("embed_tokens.weight", "shared_head.weight") for k in missing)
    tokens = torch.randint(3, TOY.vocab_size, (2, 18), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, mtp_logits, _, _ = model(tokens)
        outputs = model.main.model(input_ids=tokens[:, :-2], output_hidden_states=True)
        assert torch.equal(outputs.hidden_states[-1], outputs.last_hidden_state)
        positions = torch.arange(16).expand(2, -1)
        states = reference.forward_layer(0, outputs.last_hidden_state, positions, None, input_ids=tokens[:, 1:-1])
        torch.testing.assert_close(reference._project_to_logits(states), mtp_logits, rtol=1e-5, atol=1e-5)


def test_bias_update_moves_load_toward_balance() -> None:
    model = toy_model()
    balancer = ExpertBiasBalancer(model, rate=0.01)
    assert len(balancer.routers) == TOY.num_hidden_layers - TOY.first_k_dense_replace + 1  # MoE layers + MTP
    with torch.no_grad():
        model(torch.randint(3, TOY.vocab_size, (2, 34), generator=torch.Generator().manual_seed(3)))
    loads = [load.clone() for load in balancer.loads]
    assert all(load.sum() == 2 * 32 * TOY.num_experts_per_tok for load in loads)
    balancer.update()
    for router, load in zip(balancer.routers, loads):
        expected = 0.01 * torch.sign(load.mean() - load)
        assert torch.equal(router.e_score_correction_bias, expected)
    assert balancer.max_violation() > 0
    balancer.reset()
    balancer.close()
    with torch.no_grad():
        model(torch.randint(3, TOY.vocab_size, (1, 10)))
    assert all(load.sum() == 0 for load in balancer.loads)


def test_corpus_is_sorted_filtered_and_split(tmp_path: Path) -> None:
    for rel, data in {
        "b.py": b"b = 1\n", "a.py": b"a = 1\n", "pkg/c.py": b"c = 1\n", "pkg/test/t.py": b"t = 1\n",
        "test/x.py": b"x = 1\n", "idlelib/i.py": b"i = 1\n", "latin.py": b"s = '\xe9'\n", "notes.txt": b"",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    files = stdlib_sources(root=tmp_path)
    assert [f.path for f in files] == ["a.py", "b.py", "pkg/c.py"]
    assert [f.path for f in stdlib_sources(max_bytes=12, root=tmp_path)] == ["a.py", "b.py"]
    corpus = split_heldout(files, every=3)
    assert [f.path for f in corpus.heldout] == ["pkg/c.py"] and len(corpus.train) == 2
    real = stdlib_sources(max_bytes=200_000)
    assert [f.path for f in real] == sorted(f.path for f in real)
    assert not any(EXCLUDED_DIRS.intersection(f.path.split("/")[:-1]) for f in real)
    with pytest.raises(ValueError, match="heldout_every"):
        split_heldout(files, every=1)


def test_window_sampler_is_reproducible() -> None:
    stream = torch.arange(1000)
    a, b = WindowSampler(stream, 34, seed=7), WindowSampler(stream, 34, seed=7)
    batch = a.sample(4)
    assert torch.equal(batch, b.sample(4)) and batch.shape == (4, 34)
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 33, dtype=torch.long))


def test_lr_schedule() -> None:
    cfg = TrainConfig(out=Path("unused"), lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 110, cfg) == pytest.approx(0.1) and lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(60, 110, cfg) == pytest.approx(0.55) and lr_at(110, 110, cfg) == pytest.approx(0.1)
    assert lr_at(50, None, cfg) == 1.0  # peak until the step count is known


def test_cli_flags_map_to_the_config() -> None:
    cfg = parse_args(["--out", "ckpt", "--minutes", "2.5", "--device", "cpu", "--steps", "7", "--mtp-weight", "0.1"])
    assert cfg == TrainConfig(out=Path("ckpt"), minutes=2.5, device="cpu", steps=7, mtp_weight=0.1)
    assert parse_args(["--out", "x"]).steps is None


def test_bad_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="n_routed_experts=6"):
        TinyModelConfig(n_routed_experts=6)
    with pytest.raises(ValueError, match="batch_size=0"):
        TrainConfig(out=Path("x"), batch_size=0)


def test_default_checkpoint_fits_in_20_mb() -> None:
    """bf16 weights + the MTP layer's embedding/head copies + ~1 MB of tokenizer files."""
    config = TinyModelConfig()
    with torch.device("meta"):
        model = DeepseekV3WithMTP(config.to_hf(bos_token_id=0, eos_token_id=1, pad_token_id=2))
    stored = model.parameter_count() + 2 * config.vocab_size * config.hidden_size
    assert 2 * stored + 1_000_000 <= 20_000_000
