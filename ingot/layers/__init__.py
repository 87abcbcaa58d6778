"""Model building blocks. Hot math goes through torch.ops.ingot.* (see ingot.ops)."""
