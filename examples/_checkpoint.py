"""The examples' check of their FOLDER argument, before `from_pretrained` reads it.

Given a folder that does not exist, `from_pretrained` takes the name for a Hub model id and
answers with a message about not reaching the Hub; an existing folder without weights fails
deep inside the library. This says, in one line, which folder is missing or what it lacks.
"""

import glob
import os
import sys

# What a transformers causal LM folder (save_pretrained, or a Hub snapshot) holds: a glob per thing.
CAUSAL_LM = {
    "config.json": ("config.json",),
    "weights (*.safetensors or pytorch_model*.bin)": ("*.safetensors", "pytorch_model*.bin"),
    "tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model)":
        ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"),
}
# What a diffusers model folder holds (a pipeline's transformer/ subfolder, or the transformer alone).
DIFFUSERS_MODEL = {
    "config.json": ("config.json",),
    "weights (diffusion_pytorch_model*.safetensors or .bin)":
        ("diffusion_pytorch_model*.safetensors", "diffusion_pytorch_model*.bin"),
}


def require_checkpoint(folder, kind, needs, inside=None):
    """Exit with one line naming `folder` unless it is a folder whose `inside` (default: itself) holds one
    file matching each of `needs`' globs; return `folder`."""
    if not os.path.isdir(folder):
        what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        sys.exit(f"error: {folder!r} {what}: give a {kind} checkpoint folder (what save_pretrained writes, "
                 "or a downloaded snapshot; examples/make_tiny_checkpoint.py writes a tiny one)")
    inside = inside or folder
    missing = [thing for thing, patterns in needs.items()
               if not any(glob.glob(os.path.join(glob.escape(inside), p)) for p in patterns)]
    if missing:
        sys.exit(f"error: {inside!r} does not look like a {kind} checkpoint: it has no {'; no '.join(missing)}")
    return folder
