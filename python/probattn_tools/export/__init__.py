"""TorchScript and `.pt2` exports for `probattn compare` and the interop tests."""
