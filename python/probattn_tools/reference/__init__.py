"""The independent PyTorch references: formulas, the pure-PyTorch multi-head module, the variant
registry, the parity cases, and reference BLEU and VQA scoring."""
