"""The EAGLE-3 drafter: its paged, cached forward against a plain-torch reference, the loader's
errors, the config's capture-layer conventions, and the target's auxiliary hidden states."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from checkpoints import EAGLE3_SHAPE, VOCAB, eagle3_config, write_eagle3_checkpoint
from encore.backends.metadata import ForwardBatch
from encore.engine import Engine, SamplingParams
from encore.engine.request import Request
from encore.engine.scheduler import ScheduledStep
from encore.engine.spec.draft_kv_cache import DraftKVCache
from encore.engine.step import build_forward_batch
from encore.models.eagle3 import Eagle3Config, load_eagle3

PAGE = 4
HIDDEN = EAGLE3_SHAPE["hidden_size"]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return write_eagle3_checkpoint(tmp_path_factory.mktemp("eagle3"), seed=3)


def load(path, embedding: torch.nn.Embedding | None = None, num_pages: int = 16):
    cfg = Eagle3Config.from_pretrained(path)
    cache = DraftKVCache(num_pages, PAGE, cfg.num_key_value_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    embedding = embedding or torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    return load_eagle3(path, cfg, cache, embedding, torch.device("cpu"), torch.float32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


class Reference:
    """The drafter over a whole sequence with no cache: every position attends to all earlier ones,
    GQA by repeating K/V heads, RoPE from transformers' Llama, float32."""

    def __init__(self, path, embedding: torch.Tensor) -> None:
        tensors = load_file(path / "model.safetensors")
        self.w = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
        raw = json.loads((path / "config.json").read_text())
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
        self.embedding = embedding
        self.eps = raw["rms_norm_eps"]

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def fc(self, aux: torch.Tensor) -> torch.Tensor:
        return aux @ self.w["fc.weight"].T

    def __call__(self, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [n], hidden [n, H] -> (pre-norm output [n, H], logits over the target vocab [n, V])."""
        w, n, d = self.w, len(ids), EAGLE3_SHAPE["head_dim"]
        x = torch.cat([self.norm(self.embedding[ids], "midlayer.input_layernorm.weight"),
                       self.norm(hidden, "midlayer.hidden_norm.weight")], dim=-1)

        def heads(name: str) -> torch.Tensor:
            return (x @ w[f"midlayer.self_attn.{name}.weight"].T).view(n, -1, d).transpose(0, 1)[None]

        q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")  # [1, heads, n, d]
        cos, sin = self.rotary(x, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = (scores.softmax(dim=-1) @ v)[0].transpose(0, 1).flatten(1)  # [n, Hq * d]
        y = hidden + attn @ w["midlayer.self_attn.o_proj.weight"].T
        z = self.norm(y, "midlayer.post_attention_layernorm.weight")
        out = y + (F.silu(z @ w["midlayer.mlp.gate_proj.weight"].T) * (z @ w["midlayer.mlp.up_proj.weight"].T)
                   ) @ w["midlayer.mlp.down_proj.weight"].T
        draft = self.norm(out, "norm.weight") @ w["lm_head.weight"].T  # [n, Vd]
        logits = torch.full((n, VOCAB), float("-inf"))
        logits[:, torch.arange(draft.shape[1]) + w["d2t"]] = draft
        return out, logits


def step_batch(rows: list[tuple[int, int, list[int]]], num_extends: int, q_len: int, ids: list[int]) -> ForwardBatch:
    """rows: (start position, tokens, pages) each, prefill rows first."""
    positions = [p for start, n, _ in rows for p in range(start, start + n)]
    slots = [pages[p // PAGE] * PAGE + p % PAGE for start, n, pages in rows for p in range(start, start + n)]
    indptr = [0]
    for _, n, _ in rows:
        indptr.append(indptr[-1] + n)
    width = max(len(pages) for _, _, pages in rows)
    return ForwardBatch(
        num_extends=num_extends, q_len_per_req=q_len, bs=len(rows), num_tokens=len(positions), page_size=PAGE,
        input_ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        seq_lens=torch.tensor([s + n for s, n, _ in rows], dtype=torch.int32),
        prefix_lens=torch.tensor([s for s, _, _ in rows], dtype=torch.int32),
        qo_indptr=torch.tensor(indptr, dtype=torch.int32),
        page_table=torch.tensor([p + [0] * (width - len(p)) for _, _, p in rows], dtype=torch.int32),
        gather_ids=torch.arange(len(positions)), seq_lens_cpu=[s + n for s, n, _ in rows],
        prefix_lens_cpu=[s for s, _, _ in rows])


def test_cached_forward_matches_the_reference_through_prefill_mixed_and_decode_steps(drafter_dir):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(VOCAB, HIDDEN)
    model, ref = load(drafter_dir, embedding), Reference(drafter_dir, embedding.weight.detach())
    pages = {"a": [3, 1, 5, 7], "b": [2, 6, 4, 8]}  # non-contiguous pages, crossed within every row
    fed = {"a": ([], []), "b": ([], [])}  # per sequence: token ids and hidden inputs so far (reference side)
    last = {}  # per sequence: (encore's, the reference's) output at the last position
    # (rows, num_extends, q_len): EXTEND of both prompts; MIXED (a prefills 2 more, b verifies 3 with
    # the target's states); then DECODE steps fed each drafter's own output.
    plan = [([("a", 7), ("b", 5)], 2, 1), ([("a", 2), ("b", 3)], 1, 3)] + [([("a", 1), ("b", 1)], 0, 1)] * 3
    for step, (rows, num_extends, q_len) in enumerate(plan):
        ids = torch.randint(2, VOCAB, (sum(n for _, n in rows),)).tolist()
        batch = step_batch([(len(fed[s][0]), n, pages[s]) for s, n in rows], num_extends, q_len, ids)
        if step < 2:
            aux = torch.randn(len(ids), 3 * HIDDEN)
            hidden, ref_hidden = model.combine(aux), ref.fc(aux)
        else:
            hidden = torch.cat([last[s][0] for s, _ in rows])
            ref_hidden = torch.cat([last[s][1] for s, _ in rows])
        with torch.inference_mode():
            out = model(batch.input_ids, batch.positions, hidden, batch)
            logits = model.compute_logits(out)
        start = 0
        for s, n in rows:
            fed[s][0].extend(ids[start:start + n])
            fed[s][1].append(ref_hidden[start:start + n])
            want_out, want_logits = ref(fed[s][0], torch.cat(fed[s][1]))
            got = logits[start:start + n]
            assert torch.equal(got.isinf(), want_logits[-n:].isinf()), (step, s)
            finite = ~got.isinf()
            assert rel_err(got[finite], want_logits[-n:][finite]) <= 1e-5, (step, s)
            last[s] = (out[start + n - 1:start + n], want_out[-1:])
            start += n


def copy_with(src, tmp_path, edit=None, config=None) -> str:
    path = tmp_path / "edited"
    shutil.copytree(src, path)
    if edit is not None:
        tensors = load_file(path / "model.safetensors")
        edit(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        raw = json.loads((path / "config.json").read_text())
        config(raw)
        (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("edit,error", [
    (lambda t: t.pop("midlayer.self_attn.k_proj.weight"), r"tensors missing .*midlayer\.self_attn\.k_proj\.weight"),
    (lambda t: t.pop("midlayer.mlp.up_proj.weight"), r"tensors missing .*midlayer\.mlp\.gate_up_proj\.weight"),
    (lambda t: t.pop("d2t"), r"tensors missing .*'d2t'"),
    (lambda t: t.update({"midlayer.self_attn.q_norm.weight": torch.ones(16)}),
     r"unknown tensors .*midlayer\.self_attn\.q_norm\.weight"),
    (lambda t: t.update({"fc.weight": torch.zeros(HIDDEN, 100)}), r"fc\.weight has shape \(64, 100\)"),
    (lambda t: t.update({"d2t": t["d2t"] + VOCAB}), r"d2t .* outside the vocabulary \[0, 320\)"),
])
def test_loader_errors_name_the_tensor(drafter_dir, tmp_path, edit, error):
    with pytest.raises(ValueError, match=error):
        load(copy_with(drafter_dir, tmp_path, edit))


def test_config_without_draft_vocab_size_drafts_over_the_whole_vocab(tmp_path):
    def full_vocab(t):
        t["lm_head.weight"] = torch.randn(VOCAB, HIDDEN)
        del t["d2t"], t["t2d"]

    path = copy_with(write_eagle3_checkpoint(tmp_path / "src"), tmp_path, full_vocab,
                     lambda raw: raw.pop("draft_vocab_size"))
    model = load(path)
    assert model.cfg.draft_vocab_size == VOCAB and not model.d2t.any()
    with torch.inference_mode():
        assert model.compute_logits(torch.randn(3, HIDDEN)).isfinite().all()


def test_checkpoint_embedding_is_used_when_present(tmp_path):
    path = write_eagle3_checkpoint(tmp_path, with_embedding=True)
    target = torch.nn.Embedding(VOCAB, HIDDEN)
    model = load(path, target)
    assert model.embed_tokens is not target
    assert torch.equal(model.embed_tokens.weight, load_file(path / "model.safetensors")["embed_tokens.weight"])


@pytest.mark.parametrize("keys,layers,want", [
    ({}, 3, (0, 1, 2)),
    ({}, 61, (2, 30, 58)),  # (2, L // 2, L - 3): both engines' default
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}, 61, (2, 30, 58)),  # SGLang: outputs
    ({"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}, 61, (2, 30, 58)),  # vLLM: inputs
    ({"eagle_aux_hidden_state_layer_ids": [58, 2, 30]}, 61, (2, 30, 58)),
])
def test_capture_layers_follow_each_config_convention(keys, layers, want):
    assert Eagle3Config.from_dict({**eagle3_config(VOCAB, 200), **keys}).capture_layers(layers) == want


@pytest.mark.parametrize("keys,error", [
    ({"architectures": ["LlamaForCausalLM"]}, r"'LlamaForCausalLM'\] is not an EAGLE-3 drafter"),
    ({"num_hidden_layers": 2}, r"num_hidden_layers=2 are not supported"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, r"3 distinct auxiliary layer ids, got \[1, 1, 2\]"),
    ({"draft_vocab_size": 400}, r"draft_vocab_size must be in \[1, vocab_size=320\], got 400"),
])
def test_config_errors_name_the_value(keys, error):
    with pytest.raises(ValueError, match=error):
        Eagle3Config.from_dict({**eagle3_config(VOCAB, 200), **keys})


def test_capture_layers_must_fit_the_target():
    with pytest.raises(ValueError, match=r"\[5, 6, 7\] do not fit a target of 3 layers"):
        Eagle3Config.from_dict({**eagle3_config(VOCAB, 200), "eagle_aux_hidden_state_layer_ids": [5, 6, 7]}
                               ).capture_layers(3)


@pytest.mark.parametrize("sglang_ids,want", [(None, (0, 1, 2)), ([0, 1, 2], (1, 2, 3))])
def test_target_returns_the_inputs_of_the_capture_layers(v3_dir, drafter_dir, tmp_path, sglang_ids, want):
    """The target's output is [final-normed ‖ input of each capture layer]: checked against
    transformers' hidden states (input of layer i, the last one normed) and, for capture index L
    (the last layer's output), by normalizing it."""
    def config(raw: dict) -> None:
        if sglang_ids is not None:
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_ids}

    draft = copy_with(drafter_dir, tmp_path, config=config)
    engine = Engine(str(v3_dir), device="cpu", page_size=PAGE,
                    speculative={"method": "eagle3", "num_speculative_tokens": 1, "draft_model": str(draft)})
    assert engine.runner.model.model.aux_layers == want
    ids = torch.randint(2, VOCAB, (1, 9))
    req = Request("a", ids[0].tolist(), SamplingParams(), 0, None)
    assert engine.kv.reserve("a", 9)
    batch, _ = build_forward_batch(ScheduledStep(extends=[(req, 9)], decodes=[], q_len_per_req=2), engine.kv,
                                   engine.runner.device)
    with torch.inference_mode():
        out = engine.runner.forward(batch)  # [9, 4 * H]
        states = AutoModelForCausalLM.from_pretrained(v3_dir, dtype=torch.float32)(ids, output_hidden_states=True
                                                                                   ).hidden_states
        normed_last = engine.runner.model.model.norm(out[:, 3 * HIDDEN:])
    columns = out.split(HIDDEN, dim=-1)
    assert rel_err(columns[0], states[3][0]) <= 1e-5
    for layer, column in zip(want, columns[1:]):
        want_state = states[layer][0] if layer < 3 else states[3][0]
        assert rel_err(normed_last if layer == 3 else column, want_state) <= 1e-5, layer
