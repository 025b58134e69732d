"""HostAdamW's device update in every state format, its kernel under Triton's interpreter (CPU; one JSON line per
case).

Not collected by pytest: test_device_update.py runs it in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported). Each case trains the same small model the same steps twice, every block stepped on the host
(device_update="off") and blocks 1 and 3 stepped by the device lane (train/device.py: the ring, the write-back
into the host states, kernels/adamw.py decoding, stepping and encoding the moments), and reports the losses, how
far each streamed weight ends from the host run's relative to how far it moved, the states' dtypes after the run,
the layers the lane updated and the bytes it moved against `transfer_bytes`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _helpers

# name -> (master, states, the weights' dtype)
CASES = {
    "bf16_master_int8": ("bf16", "int8", torch.bfloat16),
    "fp32_master_int8": ("fp32", "int8", torch.bfloat16),
    "bf16_master_bf16": ("bf16", "bf16", torch.bfloat16),
    "fp32_weight_bf16_states": ("fp32", "bf16", torch.float32),
}
LR, STEPS, DEVICE_BLOCKS = 3e-3, 6, [1, 3]


def _run(master: str, states: str, dtype: torch.dtype, device_update):
    import torch_stagehand as stagehand
    from torch_stagehand.optim import HostAdamW

    from _helpers import toy

    model, x = toy(d=64, n=4, dtype=dtype)
    model.requires_grad_(True)
    rt = stagehand.offload(model, device="cpu", precision="bf16", verbose=False)
    start = [s.module.weight.detach().float().clone() for s in rt.layers]
    opt = HostAdamW(model.parameters(), lr=LR, master=master, states=states, device_update=device_update, seed=3)
    losses = []
    for _ in range(STEPS):
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = [s.module.weight.detach().float().clone() for s in rt.layers]
    device_layers = [s for s in rt.layers if s.block in DEVICE_BLOCKS]
    record = dict(losses=losses, start=start, weights=weights, blocks=[s.block for s in rt.layers],
                  dtypes=sorted({str(opt.state[s.module.weight]["exp_avg"].dtype) for s in rt.layers}))
    if opt.device is not None:
        from torch_stagehand.runtime.train.device import transfer_bytes

        moved = [transfer_bytes(opt.state[s.module.weight], s.module.weight.numel() * s.module.weight.element_size())
                 for s in device_layers]
        record.update(layers_updated=opt.device.layers_updated, device_layers=len(device_layers),
                      bytes_in=opt.device.bytes_in, bytes_out=opt.device.bytes_out,
                      expected_in=STEPS * sum(i for i, _ in moved), expected_out=STEPS * sum(o for _, o in moved),
                      device_blocks=sorted(opt.device_blocks))
    rt.close()
    return record


def run_case(name: str) -> dict:
    master, states, dtype = CASES[name]
    host, device = _run(master, states, dtype, "off"), _run(master, states, dtype, DEVICE_BLOCKS)
    drift = []  # per streamed weight: |device - host| / |host - start|
    for b, s, h, d in zip(host["blocks"], host["start"], host["weights"], device["weights"]):
        drift.append((b, float((d - h).norm() / (h - s).norm())))
    return dict(name=name, host_losses=host["losses"], device_losses=device["losses"],
                drift_device_blocks=max(v for b, v in drift if b in DEVICE_BLOCKS),
                drift_host_blocks=max(v for b, v in drift if b not in DEVICE_BLOCKS),
                dtypes=device["dtypes"], **{k: device[k] for k in ("layers_updated", "device_layers", "bytes_in",
                                                                  "bytes_out", "expected_in", "expected_out",
                                                                  "device_blocks")})


if __name__ == "__main__":
    from _helpers import report_cases

    report_cases("device_update_interp.py", run_case, sys.argv[1:] or list(CASES))
