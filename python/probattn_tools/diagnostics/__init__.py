"""One-off probes behind the analyses of the VQA READMEs."""
