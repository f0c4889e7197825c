"""Write encore-tiny as a Hugging Face checkpoint laid out like DeepSeek-V3's, MTP layer included, and check it.

`DeepseekV3ForCausalLM.save_pretrained` writes the main model (experts split per expert as
`mlp.experts.{e}.{gate,up,down}_proj.weight`). The MTP layer is appended as layer L = num_hidden_layers
in that same layout, plus its own tensors: `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
`shared_head.head` -- the names DeepSeek-V3's checkpoint uses for `model.layers.61.*`, which vLLM's and
SGLang's MTP loaders read. Router biases stay fp32 (transformers loads them fp32 anyway).
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from encore.models.tiny.mtp import DeepseekV3WithMTP

# Tensors only the MTP layer has, relative to `model.layers.{L}.`.
MTP_ONLY_TENSORS = (
    "embed_tokens.weight",
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)
# Of those, the copies of the main model's embedding and head (DeepSeek-V3 §2.2: shared while training).
SHARED_TENSORS = ("embed_tokens.weight", "shared_head.head.weight")
WEIGHTS_FILE = "model.safetensors"


def bf16_main_model(model: DeepseekV3WithMTP) -> DeepseekV3ForCausalLM:
    """A fresh main model holding the shipped weights, numerically what `from_pretrained(dtype=bf16)` builds:
    bf16 parameters, fp32 buffers (router biases, and RoPE frequencies, which `.to(bf16)` would round)."""
    shipped = DeepseekV3ForCausalLM(model.main.config).to(model.main.device)
    shipped.load_state_dict(model.main.state_dict())
    for param in shipped.parameters():
        param.data = param.data.to(torch.bfloat16)
    return shipped.eval()


def split_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers 5 holds experts fused ([E, 2I, H] gate|up and [E, H, I] down); checkpoints hold them split."""
    if name == "mlp.experts.gate_up_proj":
        gate, up = tensor.chunk(2, dim=1)  # forward does `linear(x, gate_up[e]).chunk(2)`: gate rows first
        return {
            **{f"mlp.experts.{e}.gate_proj.weight": w for e, w in enumerate(gate)},
            **{f"mlp.experts.{e}.up_proj.weight": w for e, w in enumerate(up)},
        }
    if name == "mlp.experts.down_proj":
        return {f"mlp.experts.{e}.down_proj.weight": w for e, w in enumerate(tensor)}
    return {name: tensor}


