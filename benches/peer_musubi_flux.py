"""musubi-tuner's block swap training the flagship model, run from musubi-tuner's own code, beside the stagehand
rows of the same precision (benches/budget_sweep.py --model flux --precision bf16 / int8, same budget).

A full-size diffusers Flux-dev transformer (12B, random init), 4096 image + 512 text tokens, the model's own gradient
checkpointing on every block, LoRA r=16 on the attention projections as forward hooks (musubi's LoRA style: peft's
wrappers do not fit its Linear-weight swap), and an AdamW step on the LoRA parameters every step. Each config is
`weights:swap:compile`:
- weights `bf16`, or `fp8`: musubi's `--fp8_base --fp8_scaled` path (`optimize_state_dict_with_fp8` with its Flux
  targets: the blocks' Linears but the norms' and modulations', block-wise scales, then `apply_fp8_monkey_patch`:
  each Linear dequantizes its fp8 weight to bf16 in its forward). Its int8 counterpart is stagehand's int8 row.
- swap: musubi's `blocks_to_swap` with its Flux split (double n//2, single (n-n//2)*2+1) through
  `LoRAStreamOffloader` (`--block_swap_h2d_only`: pinned masters, a ring of GPU buffers), wired as musubi's Flux
  forward does (wait before / submit after each block outside the compiled block, backward hooks of its own).
- compile `eager`, or `compiled`: musubi's `--compile` (`model_utils.compile_transformer`): each block compiled on
  its own with torch.compile's defaults; with a swap its Linears are left out of the compile (`disable_linear`).
Per config: step ms, peaks over the timed steps, the warm-up step's seconds and peaks, host memory, the loss (equal
to the same weights' resident loss when nothing but the place of the weights differs).

    MUSUBI_DIR=.peer CONFIGS="bf16:0:eager bf16:18:eager fp8:6:eager" python benches/peer_musubi_flux.py
    MUSUBI_DIR=.peer CONFIGS="bf16:0:compiled bf16:18:compiled fp8:0:compiled fp8:6:compiled" python benches/peer_musubi_flux.py

MUSUBI_DIR holds musubi-tuner's package as `musubi_tuner/` (its modules/custom_offloading_utils.py,
modules/fp8_optimization_utils.py, utils/safetensors_utils.py, utils/device_utils.py and the `__init__.py` files),
copied from github:kohya-ss/musubi-tuner; MUSUBI_COMMIT names that commit in the output. Env: STEPS, RING, TINY=1
(a small config). Prints JSON lines."""
import json, os, sys, time, traceback
import torch

sys.path.insert(0, os.environ.get("MUSUBI_DIR", os.path.join(os.getcwd(), ".peer")))
from musubi_tuner.modules.custom_offloading_utils import LoRAStreamOffloader
from musubi_tuner.modules.fp8_optimization_utils import apply_fp8_monkey_patch, optimize_state_dict_with_fp8
from musubi_tuner.utils.model_utils import compile_transformer as musubi_compile_transformer
from _common import Sync, first_step, host_memory, reset_host_peak, source_state  # benches/ is this script's folder

dev = torch.device("cuda")
sync = Sync("cuda")
torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 cuDNN SDPA backward faults at this shape
STEPS = int(os.environ.get("STEPS", 3)); RING = int(os.environ.get("RING", 2)); TINY = os.environ.get("TINY") == "1"
CONFIGS = os.environ.get("CONFIGS", "bf16:0:eager bf16:18:eager fp8:6:eager bf16:0:compiled bf16:18:compiled "
                                    "fp8:0:compiled fp8:6:compiled").split()
IMG, TXT = (256, 64) if TINY else (4096, 512)
# musubi's Flux fp8 targets (flux_models.Flux.fp8_optimization) in diffusers' names: the blocks, not their norms
# (diffusers' norm1.linear / norm1_context.linear / norm.linear are BFL's img_mod / txt_mod / modulation)
FP8_TARGETS, FP8_EXCLUDE = ["transformer_blocks."], ["norm", "mod"]


def emit(k, v): print(json.dumps({k: v}), flush=True)


def add_lora(m, r=16):
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and "transformer_blocks." in name and name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v", "0") and ".attn." in name:
            mod.register_parameter("lora_a", torch.nn.Parameter(torch.randn(r, mod.in_features, device=dev, dtype=torch.bfloat16) * 0.01))
            mod.register_parameter("lora_b", torch.nn.Parameter(torch.randn(mod.out_features, r, device=dev, dtype=torch.bfloat16) * 0.01))
            mod.register_forward_hook(lambda mm, i, o: o + (i[0] @ mm.lora_a.t()) @ mm.lora_b.t())


def build(weights):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    cfg = dict(num_layers=3, num_single_layers=6, attention_head_dim=64, num_attention_heads=4, joint_attention_dim=256,
               pooled_projection_dim=128, in_channels=64, axes_dims_rope=(16, 24, 24)) if TINY else {}
    with torch.device("cuda"):
        m = FluxTransformer2DModel(guidance_embeds=True, **cfg).to(torch.bfloat16)
    m.requires_grad_(False)
    if weights == "fp8":  # as musubi's load_flow_model(fp8_scaled=True): quantize on the GPU, load with assign
        sd = optimize_state_dict_with_fp8(m.state_dict(), dev, FP8_TARGETS, FP8_EXCLUDE, move_to_device=True)
        apply_fp8_monkey_patch(m, sd, use_scaled_mm=False)
        m.load_state_dict(sd, strict=True, assign=True)
        m.requires_grad_(False)
        del sd
    add_lora(m)
    m.enable_gradient_checkpointing(); m.train()
    return m, cfg


