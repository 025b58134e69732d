"""The precision registry: one entry per precision (name, code, host layout, quantize, linear and grad-input from a slot)."""
