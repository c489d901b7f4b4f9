"""The PyTorch models and timings that each reproduction and benchmark compares against."""