def inputs(cfg):
    g = torch.Generator(device="cuda").manual_seed(1)
    jd, pd, ic = cfg.get("joint_attention_dim", 4096), cfg.get("pooled_projection_dim", 768), cfg.get("in_channels", 64)
    return dict(hidden_states=torch.randn(1, IMG, ic, device=dev, dtype=torch.bfloat16, generator=g),
                encoder_hidden_states=torch.randn(1, TXT, jd, device=dev, dtype=torch.bfloat16, generator=g),
                pooled_projections=torch.randn(1, pd, device=dev, dtype=torch.bfloat16, generator=g),
                timestep=torch.tensor([0.5], device=dev), guidance=torch.tensor([3.5], device=dev),
                img_ids=torch.zeros(IMG, 3, device=dev), txt_ids=torch.zeros(TXT, 3, device=dev))


def timed(step):
    losses = []
    first = first_step(lambda: losses.append(step()), sync)  # the warm-up step on its own: seconds, peaks
    ts = []
    sync.reset_peak()
    for _ in range(STEPS):
        t = time.perf_counter(); step(); torch.cuda.synchronize(); ts.append(round((time.perf_counter() - t) * 1e3, 1))
    return {"ms": ts, "step_ms": sorted(ts)[len(ts) // 2], **sync.peaks(), **first, "loss": losses[0]}


def compile_blocks(m, swapping):
    """musubi's --compile with its defaults (backend inductor, mode None, dynamic auto, not fullgraph)."""
    args = type("Args", (), dict(compile_backend="inductor", compile_mode=None, compile_dynamic=None,
                                 compile_fullgraph=False, compile_cache_size_limit=None))()
    musubi_compile_transformer(args, m, [m.transformer_blocks, m.single_transformer_blocks], disable_linear=swapping)


def musubi_swap(m, n):
    """musubi's Flux wiring (prepare once, as its trainer does at the switch to training): two offloaders, wait
    before / submit after each block in the forward loop (not during the checkpoint recompute, which musubi's own
    loop never sees), on the blocks as the model's loop calls them (the compiled wrappers when compiled); the
    offloader's own backward hooks sit on the blocks it was given, as in musubi (offloaders are made before the
    compile)."""
    nd = n // 2; ns = (n - nd) * 2 + 1
    offs = []
    for blocks, s, tag in ((m.transformer_blocks, nd, "double"), (m.single_transformer_blocks, ns, "single")):
        bl = list(blocks)
        offs.append((LoRAStreamOffloader(tag, bl, len(bl), s, True, dev, ring_size=RING, use_pinned_memory=True), bl, blocks))
    return offs, (nd, ns)


def wire(offs):
    for off, bl, blocks in offs:
        for i, b in enumerate(blocks):  # after a compile these are the wrappers: the hooks run outside the graph
            b.register_forward_pre_hook(lambda mod, a, i=i, off=off: None if in_bwd() else off.wait_for_block(i))
            b.register_forward_hook(lambda mod, a, o, i=i, off=off, bl=bl: None if in_bwd() else off.submit_move_blocks_forward(bl, i))
    t0 = time.perf_counter()
    for off, bl, _ in offs:
        off.prepare_block_devices_before_forward(bl)
    torch.cuda.empty_cache()
    return round(time.perf_counter() - t0, 1)


in_bwd = lambda: torch._C._current_graph_task_id() != -1
emit("env", {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tiny": TINY, "ring": RING,
             "steps": STEPS, "musubi_commit": os.environ.get("MUSUBI_COMMIT", "unknown"), **source_state()})
ref_loss = {}
for config in CONFIGS:
    weights, n, compiler = config.split(":"); n = int(n)
    label = f"musubi {weights}, swap {n}, {compiler}" if n else f"resident {weights} (musubi's loop), {compiler}"
    try:
        reset_host_peak()
        m, cfg = build(weights); kw = inputs(cfg)
        offs, split = musubi_swap(m, n) if n else ([], (0, 0))
        if compiler == "compiled":
            compile_blocks(m, swapping=n > 0)
        prep_s = wire(offs) if offs else 0
        lora = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(lora, lr=1e-5)

        def step():
            loss = m(**kw).sample.float().square().mean()
            loss.backward()
            opt.step(); opt.zero_grad(set_to_none=True)
            return loss.item()
        r = timed(step)
        key = (weights, compiler)
        if n == 0:
            ref_loss[key] = r["loss"]
        r.update(host_memory())  # RSS, peak RSS since this config began, PyTorch's pinned pool (musubi pins through it)
        r.update(mode=label, weights=weights, blocks_to_swap=n, compiled=compiler, prepare_s=prep_s,
                 double_single_swapped=split, recomputed="every block (the model's gradient checkpointing)",
                 lora_params_m=round(sum(p.numel() for p in lora) / 1e6, 2),
                 loss_equal_to_resident=None if ref_loss.get(key) is None else r["loss"] == ref_loss[key])
        emit(config, r)
        del m, offs, opt; torch.cuda.empty_cache()
    except Exception:
        emit(f"{config}_error", {"mode": label, "error": traceback.format_exc()[-1500:]})
        torch.cuda.empty_cache()