def mtp_tensors(model: DeepseekV3WithMTP) -> dict[str, torch.Tensor]:
    """The MTP layer's checkpoint tensors, named `model.layers.{L}.*`: bf16, router bias fp32, on the CPU."""
    prefix = f"model.layers.{model.main.config.num_hidden_layers}."
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.mtp.state_dict().items():
        tensors.update(split_experts(name, tensor))
    tensors["embed_tokens.weight"] = model.main.model.embed_tokens.weight
    tensors["shared_head.head.weight"] = model.main.lm_head.weight
    out = {}
    for name, tensor in tensors.items():
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        # Copies: safetensors refuses tensors that share storage, and the head/embedding are shared.
        out[prefix + name] = tensor.detach().to("cpu", dtype).contiguous().clone()
    return out


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> DeepseekV3WithMTP:
    """A checkpoint `save_checkpoint` wrote, back as the training module (fp32 parameters, fp32 buffers): the
    main model through `from_pretrained`, the MTP layer from its `model.layers.{L}.*` tensors (experts fused
    back into transformers' layout; its embedding and head copies are the main model's, as in training)."""
    main = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model = DeepseekV3WithMTP(main.config)
    model.main.load_state_dict(main.state_dict())
    prefix = f"model.layers.{main.config.num_hidden_layers}."
    stored = {k[len(prefix):]: v for k, v in load_file(path / WEIGHTS_FILE).items() if k.startswith(prefix)}
    experts = range(main.config.n_routed_experts)
    state = {k: v for k, v in stored.items() if ".experts." not in k and k not in SHARED_TENSORS}
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([stored[f"mlp.experts.{e}.gate_proj.weight"], stored[f"mlp.experts.{e}.up_proj.weight"]])
         for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([stored[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    model.mtp.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(device)


def _check_layout(tensors: dict[str, torch.Tensor], moe_layer: int, mtp_layer: int) -> None:
    """The MTP layer must look like a regular MoE layer of the same file, plus exactly the MTP-only tensors."""

    def suffixes(layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}."
        return {k[len(prefix) :]: tuple(v.shape) for k, v in tensors.items() if k.startswith(prefix)}

    regular, mtp = suffixes(moe_layer), suffixes(mtp_layer)
    extra = {k: v for k, v in mtp.items() if k not in MTP_ONLY_TENSORS}
    if extra != regular or not set(MTP_ONLY_TENSORS) <= mtp.keys():
        diff = sorted(set(extra.items()) ^ set(regular.items()))
        raise RuntimeError(f"MTP layer {mtp_layer} is not laid out like MoE layer {moe_layer}: {diff[:8]}")


def save_checkpoint(model: DeepseekV3WithMTP, shipped: DeepseekV3ForCausalLM, out: Path) -> None:
    """config.json, generation_config.json and model.safetensors (main + MTP) into `out`."""
    shipped.save_pretrained(out)
    path = out / WEIGHTS_FILE
    tensors = load_file(path)
    tensors.update(mtp_tensors(model))
    config = model.main.config
    _check_layout(tensors, moe_layer=config.first_k_dense_replace, mtp_layer=config.num_hidden_layers)
    save_file(tensors, path, metadata={"format": "pt"})
    # transformers 5 writes "dtype"; engines and transformers 4 read "torch_dtype".
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def replace_mtp_layer(model: DeepseekV3WithMTP, src: Path, out: Path) -> None:
    """`src`'s checkpoint into `out` (which may be `src`) with the MTP layer's tensors taken from `model`; every
    other file is copied, report.json aside, and every other tensor stays `src`'s, bit for bit. The embedding
    and head copies must equal the stored ones: the main model's are not to change."""
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != src.resolve():
        for path in src.iterdir():
            if path.is_file() and path.name not in (WEIGHTS_FILE, "report.json"):
                shutil.copy2(path, out / path.name)
    tensors = load_file(src / WEIGHTS_FILE)
    replaced = mtp_tensors(model)
    missing = sorted(replaced.keys() - tensors.keys())
    if missing:
        raise ValueError(f"{src} has no MTP layer to replace: {missing[:4]} ...")
    prefix = f"model.layers.{model.main.config.num_hidden_layers}."
    changed = [name for name in SHARED_TENSORS if not torch.equal(replaced[prefix + name], tensors[prefix + name])]
    if changed:
        raise ValueError(f"{changed} differ from {src}'s: the main model's embedding and head must not change")
    tensors.update(replaced)
    config = model.main.config
    _check_layout(tensors, moe_layer=config.first_k_dense_replace, mtp_layer=config.num_hidden_layers)
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})


@torch.no_grad()
def greedy(model: DeepseekV3ForCausalLM, input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt ([1, T] ids) with transformers' generate; new ids only."""
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, input_ids.shape[1] :].tolist()


@dataclass(frozen=True, slots=True)
class ReloadCheck:
    same_greedy_tokens: bool
    missing_keys: list[str]
    # transformers does not know the MTP layer: it warns that these keys are unexpected and skips them.
    unexpected_key_count: int
    unexpected_keys_are_the_mtp_layer: bool


def check_reload(
    out: Path, reference: list[list[int]], prompts: list[torch.Tensor], max_new_tokens: int
) -> ReloadCheck:
    """Load `out` with `DeepseekV3ForCausalLM.from_pretrained` and compare its greedy tokens to `reference`."""
    loaded, info = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    loaded.to(prompts[0].device).eval()
    mtp_prefix = f"model.layers.{loaded.config.num_hidden_layers}."
    # Keys as transformers names them after its own conversion (experts fused), hence no per-expert names here.
    unexpected = {k.removeprefix(mtp_prefix) for k in info["unexpected_keys"] if k.startswith(mtp_prefix)}
    return ReloadCheck(
        same_greedy_tokens=all(greedy(loaded, p, max_new_tokens) == ref for p, ref in zip(prompts, reference)),
        missing_keys=sorted(info["missing_keys"]),
        unexpected_key_count=len(info["unexpected_keys"]),
        unexpected_keys_are_the_mtp_layer=len(unexpected) == len(info["unexpected_keys"])
        and set(MTP_ONLY_TENSORS) <= unexpected,
    )
