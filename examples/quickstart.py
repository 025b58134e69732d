import torch, peft, transformers
import torch_stagehand as stagehand

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
inner = "inductor" if device == "cuda" else "eager"           # Inductor's C++ compile is slow on a CPU
config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config)                 # yours: AutoModelForCausalLM.from_pretrained(folder)
model.requires_grad_(False)                                   # streamed weights are frozen bases
lora_config = peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
model = peft.get_peft_model(model, lora_config)               # peft before offload (or after, then move the model to the device)
rt = stagehand.offload(model, device=device, precision={0: "int8", 3: "int8"})  # prints what it streams
compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
rt.attach(optimizer)                                          # step phases + telemetry, no loop changes
batch = {"input_ids": torch.randint(0, 256, (2, 64), device=device)}
batch["labels"] = batch["input_ids"]
for step in range(3):
    loss = compiled(**batch).loss
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.3f}")

rt.set_precision({3: "bf16"})      # next call runs the new map; compiled variants are re-linked
print(rt.stats())                  # bytes moved, fetches, sync fetches, compiled variants, peak resident
print(stagehand.explain(model, **batch).table())   # the schedule of one step
rt.restore()                       # plain nn.Linear modules and tensors again, bit-exact
