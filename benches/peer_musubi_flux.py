"""(Copied from the steering repo's shared/peers/; runs beside benches/models.py in the same device call.)

The best training peer on the flagship model: musubi-tuner's H2D-only block swap (LoRAStreamOffloader, pinned,
ring of GPU buffers) driving a full-size diffusers Flux-dev transformer (12B, random init, bf16), 4096 image + 512
text tokens, the model's own gradient checkpointing, LoRA r=16 on attention as forward hooks (musubi's own LoRA
style: peft wrappers do not fit its Linear-weight swap). Resident with the same LoRA is measured in the same run,
eagerly only (labelled "resident (eager)": the compiled baseline is benches/peer_offload_flux.py's). Per config: step
ms, peak GiB allocated and reserved over the timed steps, and the first (warm-up) step's seconds and peaks.
Env: SWAPS (musubi blocks_to_swap list, musubi's Flux split: double n//2, single (n-n//2)*2+1), RING, STEPS,
TINY=1 for a small config that also checks the loss against resident. Prints JSON lines."""
import json, os, sys, time, traceback
import torch

sys.path.insert(0, os.environ.get("MUSUBI_OFFLOAD_DIR", os.path.join(os.getcwd(), ".peer")))  # holds musubi_offload.py
from musubi_offload import LoRAStreamOffloader
from _common import Sync, first_step, host_memory, reset_host_peak, source_state  # benches/ is this script's folder

dev = torch.device("cuda")
sync = Sync("cuda")
torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 cuDNN SDPA backward faults at this shape on the H100
STEPS = int(os.environ.get("STEPS", 3)); RING = int(os.environ.get("RING", 2)); TINY = os.environ.get("TINY") == "1"
SWAPS = [int(s) for s in os.environ.get("SWAPS", "34,18").split(",") if s]
IMG, TXT = (256, 64) if TINY else (4096, 512)


def emit(k, v): print(json.dumps({k: v}), flush=True)


def add_lora(m, r=16):
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and "transformer_blocks." in name and name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v", "0") and ".attn." in name:
            mod.register_parameter("lora_a", torch.nn.Parameter(torch.randn(r, mod.in_features, device=mod.weight.device, dtype=torch.bfloat16) * 0.01))
            mod.register_parameter("lora_b", torch.nn.Parameter(torch.randn(mod.out_features, r, device=mod.weight.device, dtype=torch.bfloat16) * 0.01))
            mod.register_forward_hook(lambda mm, i, o: o + (i[0] @ mm.lora_a.t()) @ mm.lora_b.t())


def build():
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    cfg = dict(num_layers=3, num_single_layers=6, attention_head_dim=64, num_attention_heads=4, joint_attention_dim=256,
               pooled_projection_dim=128, in_channels=64, axes_dims_rope=(16, 24, 24)) if TINY else {}
    with torch.device("cuda"):
        m = FluxTransformer2DModel(guidance_embeds=True, **cfg).to(torch.bfloat16)
    m.requires_grad_(False)
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
    return {"ms": ts, **sync.peaks(), **first, "loss": losses[0]}  # peaks: max_memory_allocated / _reserved


def musubi(m, n):
    """musubi's Flux wiring (prepare once, as its trainer does at the switch to training): two offloaders, wait before / submit after each block in the forward loop (not during
    the checkpoint recompute, which musubi's own loop never sees), backward hooks registered by the offloader."""
    nd = n // 2; ns = (n - nd) * 2 + 1
    in_bwd = lambda: torch._C._current_graph_task_id() != -1
    offs = []
    for blocks, s, tag in ((m.transformer_blocks, nd, "double"), (m.single_transformer_blocks, ns, "single")):
        bl = list(blocks)
        off = LoRAStreamOffloader(tag, bl, len(bl), s, True, dev, ring_size=RING, use_pinned_memory=True)
        for i, b in enumerate(bl):
            b.register_forward_pre_hook(lambda mod, a, i=i, off=off: None if in_bwd() else off.wait_for_block(i))
            b.register_forward_hook(lambda mod, a, o, i=i, off=off, bl=bl: None if in_bwd() else off.submit_move_blocks_forward(bl, i))
        offs.append((off, bl))
    t0 = time.perf_counter()
    for off, bl in offs: off.prepare_block_devices_before_forward(bl)
    torch.cuda.empty_cache()
    return offs, round(time.perf_counter() - t0, 1), (nd, ns)


emit("env", {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tiny": TINY, "ring": RING,
            **source_state()})
ref_loss = None
for n in [0] + SWAPS:
    try:
        reset_host_peak()
        m, cfg = build(); kw = inputs(cfg)
        if n == 0:
            emit("params_b", round(sum(p.numel() for p in m.parameters()) / 1e9, 2))
        offs, prep_s, split = musubi(m, n) if n else ([], 0, (0, 0))

        def step():
            loss = m(**kw).sample.float().square().mean()
            loss.backward()
            return loss.item()
        r = timed(step)
        if n == 0:
            ref_loss = r["loss"]
            # the baseline here is eager only (musubi's loop is eager); benches/peer_offload_flux.py measures the
            # resident model under Inductor too, and that is the ratio to quote
            r["baseline"] = "resident (eager), hook LoRA"
        r.update(host_memory())  # RSS, peak RSS since this config began, PyTorch's pinned pool (musubi pins through it)
        r.update(prepare_s=prep_s, double_single_swapped=split, loss_equal_to_resident=(r["loss"] == ref_loss))
        emit("resident_hook_lora" if n == 0 else f"musubi_h2d_ring{RING}_swap{n}", r)
        del m, offs; torch.cuda.empty_cache()
    except Exception:
        emit(f"swap{n}_error", traceback.format_exc()[-1500:])
